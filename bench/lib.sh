# shellcheck shell=bash
# Helpers for the bench/ scripts: settings, tool checks, ports, process bookkeeping (every
# process we start is recorded by PID and stopped on EXIT), the origin, peers and cacheguard
# instances, template and config rendering, wrk and loadgen runs, /metrics reading, env.txt
# and summary.md pieces and small statistics. Source it; it only sets ROOT (the repository)
# and defines things: bench_init starts the run.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_PIDS=()          # every background process started through start_bg / our own loops
BENCH_TMP=""           # scratch dir (nginx prefixes, configs); removed on exit
BENCH_PORTS=()         # every port bench_ports assigned, in order
FD_LIMIT=""            # set by raise_fd_limit
# per instance name: base URL, PID, admin base URL, log file, log length before a run
declare -A URL_OF PID_OF ADMIN_OF LOG_OF LOG_MARK
LOCK_OUTCOMES="acquired contended renewed lost takeover wait_timeout"

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() {
    printf '\nFATAL: %s\n' "$*" >&2
    exit 1
}

# --- cleanup ---------------------------------------------------------------------------

# Stop every process we started, by PID: TERM, wait up to 5 s, then KILL.
bench_cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    local pid
    for pid in "${BENCH_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    local deadline=$((SECONDS + 5))
    for pid in "${BENCH_PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "PID $pid did not stop after TERM; sending KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    if [[ -n "$BENCH_TMP" && -d "$BENCH_TMP" && -z "${KEEP_TMP:-}" ]]; then
        rm -rf "$BENCH_TMP"
    fi
    exit "$rc"
}

# bench_init: start the run: change to ROOT, note the start time (STARTED_AT, for end_env), make
# the scratch dir and stop everything we start on exit.
bench_init() {
    cd "$ROOT" || die "cannot change to $ROOT"
    STARTED_AT=$SECONDS
    BENCH_TMP=$(mktemp -d /tmp/cacheguard-bench.XXXXXX)
    trap bench_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# start_bg LOGFILE CMD...: run CMD in the background, record its PID in BENCH_PIDS and in
# the global LAST_PID.
start_bg() {
    local logfile=$1
    shift
    "$@" >"$logfile" 2>&1 &
    LAST_PID=$!
    BENCH_PIDS+=("$LAST_PID")
}

# forget_pid PID: drop a reaped PID from BENCH_PIDS, so cleanup never signals a reused PID.
forget_pid() {
    local keep=() p
    for p in "${BENCH_PIDS[@]}"; do
        [[ $p == "$1" ]] || keep+=("$p")
    done
    BENCH_PIDS=("${keep[@]}")
}

# stop_pid PID: stop one process we started (TERM, then KILL after 5 s) and reap it.
stop_pid() {
    local pid=$1 deadline=$((SECONDS + 5))
    if kill -TERM "$pid" 2>/dev/null; then
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    forget_pid "$pid"
}

# reap PID: wait for one process started with start_bg and forget it; returns its exit status.
reap() {
    local rc=0
    wait "$1" || rc=$?
    forget_pid "$1"
    return "$rc"
}

# run_bg LOGFILE CMD...: start_bg, then reap it. In the background + wait, so a signal reaches
# the EXIT trap at once (and CMD is stopped). Returns CMD's exit status.
run_bg() {
    start_bg "$@"
    reap "$LAST_PID"
}

# --- settings --------------------------------------------------------------------------

# bench_defaults NAME=DEFAULT...: the settings of a script: each NAME keeps its value from the
# environment, or is set to DEFAULT when it is unset or empty (as NAME=${NAME:-DEFAULT}).
bench_defaults() {
    local spec name
    for spec in "$@"; do
        name=${spec%%=*}
        [[ -n ${!name:-} ]] || printf -v "$name" '%s' "${spec#*=}"
    done
}

# require_positive NAME...: die unless each NAME holds a positive integer.
require_positive() {
    local v
    for v in "$@"; do
        [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer (got '${!v}')"
    done
}

# require_positive_list NAME: die unless every word of NAME is a positive integer.
require_positive_list() {
    local w
    for w in ${!1}; do
        [[ $w =~ ^[1-9][0-9]*$ ]] || die "$1 must be positive integers (got '$w')"
    done
}

# check_list NAME WHAT KNOWN...: die unless every word of NAME is one of KNOWN
# ("unknown WHAT 'word' (known: KNOWN...)").
check_list() {
    local name=$1 what=$2 w
    shift 2
    for w in ${!name}; do
        [[ " $* " == *" $w "* ]] || die "unknown $what '$w' (known: $*)"
    done
}

# max_of N...: the largest N (0 for none).
max_of() {
    local m=0 n
    for n in "$@"; do ((n > m)) && m=$n; done
    echo "$m"
}

# --- tools and ports -------------------------------------------------------------------

# ensure_apt_tools TOOL:PACKAGE...: install missing Debian packages (apt-get update first).
ensure_apt_tools() {
    local missing=() spec
    for spec in "$@"; do
        command -v "${spec%%:*}" >/dev/null 2>&1 || missing+=("${spec#*:}")
    done
    ((${#missing[@]} == 0)) && return 0
    log "missing tools; installing Debian packages: ${missing[*]}"
    [[ $EUID -eq 0 ]] || die "need root to apt-get install ${missing[*]} (or install them yourself)"
    command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} yourself"
    DEBIAN_FRONTEND=noninteractive apt-get update -q || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" ||
        die "apt-get install ${missing[*]} failed"
    for spec in "$@"; do
        command -v "${spec%%:*}" >/dev/null 2>&1 || die "${spec%%:*} still missing after apt-get install"
    done
}

require_tools() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null 2>&1 || die "required tool '$t' not found in PATH"
    done
}

# port_in_use PORT: true when something listens on 127.0.0.1:PORT (or any address).
port_in_use() {
    local port=$1
    if command -v ss >/dev/null 2>&1; then
        [[ -n "$(ss -Hltn "sport = :$port" 2>/dev/null)" ]]
    else
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
    fi
}

# bench_ports NAME...: NAME=$((BASE_PORT + i)) for the i-th NAME (i = 1, 2, ...), each added to
# BENCH_PORTS; a NAME of "-" leaves that offset unused.
bench_ports() {
    local i=0 name
    for name in "$@"; do
        i=$((i + 1))
        [[ $name == - ]] && continue
        printf -v "$name" '%s' $((BASE_PORT + i))
        BENCH_PORTS+=("${!name}")
    done
}

# require_free_ports PORT...: die when one of them is in use.
require_free_ports() {
    local p
    for p in "$@"; do
        port_in_use "$p" && die "port $p is already in use (set BASE_PORT to move every bench port)"
    done
    return 0
}

# wait_http URL PID NAME: wait up to 15 s for URL to answer; fail if PID died.
wait_http() {
    local url=$1 pid=$2 name=$3 deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || die "$name (PID $pid) exited during start-up; see its log"
        curl -s -o /dev/null --max-time 1 "$url" && return 0
        sleep 0.1
    done
    die "$name did not answer $url within 15 s"
}

# --- builds and limits -----------------------------------------------------------------

# raise_fd_limit: ask for FD_WANTED (65536) open files. A container without CAP_SYS_RESOURCE
# cannot raise the hard limit, so fall back to the hard limit. Sets FD_LIMIT (a number or
# "unlimited"); each script checks it against what its load needs.
FD_WANTED=65536
# shellcheck disable=SC2034 # the variables it sets are for the calling script
raise_fd_limit() {
    if ! ulimit -n "$FD_WANTED" 2>/dev/null; then
        ulimit -n "$(ulimit -Hn)"
        log "ulimit -n $FD_WANTED refused (hard limit $(ulimit -Hn)); using $(ulimit -n)"
    fi
    FD_LIMIT=$(ulimit -n)
}

# require_fd_limit MIN WHAT: raise_fd_limit, then die unless the limit is unlimited or at least
# MIN ("open-file limit L is too low for WHAT").
require_fd_limit() {
    raise_fd_limit
    [[ $FD_LIMIT == unlimited ]] || ((FD_LIMIT >= $1)) || die "open-file limit $FD_LIMIT is too low for $2"
}

# require_fds_for_concurrency C...: require_fd_limit for C keep-alive connections in the loadgen
# and as many in the proxies (plus their upstream sockets), at the largest C.
require_fds_for_concurrency() {
    local c
    c=$(max_of "$@")
    require_fd_limit $((2 * c + 512)) "C=$c (need at least $((2 * c + 512)))"
}

# build_bench_tools: release build of bench/tools into TOOLS_TARGET (default
# bench/results/tools-target). Sets ORIGIN_BIN and LOADGEN_BIN.
# shellcheck disable=SC2034 # the variables it sets are for the calling script
build_bench_tools() {
    TOOLS_TARGET=${TOOLS_TARGET:-$ROOT/bench/results/tools-target}
    log "cargo build --release --manifest-path bench/tools/Cargo.toml (target dir $TOOLS_TARGET)"
    CARGO_TARGET_DIR=$TOOLS_TARGET cargo build --release --manifest-path bench/tools/Cargo.toml >&2 ||
        die "building bench/tools failed"
    ORIGIN_BIN=$TOOLS_TARGET/release/bench-origin
    LOADGEN_BIN=$TOOLS_TARGET/release/loadgen
}

# build_cacheguard: sets CG_BIN to CACHEGUARD_BIN when that is set (no build), otherwise to a
# fresh `cargo build --release` of the cacheguard binary.
build_cacheguard() {
    if [[ -n "${CACHEGUARD_BIN:-}" ]]; then
        CG_BIN=$CACHEGUARD_BIN
        log "using CACHEGUARD_BIN=$CG_BIN (no build)"
    else
        log "cargo build --release"
        cargo build --release --bin cacheguard >&2 || die "cargo build --release failed"
        CG_BIN=$ROOT/target/release/cacheguard
    fi
    [[ -x $CG_BIN ]] || die "cacheguard binary not found at $CG_BIN"
}

# --- templates and configs ---------------------------------------------------------------

# render_template TEMPLATE OUT KEY=VALUE...: replace @KEY@ with VALUE (no sed escaping games:
# done in awk with plain string search, so VALUE may hold / & and quotes). When a KEY comes
# twice, the first VALUE wins: a wrapper puts its defaults after its caller's pairs.
render_template() {
    local tmpl=$1 out=$2
    shift 2
    awk -v pairs="$(printf '%s\n' "$@")" '
        BEGIN {
            n = split(pairs, lines, "\n")
            for (i = 1; i <= n; i++) {
                if (lines[i] == "") continue
                eq = index(lines[i], "=")
                keys[++k] = "@" substr(lines[i], 1, eq - 1) "@"
                vals[k] = substr(lines[i], eq + 1)
            }
        }
        {
            line = $0
            for (j = 1; j <= k; j++) {
                out = ""
                while ((p = index(line, keys[j])) > 0) {
                    out = out substr(line, 1, p - 1) vals[j]
                    line = substr(line, p + length(keys[j]))
                }
                line = out line
            }
            print line
        }' "$tmpl" >"$out"
    local left
    left=$(grep -v '^[[:space:]]*#' "$out" | grep -o '@[A-Z_]*@' | sort -u | tr '\n' ' ' || true)
    [[ -z $left ]] || die "unfilled placeholder in $out: $left"
}

# static_body N: a JSON object of exactly N bytes, safe inside nginx single quotes
# (no quote, backslash or $).
static_body() {
    local n=$1 head='{"id":1,"name":"bench item","payload":"' tail='"}'
    local pad=$((n - ${#head} - ${#tail}))
    ((pad > 0)) || die "static_body: $n bytes is too small"
    printf '%s%s%s' "$head" "$(head -c "$pad" /dev/zero | tr '\0' 'x')" "$tail"
}

# toml_kv KEY VALUE: one `KEY = VALUE` line; VALUE is quoted unless it is a number, a boolean,
# an array or an inline table.
toml_kv() {
    if [[ $2 =~ ^-?[0-9]+(\.[0-9]+)?$|^(true|false)$|^[[{] ]]; then
        printf '%s = %s\n' "$1" "$2"
    else
        printf '%s = "%s"\n' "$1" "$2"
    fi
}

# cg_config PORT ADMIN_PORT ORIGIN_PORT [SECTION.KEY=VALUE...]: a cacheguard config on stdout:
# [server] listen 127.0.0.1:PORT, [upstream] url the origin on 127.0.0.1:ORIGIN_PORT, [admin]
# listen 127.0.0.1:ADMIN_PORT and one route "item" on /items/{id}, plus a `KEY = VALUE` line
# (toml_kv) per argument in its SECTION: server, upstream, redis, journal, admin, cache,
# hot_keys, lock, access_log, bloom ([[bloom]]) or route (the route's own settings). Sections
# come in that order; those without a setting are left out.
cg_config() {
    local port=$1 admin=$2 upstream_port=$3 section spec lines
    shift 3
    for section in server upstream redis journal admin cache hot_keys lock access_log bloom route; do
        case $section in
        server) lines=$(toml_kv listen "127.0.0.1:$port") ;;
        upstream) lines=$(toml_kv url "http://127.0.0.1:$upstream_port") ;;
        admin) lines=$(toml_kv listen "127.0.0.1:$admin") ;;
        route) lines=$(toml_kv name item && toml_kv match "/items/{id}") ;;
        *) lines="" ;;
        esac
        for spec in "$@"; do
            [[ ${spec%%.*} == "$section" ]] || continue
            spec=${spec#*.}
            lines+=${lines:+$'\n'}$(toml_kv "${spec%%=*}" "${spec#*=}")
        done
        [[ -n $lines ]] || continue
        case $section in
        bloom) echo "[[bloom]]" ;;
        route) echo "[[routes]]" ;;
        *) echo "[$section]" ;;
        esac
        printf '%s\n' "$lines"
    done
}

# lock_config PORT ADMIN_PORT ORIGIN_PORT [SECTION.KEY=VALUE...]: cg_config with the settings of
# the lock benchmarks (bench/stampede.sh, bench/bus_gap.sh, bench/scale_out.sh): upstream
# max_concurrency 1024 and queue_timeout 5s, ttl 600s, lock lease and wait_timeout 5s.
lock_config() {
    local port=$1 admin=$2 upstream_port=$3
    shift 3
    cg_config "$port" "$admin" "$upstream_port" upstream.max_concurrency=1024 upstream.queue_timeout=5s \
        cache.ttl=600s lock.lease=5s lock.wait_timeout=5s "$@"
}

# --- origin, peers, Redis and cacheguard -------------------------------------------------

# start_origin LOGFILE NAME PORT ARG...: bench-origin (ORIGIN_BIN) --port PORT ARG..., waited
# for until its /stats answers (NAME in the error). Sets LAST_PID.
start_origin() {
    local logfile=$1 name=$2 port=$3
    shift 3
    start_bg "$logfile" "$ORIGIN_BIN" --port "$port" "$@"
    wait_http "http://127.0.0.1:$port/stats" "$LAST_PID" "$name"
}

# check_origin_body URL BYTES: die unless GET URL answers a body of BYTES bytes.
check_origin_body() {
    local size
    size=$(curl -s -o /dev/null -w '%{size_download}' "$1")
    [[ $size == "$2" ]] || die "origin body is $size bytes, expected $2"
}

# check_answer NAME URL HEADERS BYTES: save the headers of one GET of URL to HEADERS, and die
# unless another GET answers a body of BYTES bytes.
check_answer() {
    local size
    curl -s -o /dev/null -D "$3" "$2"
    size=$(curl -s -o /dev/null -w '%{size_download}' "$2")
    [[ $size == "$4" ]] || die "$1 answered $size body bytes, expected $4"
}

# origin_reset: zero the counters of the bench-origin at ORIGIN.
origin_reset() { curl -s -X POST --max-time 5 "$ORIGIN/stats/reset" >/dev/null || die "cannot reset origin counters"; }

# save_origin_stats FILE: the /stats of the bench-origin at ORIGIN, into FILE.
save_origin_stats() { curl -s --max-time 5 "$ORIGIN/stats" >"$1" || die "cannot read origin stats"; }

# origin_path_count STATS_FILE PATH: the requests for PATH in a saved /stats (0 when none).
origin_path_count() { jq --arg p "$2" '.paths[$p] // 0' "$1"; }

# stub_requests PORT: the request counter of the nginx stub_status at
# 127.0.0.1:PORT/nginx_status (bench/origin.conf.tmpl); each read counts itself.
stub_requests() {
    curl -s --max-time 5 "http://127.0.0.1:$1/nginx_status" | awk 'NR == 3 { print $3 }'
}

# start_nginx NAME TEMPLATE KEY=VALUE...: render TEMPLATE into $BENCH_TMP/nginx-NAME and run
# nginx in the foreground (daemon off) from that prefix. Sets LAST_PID.
start_nginx() {
    local name=$1 tmpl=$2
    shift 2
    local prefix="$BENCH_TMP/nginx-$name"
    mkdir -p "$prefix"/tmp/{body,proxy,fastcgi,uwsgi,scgi} "$prefix/cache" "$prefix/logs"
    render_template "$tmpl" "$prefix/nginx.conf" PREFIX="$prefix" USER="$(id -un)" "$@"
    nginx -t -q -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log" ||
        die "nginx -t failed for $name ($prefix/nginx.conf)"
    start_bg "$prefix/stdout.log" nginx -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log"
}

# start_nginx_cache NAME PORT LABEL CONF_COPY KEY=VALUE...: nginx proxy_cache from
# bench/nginx.conf.tmpl (PORT, ORIGIN_PORT of the script, KEY=VALUE...; KEYS_ZONE, the size of
# the keys_zone, is 32m, MAX_SIZE, the cache's max_size, 1g and INACTIVE, how long an entry not
# read is kept, 10m unless given), waited for at
# /nginx-ready (LABEL in the error); the rendered config is copied to CONF_COPY. Sets LAST_PID,
# PID_OF[NAME] and URL_OF[NAME]. The cache files are in $BENCH_TMP/nginx-NAME/cache.
start_nginx_cache() {
    local name=$1 port=$2 label=$3 copy=$4
    shift 4
    start_nginx "$name" bench/nginx.conf.tmpl PORT="$port" ORIGIN_PORT="$ORIGIN_PORT" "$@" \
        KEYS_ZONE=32m MAX_SIZE=1g INACTIVE=10m
    PID_OF[$name]=$LAST_PID
    URL_OF[$name]=http://127.0.0.1:$port
    wait_http "${URL_OF[$name]}/nginx-ready" "$LAST_PID" "$label"
    cp "$BENCH_TMP/nginx-$name/nginx.conf" "$copy"
}

# start_varnish NAME PORT TEMPLATE KEY=VALUE...: render the VCL TEMPLATE into
# $BENCH_TMP/varnish-NAME and run varnishd in the foreground (-F) with its own working dir
# (-n $BENCH_TMP/varnish-NAME/n), no jail, no management port, malloc storage of
# VARNISH_MALLOC bytes (default 256m; e.g. `VARNISH_MALLOC=4g start_varnish ...`). Sets LAST_PID
# (the manager; TERM to it stops the cache child too).
start_varnish() {
    local name=$1 port=$2 tmpl=$3
    shift 3
    local dir="$BENCH_TMP/varnish-$name"
    mkdir -p "$dir"
    render_template "$tmpl" "$dir/default.vcl" "$@"
    start_bg "$dir/varnishd.log" varnishd -F -j none -n "$dir/n" -a "127.0.0.1:$port" -T none \
        -f "$dir/default.vcl" -s "malloc,${VARNISH_MALLOC:-256m}"
}

# start_varnish_cache NAME PORT LABEL CONF_COPY KEY=VALUE...: varnishd from
# bench/varnish.vcl.tmpl (ORIGIN_PORT of the script, KEY=VALUE...), waited for at
# /varnish-ready (LABEL in the error); the rendered VCL is copied to CONF_COPY. Sets LAST_PID,
# PID_OF[NAME] and URL_OF[NAME].
start_varnish_cache() {
    local name=$1 port=$2 label=$3 copy=$4
    shift 4
    start_varnish "$name" "$port" bench/varnish.vcl.tmpl ORIGIN_PORT="$ORIGIN_PORT" "$@"
    PID_OF[$name]=$LAST_PID
    URL_OF[$name]=http://127.0.0.1:$port
    wait_http "${URL_OF[$name]}/varnish-ready" "$LAST_PID" "$label"
    cp "$BENCH_TMP/varnish-$name/default.vcl" "$copy"
}

# start_redis NAME PORT: a throwaway redis-server on 127.0.0.1:PORT, no persistence. Waits
# until it answers PING. Sets LAST_PID.
start_redis() {
    local name=$1 port=$2 dir="$BENCH_TMP/redis-$1" deadline
    mkdir -p "$dir"
    start_bg "$dir/redis.log" redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" \
        --save "" --appendonly no --daemonize no
    local pid=$LAST_PID
    deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || die "redis-server ($name, PID $pid) exited; see $dir/redis.log"
        [[ $(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null) == PONG ]] && return 0
        sleep 0.1
    done
    die "redis-server ($name) did not answer PING on port $port within 15 s"
}

# launch_cacheguard NAME CONF PORT ADMIN_PORT LOGFILE [LABEL]: check CONF (--check-config), run
# the cacheguard binary (CG_BIN) on it with its output in LOGFILE, and wait until /healthz
# answers on ADMIN_PORT (LABEL, default "cacheguard (NAME)", in the error). Sets LAST_PID and
# PID_OF, URL_OF, ADMIN_OF and LOG_OF[NAME].
launch_cacheguard() {
    local name=$1 conf=$2 port=$3 admin=$4 logfile=$5
    "$CG_BIN" --check-config "$conf" >&2 || die "cacheguard --check-config $conf failed"
    start_bg "$logfile" "$CG_BIN" --config "$conf"
    LOG_OF[$name]=$logfile
    PID_OF[$name]=$LAST_PID
    URL_OF[$name]=http://127.0.0.1:$port
    ADMIN_OF[$name]=http://127.0.0.1:$admin
    wait_http "${ADMIN_OF[$name]}/healthz" "$LAST_PID" "${6:-cacheguard ($name)}"
}

# wait_bus WHO ADMIN_URL FILE [SECONDS]: poll ADMIN_URL/metrics into FILE until
# cacheguard_event_bus_subscribed is 1; after SECONDS (10) log a warning (about WHO) and go on.
wait_bus() {
    local who=$1 admin=$2 file=$3 limit=${4:-10}
    local deadline=$((SECONDS + limit))
    while :; do
        save_metrics "$admin" "$file"
        [[ $(metric "$file" cacheguard_event_bus_subscribed) == 1 ]] && return 0
        if ((SECONDS >= deadline)); then
            log "WARNING: $who: cacheguard_event_bus_subscribed is not 1 after $limit s (see $file)"
            return 0
        fi
        sleep 0.2
    done
}

# log_lines FILE: how many lines FILE has.
log_lines() { wc -l <"$1"; }

# instances_before PREFIX NAME...: before a run, for each cacheguard instance NAME: its /metrics
# into PREFIX-metrics-NAME-before.txt and the length of its log into LOG_MARK[NAME].
instances_before() {
    local prefix=$1 name
    shift
    for name in "$@"; do
        save_metrics "${ADMIN_OF[$name]}" "$prefix-metrics-$name-before.txt"
        # shellcheck disable=SC2034 # read by the scripts, with log_since
        LOG_MARK[$name]=$(log_lines "${LOG_OF[$name]}")
    done
}

# log_since LOG SKIP OUT: the lines of LOG after its first SKIP, into OUT; prints how many of
# them are WARN or ERROR lines.
log_since() {
    tail -n +"$(($2 + 1))" "$1" >"$3"
    grep -c -E 'WARN|ERROR' "$3" || true
}

# --- /metrics ----------------------------------------------------------------------------

# save_metrics ADMIN_URL FILE: one /metrics dump into FILE (left empty when it does not answer
# within 2 s).
save_metrics() { curl -s --max-time 2 "$1/metrics" >"$2" || true; }

# metric FILE NAME[{labels}]: the value of one sample in a /metrics dump (0 when absent).
metric() { awk -v m="$2" '$1 == m { v = $2 } END { printf "%.0f", v + 0 }' "$1"; }

# metric_sum FILE NAME: the sum of every sample of NAME, whatever its labels (0 when absent).
metric_sum() {
    awk -v m="$2" '$1 == m || index($1, m "{") == 1 { v += $2 } END { printf "%.0f", v + 0 }' "$1"
}

# mdelta BEFORE AFTER NAME[{labels}]: the change of one sample between two /metrics dumps.
mdelta() { echo $(($(metric "$2" "$3") - $(metric "$1" "$3"))); }

# lock_events BEFORE AFTER: the non-zero changes of cacheguard_lock_events_total between two
# /metrics dumps, one "outcome=delta," per outcome (LOCK_OUTCOMES).
lock_events() {
    local o d
    for o in $LOCK_OUTCOMES; do
        d=$(mdelta "$1" "$2" "cacheguard_lock_events_total{outcome=\"$o\"}")
        ((d == 0)) || printf '%s=%s,' "$o" "$d"
    done
}

# --- wrk and loadgen runs ------------------------------------------------------------------

# wrk_start FILE ARG...: wrk ARG... in the background (start_bg) into FILE.part, after a
# "# wrk ARG..." line in FILE. Sets LAST_PID.
wrk_start() {
    local file=$1
    shift
    echo "# wrk $*" >"$file"
    start_bg "$file.part" wrk "$@"
}

# wrk_finish FILE PID [WHAT]: reap one wrk_start, append its output to FILE, die when it failed
# ("wrk failed (rc) for WHAT").
wrk_finish() {
    local file=$1 rc=0
    reap "$2" || rc=$?
    cat "$file.part" >>"$file" && rm -f "$file.part"
    ((rc == 0)) || die "wrk failed ($rc)${3:+ for $3}; see $file"
}

# wrk_once FILE WHAT ARG...: wrk_start, then wrk_finish.
wrk_once() {
    local file=$1 what=$2
    shift 2
    wrk_start "$file" "$@"
    wrk_finish "$file" "$LAST_PID" "$what"
}

# wrk_parse FILE: prints "rps p50_ms p99_ms max_ms requests errors non2xx" for a wrk
# --latency output file.
wrk_parse() {
    awk '
        function ms(v) {
            if (v ~ /us$/) { sub(/us$/, "", v); return v / 1000 }
            if (v ~ /ms$/) { sub(/ms$/, "", v); return v + 0 }
            if (v ~ /m$/)  { sub(/m$/, "", v);  return v * 60000 }
            if (v ~ /s$/)  { sub(/s$/, "", v);  return v * 1000 }
            return v + 0
        }
        /^ +Latency +[0-9]/ { max = ms($4) }
        /^ +50%/ { p50 = ms($2) }
        /^ +99%/ { p99 = ms($2) }
        /requests in/ { reqs = $1 }
        /^Requests\/sec:/ { rps = $2 }
        /Socket errors:/ {
            gsub(/,/, "")
            errs = $4 + $6 + $8 + $10
        }
        /Non-2xx or 3xx responses:/ { non2xx = $5 }
        END {
            if (rps == "" || p99 == "") exit 1
            printf "%.2f %.3f %.3f %.3f %d %d %d\n", rps, p50, p99, max, reqs, errs + 0, non2xx + 0
        }' "$1"
}

# wrk_distinct FILE URL TOTAL MAX_DURATION DONE_DIR: TOTAL requests, each for a new key
# (bench/distinct.lua: /items/<n>, no id twice), through URL with `wrk -t2 -c64 --timeout 10s
# --latency`, into FILE after a "# wrk ..." line; MAX_DURATION (wrk's -d) bounds it. wrk's main
# thread sleeps for the whole -d after its threads stopped, so this waits until both threads
# have their quota (DONE_DIR/thread-N.done), then sends wrk SIGINT (its done() still prints the
# "distinct:" line: see distinct_field). Dies when wrk fails.
wrk_distinct() {
    local file=$1 url=$2 total=$3 max=$4 done_dir=$5 rc=0 pid
    echo "# wrk -t2 -c64 -d$max --timeout 10s --latency -s bench/distinct.lua $url -- $total 2 <done_dir>" >"$file"
    mkdir -p "$done_dir"
    start_bg "$file.part" wrk -t2 -c64 -d"$max" --timeout 10s --latency \
        -s bench/distinct.lua "$url" -- "$total" 2 "$done_dir"
    pid=$LAST_PID
    while kill -0 "$pid" 2>/dev/null; do
        if [[ -e $done_dir/thread-0.done && -e $done_dir/thread-1.done ]]; then
            kill -INT "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
    reap "$pid" || rc=$?
    cat "$file.part" >>"$file" && rm -f "$file.part"
    ((rc == 0)) || die "wrk (distinct keys) exited with $rc; see $file"
}

# distinct_field FILE NAME: NAME=<n> of the "distinct:" line of a wrk_distinct output (sent,
# received, non200, ...); empty when there is none.
distinct_field() { sed -n "s/^distinct:.* $2=\([0-9.]*\).*/\1/p" "$1"; }

# loadgen_rate JSON WHAT BOUND_S ARG...: one `loadgen rate ARG...` into JSON, bounded by its own
# drain deadline and by `timeout BOUND_S` around it; dies when it fails or measured no response
# (WHAT in the message).
loadgen_rate() {
    local json=$1 what=$2 bound=$3
    shift 3
    run_bg "$json" timeout --signal=TERM "$bound" "$LOADGEN_BIN" rate "$@" ||
        die "loadgen rate failed ($?) for $what; see $json"
    jq -e '.mode == "rate" and .latency_ms.n > 0' "$json" >/dev/null ||
        die "loadgen rate for $what measured no response; see $json"
}

# rate_problems JSON RATE [HIT]: what was not clean in a `loadgen rate` run, one line each:
# errors, non-2xx, unsent or unfinished requests, an achieved rate under 98% of RATE and, with
# HIT, answers whose X-Cache was not HIT. Prints nothing for a clean run.
rate_problems() {
    local json=$1 wanted=$2 hit=${3:-} errors non2xx unsent unfinished achieved ok hits
    read -r errors non2xx unsent unfinished achieved ok hits < <(jq -r --arg h "$hit" \
        '[.errors, .non_2xx, .unsent, .unfinished, .achieved_rate_rps, .ok, (.x_cache[$h] // 0)] | @tsv' "$json")
    ((errors == 0)) || echo "$errors errors"
    ((non2xx == 0)) || echo "$non2xx non-2xx"
    ((unsent == 0)) || echo "$unsent unsent"
    ((unfinished == 0)) || echo "$unfinished unfinished at the drain deadline"
    awk -v a="$achieved" -v r="$wanted" 'BEGIN { exit !(a >= 0.98 * r) }' ||
        echo "achieved $achieved req/s < 98% of $wanted"
    if [[ -n $hit ]] && ((hits != ok)); then
        echo "only $hits of $ok answers were $hit"
    fi
}

# loadgen_stampede JSON WHAT ARG...: one `loadgen stampede ARG...` into JSON, bounded twice (its
# own timeouts, and `timeout` around it); dies when it fails.
loadgen_stampede() {
    local json=$1 what=$2
    shift 2
    run_bg "$json" timeout --signal=TERM 120 "$LOADGEN_BIN" stampede "$@" ||
        die "loadgen failed ($?) for $what; see $json"
}

# json_counts JSON [FIELD]: a histogram of a loadgen JSON (FIELD, default x_cache) as "K=V,K=V".
json_counts() { jq -r ".${2:-x_cache} | to_entries | map(\"\\(.key)=\\(.value)\") | join(\",\")" "$1"; }

# --- run environment -------------------------------------------------------------------

# bench_results NAME SUBDIR...: this run's results dir, bench/results/NAME<UTC timestamp> (or
# RESULTS_DIR when that is set: a caller that runs a script as a sub-step knows where its
# results are), with its SUBDIRs. Sets STAMP and OUT.
bench_results() {
    local d
    STAMP=$(date -u +%Y%m%dT%H%M%SZ)
    OUT=${RESULTS_DIR:-$ROOT/bench/results/$1$STAMP}
    shift
    mkdir -p "$OUT"
    for d in "$@"; do mkdir -p "$OUT/$d"; done
    log "results: $OUT"
}

# env_machine: the machine lines every env.txt starts with (STAMP must be set).
env_machine() {
    echo "date_utc: $STAMP"
    echo "nproc: $(nproc)"
    echo "mem_total: $(awk '/^MemTotal:/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
    echo "uname: $(uname -srm)"
    echo "cpu: $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)"
    echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
}

# env_build: the build lines of env.txt: rustc, the cacheguard binary (CG_BIN) and the git
# commit (flagged when src/ has uncommitted changes).
env_build() {
    echo "rustc: $(rustc -V 2>/dev/null || echo unknown)"
    echo "cacheguard: $("$CG_BIN" --version 2>/dev/null || echo unknown) ($CG_BIN)"
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$ROOT" diff --quiet HEAD -- src 2>/dev/null || echo ' (src/ has uncommitted changes)')"
}

# write_env TOOL...: $OUT/env.txt: env_machine, the version of each TOOL (nginx, varnishd, redis,
# wrk), env_build, fd_limit (once raise_fd_limit ran), load_start, then the lines on stdin;
# echoed to stderr. Sets LOAD_START.
write_env() {
    local tool
    LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
    {
        env_machine
        for tool in "$@"; do
            case $tool in
            nginx) echo "nginx: $(nginx -v 2>&1)" ;;
            varnishd) echo "varnishd: $(varnishd -V 2>&1 | head -n1)" ;;
            redis) echo "redis: $(redis-server --version)" ;;
            wrk) echo "wrk: $(wrk -v 2>&1 | head -n1 | awk '{ print $1, $2, $3 }')" ;;
            *) die "write_env: unknown tool '$tool'" ;;
            esac
        done
        env_build
        [[ -z $FD_LIMIT ]] || echo "fd_limit: $FD_LIMIT (wanted $FD_WANTED)"
        echo "load_start: $LOAD_START"
        cat
    } >"$OUT/env.txt"
    cat "$OUT/env.txt" >&2
}

# end_env: the end of the run: load_end into $OUT/env.txt. Sets LOAD_END and WALL (seconds since
# bench_init).
end_env() {
    LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
    echo "load_end: $LOAD_END" >>"$OUT/env.txt"
    WALL=$((SECONDS - STARTED_AT))
}

# --- summary ---------------------------------------------------------------------------

# env_table: $OUT/env.txt as a markdown table, one row per "key: value" line.
env_table() {
    echo "| item | value |"
    echo "|---|---|"
    sed -n 's/^\([a-z_]*\): \(.*\)$/| \1 | \2 |/p' "$OUT/env.txt"
}

# env_summary: the load averages and wall time, a blank line and env_table (summary.md's head).
env_summary() {
    echo "Load average (1/5/15 min) at start: $LOAD_START; at end: $LOAD_END. Wall time: ${WALL} s."
    echo
    env_table
}

# show_summary: print $OUT/summary.md and log the wall time.
show_summary() {
    cat "$OUT/summary.md"
    log "done in ${WALL} s; results in $OUT"
}

# rotate N WORD...: WORD list rotated left by N (so each rep starts with another one).
rotate() {
    local n=$1
    shift
    local words=("$@")
    local k=${#words[@]} i
    for ((i = 0; i < k; i++)); do printf '%s ' "${words[(i + n) % k]}"; done
}

# each_rep LIST CMD...: for rep = 1 .. REPS, for each word of LIST rotated left by rep - 1:
# CMD... WORD REP.
each_rep() {
    local list=$1 rep w
    shift
    for ((rep = 1; rep <= REPS; rep++)); do
        # shellcheck disable=SC2086 # LIST splits into words on purpose
        for w in $(rotate $((rep - 1)) $list); do
            "$@" "$w" "$rep"
        done
    done
}

# note_problems LIST WHO SUFFIX PROBLEM...: when there is a PROBLEM, add "WHO: p1; p2" to the
# array named LIST and log it as a warning (followed by SUFFIX).
note_problems() {
    local -n note_list=$1
    local who=$2 suffix=$3 msg
    shift 3
    (($# > 0)) || return 0
    msg=$(printf '%s; ' "$@")
    note_list+=("$who: ${msg%; }")
    log "WARNING: $who: ${msg%; }$suffix"
}

# problem_items CLEAN HEAD ITEM...: summary lines about the runs that were not clean: HEAD
# ("" for "- **Runs that were not clean:**") and one line per ITEM, or CLEAN when there is none.
problem_items() {
    local clean=$1 head=${2:-"- **Runs that were not clean:**"}
    shift 2
    if (($# > 0)); then
        echo "$head"
        printf '  - %s\n' "$@"
    else
        echo "$clean"
    fi
}

verdict() { if [[ $1 == 1 ]]; then echo "**met**"; else echo "**MISSED**"; fi; }

# ratio A B: A / B with 2 decimals; "–" unless both are positive.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0 && a + 0 > 0) printf "%.2f", a / b; else printf "–" }'; }

# mib KB: kB as "N.N MiB".
mib() { awk -v k="$1" 'BEGIN { printf "%.1f MiB", k / 1024 }'; }

# sum_lines: the sum of the numbers on stdin, one per line (0 for none).
sum_lines() { awk '{ s += $1 } END { print s + 0 }'; }

# merge_counts: "K=V,K=V" cells on stdin, one per line, summed per K: "K1 n, K2 m" (sorted by K).
merge_counts() {
    tr ',' '\n' | awk -F= 'NF == 2 { s[$1] += $2 } END { for (k in s) printf "%s %d\n", k, s[k] }' |
        sort | awk '{ printf "%s%s %d", (NR > 1 ? ", " : ""), $1, $2 }'
}

# --- statistics --------------------------------------------------------------------------

# tsv_col FILE COLUMN [NAME=VALUE...]: the values of COLUMN (named in the header line) of a TSV
# file, one per line, from the rows whose NAME column holds VALUE for every NAME=VALUE; nothing
# when FILE does not exist.
tsv_col() {
    local file=$1 col=$2
    shift 2
    [[ -f $file ]] || return 0
    awk -F'\t' -v col="$col" -v conds="$(printf '%s\n' "$@")" '
        NR == 1 {
            for (i = 1; i <= NF; i++) idx[$i] = i
            if (!(col in idx)) { print "tsv_col: no column " col > "/dev/stderr"; exit 1 }
            n = split(conds, cl, "\n")
            for (j = 1; j <= n; j++) {
                if (cl[j] == "") continue
                eq = index(cl[j], "=")
                k++
                cn[k] = idx[substr(cl[j], 1, eq - 1)]
                cv[k] = substr(cl[j], eq + 1)
            }
            next
        }
        {
            for (j = 1; j <= k; j++) if ($cn[j] != cv[j]) next
            print $idx[col]
        }' "$file"
}

# stats V...: prints "median min max" (median of an even count = mean of the middle two).
stats() {
    printf '%s\n' "$@" | sort -g | awk '
        { v[NR] = $1 }
        END {
            if (NR == 0) { print "nan nan nan"; exit }
            med = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
            printf "%s %s %s\n", med, v[1], v[NR]
        }'
}

# fmt_int N: 118327.4 -> 118,327
fmt_int() {
    LC_ALL=C awk -v n="$1" 'BEGIN {
        s = sprintf("%.0f", n); out = ""
        while (length(s) > 3) { out = "," substr(s, length(s) - 2) out; s = substr(s, 1, length(s) - 3) }
        print s out
    }'
}

# cell KIND V...: "median (min–max)" formatted as req/s (KIND=int) or ms (KIND=ms, as
# cell_dec 3).
cell() {
    local kind=$1
    shift
    if [[ $kind != int ]]; then
        cell_dec 3 "$@"
        return
    fi
    local med min max
    read -r med min max < <(stats "$@")
    printf '%s (%s–%s)' "$(fmt_int "$med")" "$(fmt_int "$min")" "$(fmt_int "$max")"
}

median() { stats "$@" | awk '{ print $1 }'; }

# cell_dec DECIMALS V...: "median (min–max)" with DECIMALS decimals; a lone value when all
# values are equal.
cell_dec() {
    local dec=$1
    shift
    local med min max
    read -r med min max < <(stats "$@")
    if [[ $med == nan ]]; then
        printf '–'
    elif LC_ALL=C awk -v a="$min" -v b="$max" 'BEGIN { exit !(a == b) }'; then
        LC_ALL=C printf "%.${dec}f" "$med"
    else
        LC_ALL=C printf "%.${dec}f (%.${dec}f–%.${dec}f)" "$med" "$min" "$max"
    fi
}

# --- process memory and CPU ------------------------------------------------------------

# proc_kb PID FIELD: a /proc/PID/status field (VmRSS, VmHWM) in kB.
proc_kb() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status" 2>/dev/null; }

# proc_tree PID: PID and its child processes (an nginx master and its workers, cache manager
# and loader; the varnishd manager and its cache child), one per line.
proc_tree() {
    echo "$1"
    pgrep -P "$1" || true
}

# cpu_ticks PID...: user + system CPU time of the processes, in clock ticks (getconf CLK_TCK),
# summed: utime + stime of /proc/PID/stat, every thread of each process included (not its
# children: name them too, e.g. with proc_tree).
cpu_ticks() {
    local pid
    # a process that has exited meanwhile (nginx's cache loader ends by itself) counts 0
    for pid in "$@"; do cat "/proc/$pid/stat" 2>/dev/null || true; done |
        awk '{ sub(/^.*\) /, ""); s += $12 + $13 } END { print s + 0 }'
}

# ctx_switches PID...: the context switches of the processes so far, summed:
# voluntary_ctxt_switches + nonvoluntary_ctxt_switches of /proc/PID/task/*/status, every thread
# of each process (a thread that has exited meanwhile no longer counts; its children are not
# included: name them too, e.g. with proc_tree).
ctx_switches() {
    local pid
    for pid in "$@"; do cat "/proc/$pid"/task/*/status 2>/dev/null || true; done |
        awk '$1 == "voluntary_ctxt_switches:" || $1 == "nonvoluntary_ctxt_switches:" { s += $2 }
            END { print s + 0 }'
}

# pss_kb PID...: the proportional set size of the processes, in kB, summed (Pss of
# /proc/PID/smaps_rollup: pages shared between them, such as nginx's cache zone, count once).
pss_kb() {
    local pid
    for pid in "$@"; do cat "/proc/$pid/smaps_rollup"; done |
        awk '$1 == "Pss:" { s += $2 } END { print s + 0 }'
}

# vmhwm_lines NAME...: "NAME: VmHWM N kB (main process)" for each NAME of PID_OF.
vmhwm_lines() {
    local name
    for name in "$@"; do
        echo "$name: VmHWM $(proc_kb "${PID_OF[$name]}" VmHWM) kB (main process)"
    done
}

# x-cache URL: the X-Cache header of one GET.
x_cache() {
    curl -s -o /dev/null -D - --max-time 5 "$1" | tr -d '\r' |
        awk -F': ' 'tolower($1) == "x-cache" { print $2 }'
}

# warm URL EXPECT...: GET URL until X-Cache is one of EXPECT (up to 50 tries).
warm() {
    local url=$1 got i e
    shift
    for ((i = 0; i < 50; i++)); do
        got=$(x_cache "$url")
        for e in "$@"; do
            [[ $got == "$e" ]] && return 0
        done
        sleep 0.1
    done
    die "warming $url: X-Cache stayed '$got' (wanted one of: $*)"
}
