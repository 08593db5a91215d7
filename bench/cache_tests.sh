#!/usr/bin/env bash
# HTTP-cache conformance, in one run on this machine: the public HTTP-cache test suite, in two
# versions, each run unmodified against three reverse proxies and scored with its own scoring,
# side by side with the results that version publishes:
#
#   0.4.5    the npm package http-cache-tests 0.4.5 (the version the test command runs,
#            tests/it/cache_tests.rs)
#   dev      the suite's development version: the repository http-tests/cache-tests (BSD-3-Clause)
#            at commit DEV_COMMIT below, which reads RFC 9111 more closely (370 tests),
#            vendored under its licence in bench/cache-tests-dev (or another copy of its files,
#            CACHE_TESTS_DEV_DIR), run from a copy in the target dir with its npm dependencies
#
# For each version:
#   suite    its origin server (through tests/it/cache_tests/origin.mjs, which keeps it on
#            127.0.0.1), one per target on its own port, started fresh with an empty scratch dir
#            as its working dir (it serves files from there); its command-line client (the whole
#            suite, ~20 s) against the target, invoked as tests/it/cache_tests.rs invokes it
#   nginx    Debian's nginx proxy_cache with the config the suite's authors use (that version's
#            docker/nginx/nginx.conf; see NGINX_TMPL below for what is adapted)
#   varnish  Debian's Varnish with the builtin VCL and only a backend (what a user gets by
#            default), started like bench/lib.sh's start_varnish
#   cacheguard  release build, embedded mode (no Redis; with REDIS_URL, shared mode), the config
#            of tests/it/cache_tests.rs
#            (CgConfig::with_upstream defaults plus tests/it/cache_tests/routes.toml: every GET
#            cached by the origin's freshness, every write forwarded and invalidating its path)
#   score    tests/it/cache_tests/score.mjs (the version's own determineTestResult: kinds and
#            dependencies applied) on each run, and on the results that version publishes
#            (results/*.json of its non-browser caches, per its results/index.mjs) too
#
# Targets run one after another (never in parallel), each with its own fresh origin and an empty
# cache; a full run of both versions takes about 4 minutes.
#
# usage: bash bench/cache_tests.sh
# env:   BASE_PORT=29880 (uses BASE_PORT+1 .. +7)
#        SUITES="0.4.5 dev" (which versions to run)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        CACHE_TESTS_DIR=path (another copy of http-cache-tests 0.4.5; by default the copy
#        scripts/test.sh installs, target/cache-tests/node_modules/http-cache-tests, installed
#        here the same way when it is missing)
#        CACHE_TESTS_DEV_DIR=path (a copy of the development version's files, used as it is;
#        by default the copy vendored in bench/cache-tests-dev at DEV_COMMIT is copied into
#        target/cache-tests-dev/<commit>/, once, and its npm dependencies installed there)
#        REDIS_URL=redis://127.0.0.1:PORT (cacheguard in shared mode on that Redis, which the
#        caller runs and empties beforehand, as tests/it/cache_tests.rs's shared run does;
#        default: embedded mode)
#        KEEP_TMP=1 (keep the scratch dir with the nginx prefixes, the varnishd workdirs, ...)
#
# Writes bench/results/cache-tests-<UTC timestamp>/<version>/ (per target: the client's
# results.json and stderr, score.txt, the origin's log, the proxy's config and logs; published/:
# the version's results as scored; per-test.tsv: every test's category per row), env.txt and
# summary.md, and prints the markdown summary on stdout. Exits 1 (after the summary) when a
# target's run did not produce results. Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults BASE_PORT=29880 SUITES="0.4.5 dev" REDIS_URL=""
PACKAGE_VERSION=0.4.5
# The suite's development version: http-tests/cache-tests at this commit (2026-07-20,
# "Merge pull request #201"), as vendored in bench/cache-tests-dev.
DEV_COMMIT=b55b8bda3dbb8c927c04e85bd8d496a8caa3e4ba
CLIENT_TIMEOUT_S=150 # tests/it/cache_tests.rs CLIENT_DEADLINE
LIVE_TARGETS="nginx varnish cacheguard"
check_list SUITES "suite version" 0.4.5 dev

bench_ports NGINX_ORIGIN_PORT NGINX_PORT VARNISH_ORIGIN_PORT VARNISH_PORT CG_ORIGIN_PORT CG_PORT \
    CG_ADMIN_PORT

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish node:nodejs npm:npm curl:curl jq:jq git:git tar:tar
require_tools awk sort join mktemp id ss timeout env
require_free_ports "${BENCH_PORTS[@]}"

ORIGIN_JS=$ROOT/tests/it/cache_tests/origin.mjs
SCORE_JS=$ROOT/tests/it/cache_tests/score.mjs
[[ -f $ORIGIN_JS && -f $SCORE_JS ]] || die "tests/it/cache_tests/origin.mjs or score.mjs missing"

# Per version: the suite's directory, its client (relative to it), a label, where it came from.
declare -A PKG_OF CLI_OF SUITE_LABEL SOURCE_OF

# The npm package, pinned: CACHE_TESTS_DIR, or the copy scripts/test.sh installs under the
# target dir (installed here exactly as scripts/test.sh does when that version is not in place).
package_version() { node -p 'require(process.argv[1]).version' "$1/package.json" 2>/dev/null || true; }
prepare_package() {
    local pkg prefix
    if [[ -n ${CACHE_TESTS_DIR:-} ]]; then
        pkg=$(realpath -m "$CACHE_TESTS_DIR")
    else
        prefix=$(realpath -m "${CARGO_TARGET_DIR:-target}/cache-tests")
        pkg=$prefix/node_modules/http-cache-tests
        if [[ $(package_version "$pkg") != "$PACKAGE_VERSION" || ! -d $prefix/node_modules/node-fetch ]]; then
            log "installing http-cache-tests@$PACKAGE_VERSION into $prefix"
            mkdir -p "$prefix"
            npm install --prefix "$prefix" --omit=dev --no-audit --no-fund --loglevel=error \
                "http-cache-tests@$PACKAGE_VERSION" >&2 || die "npm install http-cache-tests@$PACKAGE_VERSION failed"
        fi
    fi
    [[ $(package_version "$pkg") == "$PACKAGE_VERSION" ]] ||
        die "$pkg is not http-cache-tests $PACKAGE_VERSION (got '$(package_version "$pkg")')"
    PKG_OF[0.4.5]=$pkg
    CLI_OF[0.4.5]=cli.mjs
    SUITE_LABEL[0.4.5]="http-cache-tests $PACKAGE_VERSION (npm)"
    SOURCE_OF[0.4.5]=$pkg
}

# The development version, pinned to DEV_COMMIT: CACHE_TESTS_DEV_DIR as it is, or the copy
# vendored in bench/cache-tests-dev, copied once into the target dir (so that its npm
# dependencies, undici for the interim-answer tests, are installed outside the repository).
prepare_dev() {
    local dir
    if [[ -n ${CACHE_TESTS_DEV_DIR:-} ]]; then
        dir=$(realpath -m "$CACHE_TESTS_DEV_DIR")
        [[ -f $dir/test-engine/cli.mjs ]] ||
            die "CACHE_TESTS_DEV_DIR=$dir does not hold the suite's development version (no test-engine/cli.mjs)"
        SOURCE_OF[dev]="$dir (CACHE_TESTS_DEV_DIR, as given; expected at ${DEV_COMMIT:0:7})"
    else
        local vendored
        vendored=$(realpath "$(dirname "${BASH_SOURCE[0]}")/cache-tests-dev")
        [[ -f $vendored/test-engine/cli.mjs ]] ||
            die "the vendored development suite is missing: $vendored/test-engine/cli.mjs"
        dir=$(realpath -m "${CARGO_TARGET_DIR:-target}/cache-tests-dev/${DEV_COMMIT:0:12}")
        if [[ ! -f $dir/test-engine/cli.mjs ]]; then
            log "copying the vendored development suite ${DEV_COMMIT:0:7} into $dir"
            rm -rf "$dir"
            mkdir -p "$dir"
            cp -R "$vendored/." "$dir/" || die "copying $vendored into $dir failed"
        fi
        SOURCE_OF[dev]="bench/cache-tests-dev (vendored at $DEV_COMMIT; copied into $dir)"
    fi
    if [[ ! -d $dir/node_modules/undici ]]; then
        log "installing the development suite's npm dependencies into $dir"
        (cd "$dir" && npm install --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error >&2) ||
            die "npm install in $dir failed"
    fi
    PKG_OF[dev]=$dir
    CLI_OF[dev]=test-engine/cli.mjs
    SUITE_LABEL[dev]="http-tests/cache-tests ${DEV_COMMIT:0:7} (development version)"
}

for suite in $SUITES; do
    case $suite in
    0.4.5) prepare_package ;;
    dev) prepare_dev ;;
    esac
done

build_cacheguard

bench_results cache-tests-

# --- environment -----------------------------------------------------------------------

write_env nginx varnishd <<EOF
node: $(node --version)
suites: $SUITES
$(for suite in $SUITES; do echo "suite_${suite/0.4.5/npm}: ${SUITE_LABEL[$suite]}: ${SOURCE_OF[$suite]}"; done)
targets: $LIVE_TARGETS (one after another, each with its own origin)
EOF

# --- configs -----------------------------------------------------------------------------

# nginx: the version's docker/nginx/nginx.conf, whose directives are reproduced as shipped:
#     proxy_cache_path  /var/cache/nginx levels=1:2 keys_zone=my-cache:8m max_size=1000m inactive=600m;
#     proxy_temp_path /var/cache/nginx/tmp;
#     server { listen 8002; location / { proxy_pass http://localhost:8000;
#              proxy_cache my-cache; proxy_cache_revalidate on; } }
# (the development version adds `proxy_http_version 1.1;` to the location: taken from its file)
# (no proxy_cache_valid, no proxy_cache_lock, no upstream keep-alive: none is shipped). The
# authors' image copies it into sites-enabled/ of the distribution's nginx.conf, so its http{}
# settings are reproduced too (sendfile, tcp_nopush, types_hash_max_size, mime.types,
# default_type, gzip on; worker_processes auto, worker_connections 768: docker/entrypoint.sh
# means to raise that to 2048, but its sed is unquoted and fails). Adapted: the cache and temp
# paths, pid, error and access logs live in the scratch prefix; listen 127.0.0.1:PORT instead of
# 8002 and proxy_pass http://127.0.0.1:ORIGIN_PORT instead of localhost:8000; daemon off in the
# foreground (started by PID); user = whoever runs this; the distribution's ssl_* lines (no TLS
# here), empty conf.d/modules-enabled includes and default site are left out.
NGINX_TMPL=$BENCH_TMP/nginx-cache-tests.conf.tmpl
cat >"$NGINX_TMPL" <<'EOF'
# nginx for bench/cache_tests.sh: http-cache-tests' docker/nginx/nginx.conf inside the
# distribution's nginx.conf, adapted for ports and paths only (see the script).
user @USER@;
worker_processes auto;
daemon off;
master_process on;
pid @PREFIX@/nginx.pid;
error_log @PREFIX@/error.log;

events {
    worker_connections 768;
}

http {
    sendfile on;
    tcp_nopush on;
    types_hash_max_size 2048;
    include /etc/nginx/mime.types;
    default_type application/octet-stream;
    access_log @PREFIX@/access.log;
    gzip on;

    client_body_temp_path @PREFIX@/tmp/body;
    fastcgi_temp_path     @PREFIX@/tmp/fastcgi;
    uwsgi_temp_path       @PREFIX@/tmp/uwsgi;
    scgi_temp_path        @PREFIX@/tmp/scgi;

    # --- docker/nginx/nginx.conf (@SUITE@) ---
    proxy_cache_path  @PREFIX@/cache levels=1:2 keys_zone=my-cache:8m max_size=1000m inactive=600m;
    proxy_temp_path @PREFIX@/cache/tmp;

    server {
        listen       127.0.0.1:@PORT@;

        location / {
            proxy_pass http://127.0.0.1:@ORIGIN_PORT@;
            proxy_cache my-cache;
            proxy_cache_revalidate on;
            @HTTP_VERSION@
        }
    }
}
EOF

# Varnish: the package ships no VCL; the builtin VCL with only a backend (the stock
# /etc/varnish/default.vcl with the port changed). Its vcl_recv passes PUT, the suite's setup.
VARNISH_TMPL=$BENCH_TMP/varnish-cache-tests.vcl.tmpl
cat >"$VARNISH_TMPL" <<'EOF'
vcl 4.1;
# Varnish for bench/cache_tests.sh: the builtin VCL, only a backend (the suite's origin).
backend default {
    .host = "127.0.0.1";
    .port = "@ORIGIN_PORT@";
}
EOF

# cacheguard: what tests/it/cache_tests.rs runs in embedded mode, i.e. CgConfig::with_upstream's
# sections (tests/it/common.rs) and the test's ROUTES, on the bench ports.
cg_cache_tests_config() {
    cat <<EOF
[server]
listen = "127.0.0.1:$CG_PORT"
max_header_bytes = 16384
max_body_bytes = 10485760

[upstream]
url = "http://127.0.0.1:$CG_ORIGIN_PORT"
timeout = "10s"
max_concurrency = 256
queue_timeout = "1s"

[admin]
listen = "127.0.0.1:$CG_ADMIN_PORT"

[cache]
ttl = "60s"
jitter = 0.2
grace = "30s"
negative_ttl = "10s"
max_entry_bytes = 1048576
l1 = "hot"

[lock]
lease = "5s"

EOF
    if [[ -n $REDIS_URL ]]; then
        printf '[redis]\nurl = "%s"\ncommand_timeout = "200ms"\n\n' "$REDIS_URL"
    fi
    cat "$ROOT/tests/it/cache_tests/routes.toml"
}

# --- running the suites ------------------------------------------------------------------

# The version being run: PKG (its directory), CLI (its client, relative to PKG), SOUT (its
# results dir); set by run_version.
PKG="" CLI="" SOUT=""

# origin_exec DIR PORT: the suite's origin on 127.0.0.1:PORT, DIR (empty) as its working dir
# (exec: the PID start_bg records is node's own).
origin_exec() {
    cd "$1" || exit 1
    exec node "$ORIGIN_JS" "$PKG" "$2"
}

# start_suite_origin NAME PORT: the suite's origin for one target, its log in $SOUT/NAME/.
# Sets LAST_PID.
start_suite_origin() {
    local name=$1 port=$2 dir="$BENCH_TMP/origin-$SUITE-$1"
    mkdir -p "$dir"
    start_bg "$SOUT/$name/origin.log" origin_exec "$dir" "$port"
    wait_http "http://127.0.0.1:$port/bench-ready" "$LAST_PID" "the suite's origin for $name"
}

# client_exec BASE_URL RESULTS: the suite's client against BASE_URL, bounded by
# CLIENT_TIMEOUT_S, its stdout (the results JSON) into RESULTS; as tests/it/cache_tests.rs runs it:
# from the suite's dir, base URL and an empty test id (every test) in npm's variables (the
# client ignores --base).
client_exec() {
    cd "$PKG" || exit 1
    exec env npm_config_base="$1" npm_config_id= npm_package_config_id= \
        timeout --signal=TERM "$CLIENT_TIMEOUT_S" node --no-warnings "$CLI" >"$2"
}

# Per "<version>/<target>": label, client run time, problem.
declare -A LABEL_OF=() RUN_S_OF=() PROBLEM_OF=() TEST_COUNT_OF=() DROPPED_OF=() PUBLISHED_OF=()
declare -A PUB_LABEL=()

# run_suite NAME URL: the client against URL into $SOUT/NAME/results.json, scored into
# $SOUT/NAME/score.txt; a problem is recorded in PROBLEM_OF[<version>/NAME].
run_suite() {
    local name=$1 url=$2 dir="$SOUT/$1" rc=0 t0=$SECONDS key="$SUITE/$1"
    log "$SUITE: $name: the suite's client against $url"
    run_bg "$dir/client.stderr" client_exec "$url" "$dir/results.json" || rc=$?
    RUN_S_OF[$key]=$((SECONDS - t0))
    if ((rc != 0)); then
        PROBLEM_OF[$key]="the client exited with $rc (124: killed after ${CLIENT_TIMEOUT_S} s)"
    elif ! jq -e 'type == "object" and length > 0' "$dir/results.json" >/dev/null 2>&1; then
        PROBLEM_OF[$key]="the client wrote no results"
    elif ! node "$SCORE_JS" "$PKG" "$dir/results.json" >"$dir/score.txt" 2>"$dir/score.stderr"; then
        PROBLEM_OF[$key]="score.mjs failed"
    fi
    if [[ -n ${PROBLEM_OF[$key]:-} ]]; then
        rm -f "$dir/score.txt"
        log "WARNING: $SUITE: $name: ${PROBLEM_OF[$key]}; see $dir/client.stderr"
    else
        log "$SUITE: $name: $(awk '$1 == "#" && ($2 == "passed" || $2 == "required-failures") { printf "%s %s; ", $2, $3 }' "$dir/score.txt")client ran ${RUN_S_OF[$key]} s"
    fi
}

# run_version SUITE: the version's test ids, nginx, Varnish and cacheguard against it, its
# published results scored, and its per-test.tsv, all under $OUT/SUITE/.
run_version() {
    SUITE=$1
    PKG=${PKG_OF[$SUITE]}
    CLI=${CLI_OF[$SUITE]}
    SOUT=$OUT/$SUITE
    mkdir -p "$SOUT"/{nginx,varnish,cacheguard,published}
    local origin_pid proxy_pid p

    # Every test of the version, as score.mjs lists them (an empty result set scores all as
    # untested).
    echo '{}' >"$BENCH_TMP/empty.json"
    node "$SCORE_JS" "$PKG" "$BENCH_TMP/empty.json" | awk '!/^#/ { print $1 }' >"$SOUT/suite-ids.txt" ||
        die "score.mjs failed on an empty result set ($SUITE)"
    TEST_COUNT_OF[$SUITE]=$(wc -l <"$SOUT/suite-ids.txt")
    [[ ${TEST_COUNT_OF[$SUITE]} -gt 0 ]] || die "score.mjs listed no tests ($SUITE)"
    jq -R . "$SOUT/suite-ids.txt" | jq -s 'map({(.): true}) | add' >"$BENCH_TMP/ids-$SUITE.json"

    # nginx
    local http_version
    http_version=$(grep -o 'proxy_http_version [0-9.]*;' "$PKG/docker/nginx/nginx.conf" 2>/dev/null || true)
    start_suite_origin nginx "$NGINX_ORIGIN_PORT"
    origin_pid=$LAST_PID
    start_nginx "cache-tests-$SUITE" "$NGINX_TMPL" PORT="$NGINX_PORT" ORIGIN_PORT="$NGINX_ORIGIN_PORT" \
        SUITE="${SUITE_LABEL[$SUITE]}" HTTP_VERSION="$http_version"
    proxy_pid=$LAST_PID
    wait_http "http://127.0.0.1:$NGINX_PORT/bench-ready" "$proxy_pid" "nginx"
    cp "$BENCH_TMP/nginx-cache-tests-$SUITE/nginx.conf" "$SOUT/nginx/nginx.conf"
    run_suite nginx "http://127.0.0.1:$NGINX_PORT"
    stop_pid "$proxy_pid"
    stop_pid "$origin_pid"
    cp "$BENCH_TMP/nginx-cache-tests-$SUITE/error.log" "$BENCH_TMP/nginx-cache-tests-$SUITE/access.log" \
        "$SOUT/nginx/" 2>/dev/null || true
    LABEL_OF[$SUITE/nginx]="$(nginx -v 2>&1 | sed 's|^nginx version: nginx/|nginx |'), proxy_cache, the suite's docker/nginx config"

    # Varnish
    start_suite_origin varnish "$VARNISH_ORIGIN_PORT"
    origin_pid=$LAST_PID
    start_varnish "cache-tests-$SUITE" "$VARNISH_PORT" "$VARNISH_TMPL" ORIGIN_PORT="$VARNISH_ORIGIN_PORT"
    proxy_pid=$LAST_PID
    wait_http "http://127.0.0.1:$VARNISH_PORT/bench-ready" "$proxy_pid" "varnishd"
    cp "$BENCH_TMP/varnish-cache-tests-$SUITE/default.vcl" "$SOUT/varnish/default.vcl"
    run_suite varnish "http://127.0.0.1:$VARNISH_PORT"
    stop_pid "$proxy_pid"
    stop_pid "$origin_pid"
    cp "$BENCH_TMP/varnish-cache-tests-$SUITE/varnishd.log" "$SOUT/varnish/" 2>/dev/null || true
    LABEL_OF[$SUITE/varnish]="Varnish $(varnishd -V 2>&1 | head -n1 | sed -n 's/.*varnish-\([0-9.]*\).*/\1/p'), builtin VCL + backend"

    # cacheguard
    start_suite_origin cacheguard "$CG_ORIGIN_PORT"
    origin_pid=$LAST_PID
    cg_cache_tests_config >"$SOUT/cacheguard/cacheguard.toml"
    launch_cacheguard "cacheguard-$SUITE" "$SOUT/cacheguard/cacheguard.toml" "$CG_PORT" "$CG_ADMIN_PORT" \
        "$SOUT/cacheguard/cacheguard.log"
    proxy_pid=$LAST_PID
    run_suite cacheguard "http://127.0.0.1:$CG_PORT"
    save_metrics "${ADMIN_OF[cacheguard-$SUITE]}" "$SOUT/cacheguard/metrics-end.txt"
    stop_pid "$proxy_pid"
    stop_pid "$origin_pid"
    LABEL_OF[$SUITE/cacheguard]="$("$CG_BIN" --version 2>/dev/null || echo cacheguard), $(if [[ -n $REDIS_URL ]]; then echo "shared on $REDIS_URL"; else echo embedded; fi), the config of tests/it/cache_tests.rs"

    # The version's published results: each file is the client's output as the authors recorded
    # it (older product versions, and for 0.4.5 an older suite). Results for tests this version no
    # longer has are dropped (score.mjs refuses them); tests it added score as untested. Browsers
    # are left out: they are not shared caches.
    local file name version type src dropped published=()
    while IFS=$'\t' read -r file name version type; do
        [[ $type == browser ]] && continue
        p=${file%.json}
        published+=("$p")
        PUB_LABEL[$SUITE/$p]="$name $version"
        src=$PKG/results/$file
        [[ -f $src ]] || die "$src missing"
        jq --slurpfile ids "$BENCH_TMP/ids-$SUITE.json" 'with_entries(select($ids[0][.key]))' "$src" >"$SOUT/published/$p.json"
        dropped=$(jq -r --slurpfile ids "$BENCH_TMP/ids-$SUITE.json" '[keys[] | select($ids[0][.] | not)] | join(", ")' "$src")
        [[ -z $dropped ]] || DROPPED_OF[$SUITE]+="$p.json: $dropped; "
        node "$SCORE_JS" "$PKG" "$SOUT/published/$p.json" >"$SOUT/published/$p.score.txt" ||
            die "score.mjs failed on the published $p.json ($SUITE)"
    done < <(node --input-type=module -e '
        const r = (await import(process.argv[1])).default
        for (const x of r) console.log([x.file, x.name, x.version, x.type].join("\t"))' "$PKG/results/index.mjs")
    PUBLISHED_OF[$SUITE]="${published[*]}"

    # per-test.tsv: id, then each row's category (one column per live target and published
    # file; "-" for a target without results).
    echo '# no results' >"$BENCH_TMP/no-score.txt"
    local cols=(id) files=() t
    for t in $LIVE_TARGETS; do
        cols+=("$t")
        if [[ -f $SOUT/$t/score.txt ]]; then files+=("$SOUT/$t/score.txt"); else files+=("$BENCH_TMP/no-score.txt"); fi
    done
    for p in "${published[@]}"; do
        cols+=("published-$p")
        files+=("$SOUT/published/$p.score.txt")
    done
    {
        (
            IFS=$'\t'
            echo "${cols[*]}"
        )
        awk '
            FNR == 1 { f++ }
            f == 1 { ids[++n] = $1; next }
            !/^#/ { r[f, $1] = $2 }
            END {
                for (i = 1; i <= n; i++) {
                    line = ids[i]
                    for (j = 2; j <= f; j++) line = line "\t" (((j, ids[i]) in r) ? r[j, ids[i]] : "-")
                    print line
                }
            }' "$SOUT/suite-ids.txt" "${files[@]}"
    } >"$SOUT/per-test.tsv"
}

for suite in $SUITES; do
    run_version "$suite"
done

end_env

# --- summary ---------------------------------------------------------------------------

# score_cells SCORE_FILE: the table cells of one scored run.
score_cells() {
    awk '$1 == "#" { c[$2] = $3 }
        END {
            printf "%d | %d | %d | %d | %d | %d | %d | %d / %d | %d", c["pass"], c["fail"],
                c["optional-fail"], c["dependency-fail"], c["setup-fail"], c["retry"],
                c["harness-fail"], c["yes"], c["no"], c["untested"]
        }' "$1"
}

# headline SUITE: "passed P, required failures F" of cacheguard's run of SUITE.
headline() {
    local f=$OUT/$1/cacheguard/score.txt
    [[ -f $f ]] || {
        echo "no results"
        return
    }
    awk '$1 == "#" && $2 == "passed" { p = $3 } $1 == "#" && $2 == "required-failures" { f = $3 }
        END { printf "%d passed, %d required failures", p, f }' "$f"
}

{
    echo "# HTTP-cache test suite, two versions: $STAMP"
    echo
    echo "The public HTTP-cache test suite, unmodified, against three reverse proxies on this machine"
    echo "(one after another, each with a fresh suite origin and an empty cache, all on 127.0.0.1),"
    echo "scored with that version's own scoring (tests/it/cache_tests/score.mjs: its determineTestResult,"
    echo "test kinds and dependencies applied), next to the results that version publishes, scored the same way."
    echo
    for suite in $SUITES; do
        echo "- cacheguard on ${SUITE_LABEL[$suite]}: **$(headline "$suite")**."
    done
    for suite in $SUITES; do
        echo
        echo "## ${SUITE_LABEL[$suite]}"
        echo
        echo "${TEST_COUNT_OF[$suite]} tests; each row's cells add up to ${TEST_COUNT_OF[$suite]}. Source: ${SOURCE_OF[$suite]}."
        echo
        echo "| target | passed | required failures | optional failures | dependency failures | setup failures | retries | harness failures | checks yes / no | untested |"
        echo "|---|---|---|---|---|---|---|---|---|---|"
        for t in $LIVE_TARGETS; do
            if [[ -f $OUT/$suite/$t/score.txt ]]; then
                printf '| %s — this machine | %s |\n' "${LABEL_OF[$suite/$t]}" "$(score_cells "$OUT/$suite/$t/score.txt")"
            else
                printf '| %s — this machine | RUN FAILED: %s | | | | | | | | |\n' "${LABEL_OF[$suite/$t]}" "${PROBLEM_OF[$suite/$t]}"
            fi
        done
        for p in ${PUBLISHED_OF[$suite]}; do
            printf '| %s — published (%s) | %s |\n' "${PUB_LABEL[$suite/$p]:-$p}" "${SUITE_LABEL[$suite]}" \
                "$(score_cells "$OUT/$suite/published/$p.score.txt")"
        done
        echo
        times=$(for t in $LIVE_TARGETS; do printf '%s %s s; ' "$t" "${RUN_S_OF[$suite/$t]:-–}"; done)
        echo "- Client run time (the whole suite, per target): ${times%; }."
        if [[ -n ${DROPPED_OF[$suite]:-} ]]; then
            echo "- Published results for tests this version no longer has were dropped before scoring: ${DROPPED_OF[$suite]%; }."
        fi
        if [[ -f $OUT/$suite/cacheguard/score.txt ]] &&
            (($(awk '$1 == "#" && $2 == "retry" { print $3 }' "$OUT/$suite/cacheguard/score.txt") > 0)); then
            echo "- cacheguard retries: on a cached route the origin receives no client request header outside the cache key,"
            echo "  so it never sees the client's Req-Num header and numbers requests itself; the suite scores a test in which"
            echo "  the origin saw two or more requests as a retry, whatever the answers were (see tests/it/cache_tests.rs)."
        fi
        cg_errors=$(grep -c "Answered with cacheguard's own error" "$OUT/$suite/cacheguard/cacheguard.log" 2>/dev/null || true)
        if ((${cg_errors:-0} > 0)); then
            echo "- cacheguard answered $cg_errors request(s) with its own error (cacheguard/cacheguard.log); the suite's stale-close-*"
            echo "  tests have the origin drop the connection on purpose, which cacheguard answers with 502 origin_unreachable."
        fi
    done
    echo
    echo "## Notes"
    echo
    echo "- passed: ✅; required failures: ⛔️ (a required test failed); optional failures: ⚠️ (an optimal test failed);"
    echo "  dependency failures: ⚪️ (a test this one depends on did not pass, so it does not count); setup failures: 🔹"
    echo "  (the test could not set itself up, e.g. an unexpected status); retries: ↻ (the origin saw the request twice or"
    echo "  more, so the result is not trusted); harness failures: ⁉️; checks: informational tests (Y/N), not pass/fail;"
    echo "  untested: no result for that test."
    echo "- nginx: the version's docker/nginx/nginx.conf directives as shipped (proxy_cache_path … keys_zone=my-cache:8m"
    echo "  max_size=1000m inactive=600m, proxy_cache my-cache, proxy_cache_revalidate on, and for the development version"
    echo "  proxy_http_version 1.1; no proxy_cache_valid) inside the distribution's http{} defaults (gzip on, …); only ports,"
    echo "  paths and the foreground start adapted."
    echo "- Varnish: builtin VCL with only a backend; varnishd -s malloc,256m, default parameters (the suite's"
    echo "  docker/serve.sh starts its Varnish with -p default_ttl=0 -p default_grace=0 -p default_keep=3600; not used here)."
    echo "- Published rows: each version's results/*.json as its authors recorded them (the product versions shown are"
    echo "  from its results/index.mjs; browsers left out), scored by that version's scoring."
    echo "- Where 0.4.5 and the development version disagree (the Age parsing tests, and the stale-close tests 0.4.5"
    echo "  scores wrongly), cacheguard follows RFC 9111 and the development version: tests/it/cache_tests.rs lists them."
    echo
    env_summary
    echo
    echo "Raw data: \`bench/results/cache-tests-$STAMP/\` (per version and target: results.json, client.stderr, score.txt,"
    echo "origin log, config and proxy logs; published/*.score.txt; per-test.tsv with every test's category per row)."
} >"$OUT/summary.md"

show_summary

problems=""
for key in "${!PROBLEM_OF[@]}"; do problems+="$key (${PROBLEM_OF[$key]}) "; done
[[ -z $problems ]] || die "runs without results: $problems"
