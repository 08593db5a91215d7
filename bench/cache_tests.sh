#!/usr/bin/env bash
# HTTP-cache conformance, in one run on this machine: the public HTTP-cache test suite (the npm
# package http-cache-tests, pinned to 0.4.5, run unmodified) against three reverse proxies,
# scored with the suite's own scoring, side by side with the results the package ships:
#
#   suite    the package's origin server (server/server.mjs, through tests/cache_tests/origin.mjs,
#            which keeps it on 127.0.0.1), one per target on its own port, started fresh with an
#            empty scratch dir as its working dir (it serves files from there); the package's
#            command-line client (`node cli.mjs`, the whole suite, ~20 s) against the target,
#            invoked as tests/cache_tests.rs invokes it
#   nginx    Debian's nginx 1.22 proxy_cache with the config the suite's authors use
#            (docker/nginx/nginx.conf of the package; see NGINX_TMPL below for what is adapted)
#   varnish  Debian's Varnish 7.1 with the builtin VCL and only a backend (what a user gets by
#            default), started like bench/lib.sh's start_varnish
#   cacheguard  release build, embedded mode (no Redis), the config of tests/cache_tests.rs
#            (CgConfig::with_upstream defaults plus its ROUTES: every GET cached by the origin's
#            freshness, every write forwarded and invalidating its path)
#   score    tests/cache_tests/score.mjs (the suite's own determineTestResult: kinds and
#            dependencies applied) on each run, and on the package's published results
#            (results/{apache,nginx,squid,trafficserver,varnish,nuster}.json) too
#
# Targets run one after another (never in parallel), each with its own fresh origin and an empty
# cache; a full run takes about 1.5 minutes.
#
# usage: bash bench/cache_tests.sh
# env:   BASE_PORT=29880 (uses BASE_PORT+1 .. +7)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        CACHE_TESTS_DIR=path (another copy of http-cache-tests 0.4.5; by default the copy
#        scripts/test.sh installs, target/cache-tests/node_modules/http-cache-tests, installed
#        here the same way when it is missing)
#        KEEP_TMP=1 (keep the scratch dir with the nginx prefix, the varnishd workdir, ...)
#
# Writes bench/results/cache-tests-<UTC timestamp>/ (per target: the client's results.json and
# stderr, score.txt, the origin's log, the proxy's config and logs; published/: the package's
# results as scored; per-test.tsv: every test's category per row; env.txt; summary.md) and
# prints the markdown summary on stdout. Exits 1 (after the summary) when a target's run did not
# produce results. Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults BASE_PORT=29880
PACKAGE_VERSION=0.4.5
CLIENT_TIMEOUT_S=150 # tests/cache_tests.rs CLIENT_DEADLINE
LIVE_TARGETS="nginx varnish cacheguard"
PUBLISHED="apache nginx squid trafficserver varnish nuster"

bench_ports NGINX_ORIGIN_PORT NGINX_PORT VARNISH_ORIGIN_PORT VARNISH_PORT CG_ORIGIN_PORT CG_PORT \
    CG_ADMIN_PORT

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish node:nodejs npm:npm curl:curl jq:jq
require_tools awk sort join mktemp id ss timeout env
require_free_ports "${BENCH_PORTS[@]}"

# The suite, pinned: CACHE_TESTS_DIR, or the copy scripts/test.sh installs under the target
# dir (installed here exactly as scripts/test.sh does when that version is not in place).
package_version() { node -p 'require(process.argv[1]).version' "$1/package.json" 2>/dev/null || true; }
if [[ -n ${CACHE_TESTS_DIR:-} ]]; then
    PKG=$(realpath -m "$CACHE_TESTS_DIR")
else
    prefix=$(realpath -m "${CARGO_TARGET_DIR:-target}/cache-tests")
    PKG=$prefix/node_modules/http-cache-tests
    if [[ $(package_version "$PKG") != "$PACKAGE_VERSION" || ! -d $prefix/node_modules/node-fetch ]]; then
        log "installing http-cache-tests@$PACKAGE_VERSION into $prefix"
        mkdir -p "$prefix"
        npm install --prefix "$prefix" --omit=dev --no-audit --no-fund --loglevel=error \
            "http-cache-tests@$PACKAGE_VERSION" >&2 || die "npm install http-cache-tests@$PACKAGE_VERSION failed"
    fi
fi
[[ $(package_version "$PKG") == "$PACKAGE_VERSION" ]] ||
    die "$PKG is not http-cache-tests $PACKAGE_VERSION (got '$(package_version "$PKG")')"
ORIGIN_JS=$ROOT/tests/cache_tests/origin.mjs
SCORE_JS=$ROOT/tests/cache_tests/score.mjs
[[ -f $ORIGIN_JS && -f $SCORE_JS ]] || die "tests/cache_tests/origin.mjs or score.mjs missing"

build_cacheguard

bench_results cache-tests- published

# --- environment -----------------------------------------------------------------------

write_env nginx varnishd <<EOF
node: $(node --version)
http_cache_tests: $PACKAGE_VERSION ($PKG)
targets: $LIVE_TARGETS (one after another, each with its own origin)
EOF

# --- the suite's test ids ----------------------------------------------------------------

# Every test of the suite, as score.mjs lists them (an empty result set scores all as untested).
echo '{}' >"$BENCH_TMP/empty.json"
node "$SCORE_JS" "$PKG" "$BENCH_TMP/empty.json" | awk '!/^#/ { print $1 }' >"$OUT/suite-ids.txt" ||
    die "score.mjs failed on an empty result set"
TEST_COUNT=$(wc -l <"$OUT/suite-ids.txt")
((TEST_COUNT > 0)) || die "score.mjs listed no tests"
jq -R . "$OUT/suite-ids.txt" | jq -s 'map({(.): true}) | add' >"$BENCH_TMP/ids.json"

# --- configs -----------------------------------------------------------------------------

# nginx: the package's docker/nginx/nginx.conf, whose directives are reproduced as shipped:
#     proxy_cache_path  /var/cache/nginx levels=1:2 keys_zone=my-cache:8m max_size=1000m inactive=600m;
#     proxy_temp_path /var/cache/nginx/tmp;
#     server { listen 8002; location / { proxy_pass http://localhost:8000;
#              proxy_cache my-cache; proxy_cache_revalidate on; } }
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

    # --- docker/nginx/nginx.conf (http-cache-tests 0.4.5) ---
    proxy_cache_path  @PREFIX@/cache levels=1:2 keys_zone=my-cache:8m max_size=1000m inactive=600m;
    proxy_temp_path @PREFIX@/cache/tmp;

    server {
        listen       127.0.0.1:@PORT@;

        location / {
            proxy_pass http://127.0.0.1:@ORIGIN_PORT@;
            proxy_cache my-cache;
            proxy_cache_revalidate on;
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

# cacheguard: what tests/cache_tests.rs runs in embedded mode, i.e. CgConfig::with_upstream's
# sections (tests/common/mod.rs) and the test's ROUTES, on the bench ports.
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
    cat "$ROOT/tests/cache_tests/routes.toml"
}

# --- running the suite -------------------------------------------------------------------

# origin_exec DIR PORT: the suite's origin on 127.0.0.1:PORT, DIR (empty) as its working dir
# (exec: the PID start_bg records is node's own).
origin_exec() {
    cd "$1" || exit 1
    exec node "$ORIGIN_JS" "$PKG" "$2"
}

# start_suite_origin NAME PORT: the suite's origin for one target, its log in $OUT/NAME/.
# Sets LAST_PID.
start_suite_origin() {
    local name=$1 port=$2 dir="$BENCH_TMP/origin-$1"
    mkdir -p "$dir"
    start_bg "$OUT/$name/origin.log" origin_exec "$dir" "$port"
    wait_http "http://127.0.0.1:$port/bench-ready" "$LAST_PID" "the suite's origin for $name"
}

# client_exec BASE_URL RESULTS: the suite's client against BASE_URL, bounded by
# CLIENT_TIMEOUT_S, its stdout (the results JSON) into RESULTS; as tests/cache_tests.rs runs it:
# from the package dir, base URL and an empty test id (every test) in npm's variables (cli.mjs
# ignores --base).
client_exec() {
    cd "$PKG" || exit 1
    exec env npm_config_base="$1" npm_config_id= npm_package_config_id= \
        timeout --signal=TERM "$CLIENT_TIMEOUT_S" node --no-warnings cli.mjs >"$2"
}

declare -A LABEL_OF=() RUN_S_OF=() PROBLEM_OF=()

# run_suite NAME URL: the client against URL into $OUT/NAME/results.json, scored into
# $OUT/NAME/score.txt; a problem is recorded in PROBLEM_OF[NAME].
run_suite() {
    local name=$1 url=$2 dir="$OUT/$1" rc=0 t0=$SECONDS
    log "$name: the suite's client against $url"
    run_bg "$dir/client.stderr" client_exec "$url" "$dir/results.json" || rc=$?
    RUN_S_OF[$name]=$((SECONDS - t0))
    if ((rc != 0)); then
        PROBLEM_OF[$name]="the client exited with $rc (124: killed after ${CLIENT_TIMEOUT_S} s)"
    elif ! jq -e 'type == "object" and length > 0' "$dir/results.json" >/dev/null 2>&1; then
        PROBLEM_OF[$name]="the client wrote no results"
    elif ! node "$SCORE_JS" "$PKG" "$dir/results.json" >"$dir/score.txt" 2>"$dir/score.stderr"; then
        PROBLEM_OF[$name]="score.mjs failed"
    fi
    if [[ -n ${PROBLEM_OF[$name]:-} ]]; then
        rm -f "$dir/score.txt"
        log "WARNING: $name: ${PROBLEM_OF[$name]}; see $dir/client.stderr"
    else
        log "$name: $(awk '$1 == "#" && ($2 == "passed" || $2 == "required-failures") { printf "%s %s; ", $2, $3 }' "$dir/score.txt")client ran ${RUN_S_OF[$name]} s"
    fi
}

# --- nginx -------------------------------------------------------------------------------

mkdir -p "$OUT"/{nginx,varnish,cacheguard}

start_suite_origin nginx "$NGINX_ORIGIN_PORT"
origin_pid=$LAST_PID
start_nginx cache-tests "$NGINX_TMPL" PORT="$NGINX_PORT" ORIGIN_PORT="$NGINX_ORIGIN_PORT"
proxy_pid=$LAST_PID
wait_http "http://127.0.0.1:$NGINX_PORT/bench-ready" "$proxy_pid" "nginx"
cp "$BENCH_TMP/nginx-cache-tests/nginx.conf" "$OUT/nginx/nginx.conf"
run_suite nginx "http://127.0.0.1:$NGINX_PORT"
stop_pid "$proxy_pid"
stop_pid "$origin_pid"
cp "$BENCH_TMP/nginx-cache-tests/error.log" "$BENCH_TMP/nginx-cache-tests/access.log" "$OUT/nginx/" 2>/dev/null || true
LABEL_OF[nginx]="$(nginx -v 2>&1 | sed 's|^nginx version: nginx/|nginx |'), proxy_cache, the package's docker/nginx config"

# --- Varnish -----------------------------------------------------------------------------

start_suite_origin varnish "$VARNISH_ORIGIN_PORT"
origin_pid=$LAST_PID
start_varnish cache-tests "$VARNISH_PORT" "$VARNISH_TMPL" ORIGIN_PORT="$VARNISH_ORIGIN_PORT"
proxy_pid=$LAST_PID
wait_http "http://127.0.0.1:$VARNISH_PORT/bench-ready" "$proxy_pid" "varnishd"
cp "$BENCH_TMP/varnish-cache-tests/default.vcl" "$OUT/varnish/default.vcl"
run_suite varnish "http://127.0.0.1:$VARNISH_PORT"
stop_pid "$proxy_pid"
stop_pid "$origin_pid"
cp "$BENCH_TMP/varnish-cache-tests/varnishd.log" "$OUT/varnish/" 2>/dev/null || true
LABEL_OF[varnish]="Varnish $(varnishd -V 2>&1 | head -n1 | sed -n 's/.*varnish-\([0-9.]*\).*/\1/p'), builtin VCL + backend"

# --- cacheguard --------------------------------------------------------------------------

start_suite_origin cacheguard "$CG_ORIGIN_PORT"
origin_pid=$LAST_PID
cg_cache_tests_config >"$OUT/cacheguard/cacheguard.toml"
launch_cacheguard cacheguard "$OUT/cacheguard/cacheguard.toml" "$CG_PORT" "$CG_ADMIN_PORT" \
    "$OUT/cacheguard/cacheguard.log"
proxy_pid=$LAST_PID
run_suite cacheguard "http://127.0.0.1:$CG_PORT"
save_metrics "${ADMIN_OF[cacheguard]}" "$OUT/cacheguard/metrics-end.txt"
stop_pid "$proxy_pid"
stop_pid "$origin_pid"
LABEL_OF[cacheguard]="$("$CG_BIN" --version 2>/dev/null || echo cacheguard), embedded, the config of tests/cache_tests.rs"

# --- the package's published results ------------------------------------------------------

# Each file is the client's output as the authors recorded it (older suite and product
# versions). Results for tests this version no longer has are dropped (score.mjs refuses them);
# tests it added score as untested.
declare -A PUB_VERSION
while IFS=$'\t' read -r file name version; do
    PUB_VERSION[${file%.json}]="$name $version"
done < <(node --input-type=module -e '
    const r = (await import(process.argv[1])).default
    for (const x of r) console.log([x.file, x.name, x.version].join("\t"))' "$PKG/results/index.mjs")

DROPPED=()
for p in $PUBLISHED; do
    src=$PKG/results/$p.json
    [[ -f $src ]] || die "$src missing"
    jq --slurpfile ids "$BENCH_TMP/ids.json" 'with_entries(select($ids[0][.key]))' "$src" >"$OUT/published/$p.json"
    dropped=$(jq -r --slurpfile ids "$BENCH_TMP/ids.json" '[keys[] | select($ids[0][.] | not)] | join(", ")' "$src")
    [[ -z $dropped ]] || DROPPED+=("$p.json: $dropped")
    node "$SCORE_JS" "$PKG" "$OUT/published/$p.json" >"$OUT/published/$p.score.txt" ||
        die "score.mjs failed on the published $p.json"
done

# --- per-test table ----------------------------------------------------------------------

# per-test.tsv: id, then each row's category (one column per live target and published file;
# "-" for a target without results).
echo '# no results' >"$BENCH_TMP/no-score.txt"
cols=(id)
files=()
for t in $LIVE_TARGETS; do
    cols+=("$t")
    if [[ -f $OUT/$t/score.txt ]]; then files+=("$OUT/$t/score.txt"); else files+=("$BENCH_TMP/no-score.txt"); fi
done
for p in $PUBLISHED; do
    cols+=("published-$p")
    files+=("$OUT/published/$p.score.txt")
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
        }' "$OUT/suite-ids.txt" "${files[@]}"
} >"$OUT/per-test.tsv"

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

{
    echo "# HTTP-cache test suite (http-cache-tests $PACKAGE_VERSION): $STAMP"
    echo
    echo "The public HTTP-cache test suite, unmodified, against three reverse proxies on this machine"
    echo "(one after another, each with a fresh suite origin and an empty cache, all on 127.0.0.1),"
    echo "scored with the suite's own scoring (tests/cache_tests/score.mjs: the suite's determineTestResult,"
    echo "test kinds and dependencies applied), next to the results the package ships, scored the same way."
    echo "$TEST_COUNT tests; each row's cells add up to $TEST_COUNT."
    echo
    echo "| target | passed | required failures | optional failures | dependency failures | setup failures | retries | harness failures | checks yes / no | untested |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    for t in $LIVE_TARGETS; do
        if [[ -f $OUT/$t/score.txt ]]; then
            printf '| %s — this machine | %s |\n' "${LABEL_OF[$t]}" "$(score_cells "$OUT/$t/score.txt")"
        else
            printf '| %s — this machine | RUN FAILED: %s | | | | | | | | |\n' "${LABEL_OF[$t]}" "${PROBLEM_OF[$t]}"
        fi
    done
    for p in $PUBLISHED; do
        printf '| %s — published (package %s) | %s |\n' "${PUB_VERSION[$p]:-$p}" "$PACKAGE_VERSION" \
            "$(score_cells "$OUT/published/$p.score.txt")"
    done
    echo
    echo "- passed: ✅; required failures: ⛔️ (a required test failed); optional failures: ⚠️ (an optimal test failed);"
    echo "  dependency failures: ⚪️ (a test this one depends on did not pass, so it does not count); setup failures: 🔹"
    echo "  (the test could not set itself up, e.g. an unexpected status); retries: ↻ (the origin saw the request twice or"
    echo "  more, so the result is not trusted); harness failures: ⁉️; checks: informational tests (Y/N), not pass/fail;"
    echo "  untested: no result for that test."
    times=$(for t in $LIVE_TARGETS; do printf '%s %s s; ' "$t" "${RUN_S_OF[$t]:-–}"; done)
    echo "- Client run time (the whole suite, per target): ${times%; }."
    echo "- nginx: the package's docker/nginx/nginx.conf directives as shipped (proxy_cache_path … keys_zone=my-cache:8m"
    echo "  max_size=1000m inactive=600m, proxy_cache my-cache, proxy_cache_revalidate on; no proxy_cache_valid) inside"
    echo "  the distribution's http{} defaults (gzip on, …); only ports, paths and the foreground start adapted."
    echo "- Varnish: builtin VCL with only a backend; varnishd -s malloc,256m, default parameters (the package's"
    echo "  docker/serve.sh starts its Varnish with -p default_ttl=0 -p default_grace=0 -p default_keep=3600; not used here)."
    if [[ -f $OUT/cacheguard/score.txt ]] && (($(awk '$1 == "#" && $2 == "retry" { print $3 }' "$OUT/cacheguard/score.txt") > 0)); then
        echo "- cacheguard retries: on a cached route the origin receives no client request header outside the cache key,"
        echo "  so it never sees the client's Req-Num header and numbers requests itself; the suite scores a test in which"
        echo "  the origin saw two or more requests as a retry, whatever the answers were (see tests/cache_tests.rs)."
    fi
    cg_errors=$(grep -c "Answered with cacheguard's own error" "$OUT/cacheguard/cacheguard.log" 2>/dev/null || true)
    if ((${cg_errors:-0} > 0)); then
        echo "- cacheguard answered $cg_errors request(s) with its own error (cacheguard/cacheguard.log); the suite's stale-close-*"
        echo "  tests have the origin drop the connection on purpose, which cacheguard answers with 502 origin_unreachable."
    fi
    echo "- Published rows: the package's results/*.json as its authors recorded them (older suite and product versions:"
    echo "  the version shown is from the package's results/index.mjs), scored by $PACKAGE_VERSION's scoring."
    if ((${#DROPPED[@]} > 0)); then
        echo "  Results for tests $PACKAGE_VERSION no longer has were dropped before scoring: $(printf '%s; ' "${DROPPED[@]}" | sed 's/; $//')."
    fi
    echo
    env_summary
    echo
    echo "Raw data: \`bench/results/cache-tests-$STAMP/\` (per target: results.json, client.stderr, score.txt, origin log,"
    echo "config and proxy logs; published/*.score.txt; per-test.tsv with every test's category per row)."
} >"$OUT/summary.md"

show_summary

((${#PROBLEM_OF[@]} == 0)) || die "runs without results: $(for t in "${!PROBLEM_OF[@]}"; do printf '%s (%s) ' "$t" "${PROBLEM_OF[$t]}"; done)"
