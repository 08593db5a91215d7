#!/usr/bin/env bash
# Hot-key benchmark, in one run on this machine:
#
#   origin   bench/tools `bench-origin`: GET /items/{id} -> exactly 1024 bytes of JSON after
#            DELAY_MS (50 ms, the same delay for every target), per-path counters at
#            /stats and a 100 ms timeline at /stats/timeline
#   peers    nginx 1.22 proxy_cache (bench/nginx.conf.tmpl: lock on, `use_stale updating`,
#            worker_processes NGINX_WORKERS = 2 as in bench/hit_path.sh) and Varnish 7.1
#            (bench/varnish.vcl.tmpl, default thread pools, malloc storage)
#   cacheguard  release build, server.worker_threads CG_WORKERS (0 = one per CPU, as in
#            bench/hit_path.sh); shared mode against a redis-server started here (the sidecar
#            shape) and embedded mode (no Redis); [hot_keys] at its documented defaults
#            (threshold 100 req/s, cool 50, window 250ms, l1_ttl 1s, 50 backend req/s per
#            key, 256 hot keys)
#
#   a. throughput  one hot key (HOT_PATH, route ttl 600s), `wrk -t2 -c64 -d10s --latency`,
#                  REPS reps, targets rotating within each rep: cacheguard shared
#                  (HIT-L1 once hot), cacheguard embedded, nginx proxy_cache, Varnish.
#                  Before every run, every target gets the same 1 s pre-burst
#                  (`wrk -t1 -c4 -d1s`, not measured); for cacheguard the script then
#                  checks that GET /admin/hotkeys lists the key (detected hot); the X-Cache
#                  of one GET before and after each run is recorded. Reported: req/s, p50/p99/max (medians), ratios vs nginx
#                  and Varnish, origin requests, Redis commands during the run (INFO deltas)
#                  and the hot-key metrics (served from L1 vs past L1).
#   b. sustained hot key, TTL 1 s  route ttl "1s", jitter 0, grace TTL_GRACE (2s) on a fresh
#                  key (TTL_PATH): two cacheguard instances sharing Redis, each under
#                  `wrk -t1 -c32 -d10s` at the same time (64 connections in all), vs one
#                  nginx (`proxy_cache_valid 200 1s`) and one Varnish (ttl 1s, grace
#                  TTL_GRACE) under `wrk -t2 -c64 -d10s`. cg2 runs with early_refresh_beta 0
#                  (the default); cg2x is the same pair with early_refresh_beta 1.0 (as in
#                  config/cacheguard.toml), for comparison. The key is cached and hot before
#                  the origin counters are reset; the count is the origin's per-path counter
#                  over the run. Target: ≤ 1 origin request per TTL period across all
#                  instances (≤ duration/TTL + 1 = 11 in 10 s). REPS reps, targets rotating.
#
# usage: bash bench/hot_key.sh
# env:   REPS=3 DURATION=10s DELAY_MS=50 BASE_PORT=29580 (uses BASE_PORT+1 .. +18)
#        TP_TARGETS="cg cgemb nginx varnish" TTL_TARGETS="cg2 cg2x nginx varnish" (an empty list
#        skips that section)
#        NGINX_WORKERS=2 CG_WORKERS=0 (as bench/hit_path.sh)
#        TTL_GRACE=2s EARLY_REFRESH_BETA=0 (route early_refresh_beta of cg2 in section b: the
#        default) EARLY_REFRESH_BETA_X=1.0 (of cg2x: the value config/cacheguard.toml shows)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx/varnish/redis dirs)
#
# Writes bench/results/hot-key-<UTC timestamp>/ (wrk outputs, raw tsv files, origin stats and
# timelines, /admin/hotkeys and /metrics around each cacheguard run, Redis INFO, configs,
# logs, summary.md) and prints the markdown summary on stdout. Every process it starts is
# stopped on exit, by PID.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=bench/lib.sh
source bench/lib.sh

REPS=${REPS:-3}
DURATION=${DURATION:-10s}
DELAY_MS=${DELAY_MS:-50}
BASE_PORT=${BASE_PORT:-29580}
TP_TARGETS=${TP_TARGETS-cg cgemb nginx varnish}
TTL_TARGETS=${TTL_TARGETS-cg2 cg2x nginx varnish}
NGINX_WORKERS=${NGINX_WORKERS:-2}
CG_WORKERS=${CG_WORKERS:-0}
TTL_GRACE=${TTL_GRACE:-2s}
EARLY_REFRESH_BETA=${EARLY_REFRESH_BETA:-0}
EARLY_REFRESH_BETA_X=${EARLY_REFRESH_BETA_X:-1.0}
WRK_TIMEOUT=10s
MAX_ID=100000
HOT_PATH=/items/1
TTL_PATH=/items/2
TTL_S=1
MAX_BACKEND_RPS=50 # [hot_keys] max_backend_rps_per_key (the default)

ORIGIN_PORT=$((BASE_PORT + 1))
NGINX_PORT=$((BASE_PORT + 2))
VARNISH_PORT=$((BASE_PORT + 3))
REDIS_PORT=$((BASE_PORT + 4))
CG_PORT=$((BASE_PORT + 5))
CG_ADMIN=$((BASE_PORT + 6))
CGE_PORT=$((BASE_PORT + 7))
CGE_ADMIN=$((BASE_PORT + 8))
NGINX_T_PORT=$((BASE_PORT + 9))
VARNISH_T_PORT=$((BASE_PORT + 10))
CGA_PORT=$((BASE_PORT + 11))
CGA_ADMIN=$((BASE_PORT + 12))
CGB_PORT=$((BASE_PORT + 13))
CGB_ADMIN=$((BASE_PORT + 14))
CGC_PORT=$((BASE_PORT + 15))
CGC_ADMIN=$((BASE_PORT + 16))
CGD_PORT=$((BASE_PORT + 17))
CGD_ADMIN=$((BASE_PORT + 18))

[[ $REPS =~ ^[1-9][0-9]*$ ]] || die "REPS must be a positive integer (got '$REPS')"
[[ $DELAY_MS =~ ^[0-9]+$ ]] || die "DELAY_MS must be a non-negative integer (got '$DELAY_MS')"
[[ $DURATION =~ ^([1-9][0-9]*)s$ ]] || die "DURATION must be whole seconds, e.g. 10s (got '$DURATION')"
DURATION_S=${BASH_REMATCH[1]}
[[ $NGINX_WORKERS =~ ^[1-9][0-9]*$ ]] || die "NGINX_WORKERS must be a positive integer"
[[ $CG_WORKERS =~ ^[0-9]+$ ]] || die "CG_WORKERS must be a non-negative integer"
[[ $TTL_GRACE =~ ^[0-9]+s$ ]] || die "TTL_GRACE must be whole seconds, e.g. 2s (got '$TTL_GRACE')"
[[ $EARLY_REFRESH_BETA =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "EARLY_REFRESH_BETA must be a number ≥ 0"
[[ $EARLY_REFRESH_BETA_X =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "EARLY_REFRESH_BETA_X must be a number ≥ 0"
for t in $TP_TARGETS; do
    case $t in cg | cgemb | nginx | varnish) ;;
    *) die "unknown TP_TARGETS entry '$t' (known: cg cgemb nginx varnish)" ;;
    esac
done
for t in $TTL_TARGETS; do
    case $t in cg2 | cg2x | nginx | varnish) ;;
    *) die "unknown TTL_TARGETS entry '$t' (known: cg2 cg2x nginx varnish)" ;;
    esac
done
[[ -n ${TP_TARGETS// /} || -n ${TTL_TARGETS// /} ]] || die "TP_TARGETS and TTL_TARGETS are both empty: nothing to run"
# The most origin requests the 1 s-TTL run may see: one per TTL period, plus one for the
# period the run starts in.
TTL_LIMIT=$((DURATION_S / TTL_S + 1))

started_at=$SECONDS
bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish redis-server:redis-server redis-cli:redis-tools \
    wrk:wrk curl:curl jq:jq
require_tools cargo awk sort mktemp id ss timeout
require_free_ports "$ORIGIN_PORT" "$NGINX_PORT" "$VARNISH_PORT" "$REDIS_PORT" "$CG_PORT" "$CG_ADMIN" \
    "$CGE_PORT" "$CGE_ADMIN" "$NGINX_T_PORT" "$VARNISH_T_PORT" "$CGA_PORT" "$CGA_ADMIN" "$CGB_PORT" "$CGB_ADMIN" \
    "$CGC_PORT" "$CGC_ADMIN" "$CGD_PORT" "$CGD_ADMIN"

build_bench_tools

build_cacheguard

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=$ROOT/bench/results/hot-key-$STAMP
mkdir -p "$OUT/runs"
log "results: $OUT"

# --- environment -----------------------------------------------------------------------

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
{
    env_machine
    echo "nginx: $(nginx -v 2>&1)"
    echo "varnishd: $(varnishd -V 2>&1 | head -n1)"
    echo "redis: $(redis-server --version)"
    echo "wrk: $(wrk -v 2>&1 | head -n1 | awk '{ print $1, $2, $3 }')"
    env_build
    echo "load_start: $LOAD_START"
    echo "reps: $REPS"
    echo "duration: $DURATION"
    echo "origin_delay_ms: $DELAY_MS"
    echo "nginx_workers: $NGINX_WORKERS"
    echo "cacheguard_worker_threads: $CG_WORKERS (0 = one per CPU)"
    echo "ttl_section: route ttl ${TTL_S}s, jitter 0, grace $TTL_GRACE, early_refresh_beta $EARLY_REFRESH_BETA (cg2) / $EARLY_REFRESH_BETA_X (cg2x)"
} >"$OUT/env.txt"
cat "$OUT/env.txt" >&2

# --- origin ----------------------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_bg "$OUT/origin.log" "$ORIGIN_BIN" --port "$ORIGIN_PORT" --delay-ms "$DELAY_MS" \
    --max-id "$MAX_ID" --threads 2
ORIGIN_PID=$LAST_PID
wait_http "$ORIGIN/stats" "$ORIGIN_PID" "bench-origin"
size=$(curl -s -o /dev/null -w '%{size_download}' "$ORIGIN$HOT_PATH?delay_ms=0")
[[ $size == 1024 ]] || die "origin body is $size bytes, expected 1024"

origin_reset() { curl -s -X POST --max-time 5 "$ORIGIN/stats/reset" >/dev/null || die "cannot reset origin counters"; }

# --- peers -----------------------------------------------------------------------------

declare -A URL_OF PID_OF ADMIN_OF
start_nginx hot bench/nginx.conf.tmpl WORKERS="$NGINX_WORKERS" PORT="$NGINX_PORT" \
    ORIGIN_PORT="$ORIGIN_PORT" TTL=600s
PID_OF[nginx]=$LAST_PID
URL_OF[nginx]=http://127.0.0.1:$NGINX_PORT
wait_http "${URL_OF[nginx]}/nginx-ready" "$LAST_PID" "nginx proxy_cache"
cp "$BENCH_TMP/nginx-hot/nginx.conf" "$OUT/nginx-hot.conf"

start_varnish hot "$VARNISH_PORT" bench/varnish.vcl.tmpl ORIGIN_PORT="$ORIGIN_PORT" TTL=600s GRACE=10s
PID_OF[varnish]=$LAST_PID
URL_OF[varnish]=http://127.0.0.1:$VARNISH_PORT
wait_http "${URL_OF[varnish]}/varnish-ready" "$LAST_PID" "varnishd"
cp "$BENCH_TMP/varnish-hot/default.vcl" "$OUT/varnish-hot.vcl"

# --- Redis and cacheguard ----------------------------------------------------------------

start_redis shared "$REDIS_PORT"
REDIS_PID=$LAST_PID
PID_OF[redis]=$REDIS_PID

# cacheguard_config PORT ADMIN_PORT SHARED(1|0) KEY_PREFIX ROUTE_TTL [BETA]: [hot_keys] spelled
# out at the documented defaults. ROUTE_TTL 600s (section a) or the 1 s route of section b
# (jitter 0, grace TTL_GRACE, early_refresh_beta BETA).
cacheguard_config() {
    cat <<EOF
[server]
listen = "127.0.0.1:$1"
worker_threads = $CG_WORKERS   # 0 = one per CPU, as bench/hit_path.sh

[upstream]
url = "http://127.0.0.1:$ORIGIN_PORT"
EOF
    if [[ $3 == 1 ]]; then
        cat <<EOF

[redis]
url = "redis://127.0.0.1:$REDIS_PORT"
key_prefix = "$4"
[journal]
path = "journal-$1"
EOF
    fi
    cat <<EOF

[admin]
listen = "127.0.0.1:$2"

[cache]
ttl = "600s"

[hot_keys]
threshold_rps = 100
cool_rps = 50
window = "250ms"
l1_ttl = "1s"
max_backend_rps_per_key = $MAX_BACKEND_RPS
max_hot_keys = 256

[[routes]]
name = "item"
match = "/items/{id}"
EOF
    if [[ $5 != 600s ]]; then
        cat <<EOF
ttl = "$5"
jitter = 0.0
grace = "$TTL_GRACE"
early_refresh_beta = ${6:-0}
EOF
    fi
}

# start_cacheguard NAME PORT ADMIN_PORT SHARED KEY_PREFIX ROUTE_TTL [BETA]
start_cacheguard() {
    local name=$1 conf="$OUT/$1.toml"
    cacheguard_config "$2" "$3" "$4" "$5" "$6" "${7:-0}" >"$conf"
    "$CG_BIN" --check-config "$conf" >&2 || die "cacheguard --check-config $conf failed"
    start_bg "$OUT/$name.log" "$CG_BIN" --config "$conf"
    PID_OF[$name]=$LAST_PID
    URL_OF[$name]=http://127.0.0.1:$2
    ADMIN_OF[$name]=http://127.0.0.1:$3
    wait_http "http://127.0.0.1:$3/healthz" "$LAST_PID" "cacheguard ($name)"
}

# metric FILE NAME[{labels}]: the value of one sample in a /metrics dump (0 when absent).
metric() { awk -v m="$2" '$1 == m { v = $2 } END { printf "%.0f", v + 0 }' "$1"; }
# mdelta BEFORE AFTER NAME: the change of one sample between two /metrics dumps.
mdelta() { echo $(($(metric "$2" "$3") - $(metric "$1" "$3"))); }

# wait_bus NAME: wait (≤ 10 s) until a shared instance's event bus is subscribed.
wait_bus() {
    local deadline=$((SECONDS + 10)) f=$OUT/metrics-$1-start.txt
    while :; do
        curl -s --max-time 2 "${ADMIN_OF[$1]}/metrics" >"$f" || true
        [[ $(metric "$f" cacheguard_event_bus_subscribed) == 1 ]] && return 0
        if ((SECONDS >= deadline)); then
            log "WARNING: $1: cacheguard_event_bus_subscribed is not 1 after 10 s (see $f)"
            return 0
        fi
        sleep 0.2
    done
}

# redis_info FILE: INFO stats + commandstats of the shared Redis.
redis_info() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" INFO all >"$1" 2>/dev/null || true; }
# redis_calls FILE CMD: calls of one command (cmdstat_CMD) in an INFO dump; 0 when absent.
redis_calls() {
    tr -d '\r' <"$1" | awk -F'[:=,]' -v c="cmdstat_$2" '$1 == c { v = $3 } END { print v + 0 }'
}
redis_total() { tr -d '\r' <"$1" | awk -F: '$1 == "total_commands_processed" { print $2 + 0 }'; }

# rotate N WORD...: WORD list rotated left by N (so each rep starts with another target).
rotate() {
    local n=$1
    shift
    local a=("$@")
    local k=${#a[@]} i
    for ((i = 0; i < k; i++)); do printf '%s ' "${a[(i + n) % k]}"; done
}

# run_wrk_bg OUTFILE URL WRK_ARGS...: wrk in the background (start_bg), header line first.
# Sets LAST_PID.
run_wrk_bg() {
    local file=$1 url=$2
    shift 2
    echo "# wrk $* $url" >"$file"
    start_bg "$file.part" wrk "$@" "$url"
}
# finish_wrk OUTFILE PID: wait for one wrk, append its output, fail on a non-zero exit.
finish_wrk() {
    local file=$1 pid=$2 rc=0
    wait "$pid" || rc=$?
    forget_pid "$pid"
    cat "$file.part" >>"$file" && rm -f "$file.part"
    ((rc == 0)) || die "wrk failed ($rc); see $file"
}

# pre_burst TAG URL...: the same unmeasured 1 s burst before every run (all URLs at once).
pre_burst() {
    local tag=$1 url pids=() files=() i=0
    shift
    local c=$((4 / $#))
    ((c >= 1)) || c=1
    for url in "$@"; do
        files+=("$OUT/runs/$tag-preburst-$i.txt")
        run_wrk_bg "${files[-1]}" "$url" -t1 -c"$c" -d1s --timeout "$WRK_TIMEOUT"
        pids+=("$LAST_PID")
        i=$((i + 1))
    done
    for i in "${!pids[@]}"; do finish_wrk "${files[$i]}" "${pids[$i]}"; done
}

# hot_check NAME PATH OUTFILE: wait (≤ 3 s) until NAME's /admin/hotkeys lists PATH (or, while
# its label is not known yet, any hot key); prints "local", "peer …" or "no".
hot_check() {
    local name=$1 path=$2 file=$3 deadline=$((SECONDS + 3)) from
    while :; do
        curl -s --max-time 2 "${ADMIN_OF[$name]}/admin/hotkeys" >"$file" || true
        from=$(jq -r --arg p "$path" '
            [.hot_keys[]? | select(.key == null
                or (.key | split("\n") | any(. == $p or startswith($p + "?"))))]
            | if length > 0 then .[0].promoted_from else "no" end' "$file" 2>/dev/null || echo no)
        if [[ $from != no ]] || ((SECONDS >= deadline)); then
            echo "$from"
            return 0
        fi
        sleep 0.1
    done
}

# =======================================================================================
# a. throughput on one hot key
# =======================================================================================

start_cacheguard cg "$CG_PORT" "$CG_ADMIN" 1 "cghk:" 600s
start_cacheguard cgemb "$CGE_PORT" "$CGE_ADMIN" 0 "-" 600s
wait_bus cg

declare -A LABEL=(
    [cg]="cacheguard shared (Redis), hot key HIT-L1"
    [cgemb]="cacheguard embedded, HIT-L1"
    [nginx]="nginx 1.22 proxy_cache HIT"
    [varnish]="Varnish 7.1 HIT"
)
# After the run the shared instance may answer HIT-L2: once the key's L1 grace (l1_ttl, 1 s
# ±20%) lapses, the next request goes past L1 to Redis and renews it.
declare -A EXPECT=([cg]="HIT-L1 HIT-L2" [cgemb]=HIT-L1 [nginx]=HIT [varnish]=HIT)

log "warming $HOT_PATH on every target"
warm "${URL_OF[nginx]}$HOT_PATH" HIT
warm "${URL_OF[varnish]}$HOT_PATH" HIT
warm "${URL_OF[cg]}$HOT_PATH" HIT-L1 HIT-L2
warm "${URL_OF[cgemb]}$HOT_PATH" HIT-L1
for t in cg cgemb nginx varnish; do
    curl -s -o /dev/null -D "$OUT/headers-warm-$t.txt" "${URL_OF[$t]}$HOT_PATH"
    size=$(curl -s -o /dev/null -w '%{size_download}' "${URL_OF[$t]}$HOT_PATH")
    [[ $size == 1024 ]] || die "$t answered $size body bytes, expected 1024"
done

TP_RAW=$OUT/throughput.tsv
printf 'target\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\torigin_requests\tx_cache_before\tx_cache_after\thot_before\thot_l1\thot_backend\thot_limited\tredis_cmds\tredis_get\tlog_warnings\tsrv_le_1ms\tload1_after\n' >"$TP_RAW"
TP_WARNINGS=()

# run_tp TARGET REP: one measured wrk run on the hot key, parsed into throughput.tsv.
run_tp() {
    local t=$1 rep=$2 tag="tp-$1-rep$2" url="${URL_OF[$1]}$HOT_PATH"
    local file="$OUT/runs/$tag.txt" is_cg=0 hot="-" xb xa
    [[ $t == cg* ]] && is_cg=1
    local log_before=0
    ((is_cg)) && log_before=$(wc -l <"$OUT/$t.log")
    pre_burst "$tag" "$url"
    if ((is_cg)); then
        hot=$(hot_check "$t" "$HOT_PATH" "$OUT/runs/$tag-hotkeys-before.json")
        [[ $hot != no ]] || log "WARNING: $tag: $HOT_PATH not listed by /admin/hotkeys after the pre-burst"
        curl -s --max-time 2 "${ADMIN_OF[$t]}/metrics" >"$OUT/runs/$tag-metrics-before.txt" || true
    fi
    xb=$(x_cache "$url")
    [[ $t == cg ]] && redis_info "$OUT/runs/$tag-redis-before.txt"
    origin_reset
    log "throughput rep $rep/$REPS: $t (hot=$hot, X-Cache $xb): wrk -t2 -c64 -d$DURATION $url"
    run_wrk_bg "$file" "$url" -t2 -c64 -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency
    finish_wrk "$file" "$LAST_PID"
    [[ $t == cg ]] && redis_info "$OUT/runs/$tag-redis-after.txt"
    curl -s --max-time 5 "$ORIGIN/stats" >"$OUT/runs/$tag-origin.json" || die "cannot read origin stats"
    local origin
    origin=$(jq '.total' "$OUT/runs/$tag-origin.json")
    xa=$(x_cache "$url")
    local h_l1="-" h_be="-" h_lim="-" r_cmds="-" r_get="-" warn="-" srv="-"
    if ((is_cg)); then
        local mb="$OUT/runs/$tag-metrics-before.txt" ma="$OUT/runs/$tag-metrics-after.txt"
        curl -s --max-time 2 "${ADMIN_OF[$t]}/metrics" >"$ma" || true
        curl -s --max-time 2 "${ADMIN_OF[$t]}/admin/hotkeys" >"$OUT/runs/$tag-hotkeys-after.json" || true
        h_l1=$(mdelta "$mb" "$ma" 'cacheguard_hot_key_requests_total{tier="l1"}')
        h_be=$(mdelta "$mb" "$ma" 'cacheguard_hot_key_requests_total{tier="backend"}')
        h_lim=$(mdelta "$mb" "$ma" 'cacheguard_hot_key_limited_total{route="item"}')
        tail -n +"$((log_before + 1))" "$OUT/$t.log" >"$OUT/runs/$tag.log"
        warn=$(grep -c -E 'WARN|ERROR' "$OUT/runs/$tag.log" || true)
        local le1 cnt
        le1=$(mdelta "$mb" "$ma" 'cacheguard_request_duration_seconds_bucket{route="item",le="0.001"}')
        cnt=$(mdelta "$mb" "$ma" 'cacheguard_request_duration_seconds_count{route="item"}')
        srv=$(awk -v a="$le1" -v b="$cnt" 'BEGIN { if (b > 0) printf "%.2f%%", 100 * a / b; else print "-" }')
    fi
    if [[ $t == cg ]]; then
        r_cmds=$(($(redis_total "$OUT/runs/$tag-redis-after.txt") - $(redis_total "$OUT/runs/$tag-redis-before.txt") - 1))
        r_get=$(($(redis_calls "$OUT/runs/$tag-redis-after.txt" get) - $(redis_calls "$OUT/runs/$tag-redis-before.txt" get)))
    fi
    local parsed rps p50 p99 max reqs errs non2xx
    parsed=$(wrk_parse "$file") || die "cannot parse wrk output $file"
    read -r rps p50 p99 max reqs errs non2xx <<<"$parsed"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" \
        "$rps" "$p50" "$p99" "$max" "$reqs" "$errs" "$non2xx" "$origin" "$xb" "$xa" "$hot" \
        "$h_l1" "$h_be" "$h_lim" "$r_cmds" "$r_get" "$warn" "$srv" "$(cut -d' ' -f1 /proc/loadavg)" >>"$TP_RAW"
    local problems=()
    ((errs == 0)) || problems+=("$errs socket errors")
    ((non2xx == 0)) || problems+=("$non2xx non-2xx")
    ((origin == 0)) || problems+=("$origin origin requests")
    [[ " ${EXPECT[$t]} " == *" $xa "* ]] || problems+=("X-Cache '$xa' after the run")
    [[ $hot != no ]] || problems+=("not listed hot before the run")
    if ((${#problems[@]} > 0)); then
        local msg
        msg=$(printf '%s; ' "${problems[@]}")
        TP_WARNINGS+=("$t rep $rep: ${msg%; }")
        log "WARNING: $t rep $rep: ${msg%; }"
    fi
    printf '  %-8s %12s req/s  p50 %7.3f ms  p99 %7.3f ms  origin %s  hot l1/backend/limited %s/%s/%s  redis cmds %s (GET %s)\n' \
        "$t" "$rps" "$p50" "$p99" "$origin" "$h_l1" "$h_be" "$h_lim" "$r_cmds" "$r_get" >&2
}

for ((rep = 1; rep <= REPS; rep++)); do
    # shellcheck disable=SC2086 # word splitting of TP_TARGETS is intended
    for t in $(rotate $((rep - 1)) $TP_TARGETS); do
        run_tp "$t" "$rep"
    done
done

for t in cg cgemb; do
    curl -s --max-time 2 "${ADMIN_OF[$t]}/metrics" >"$OUT/metrics-$t-end.txt" || true
done
for t in cg cgemb nginx varnish; do
    echo "$t: VmHWM $(proc_kb "${PID_OF[$t]}" VmHWM) kB (main process)"
done >"$OUT/memory-throughput.txt"

# free the CPU and the memory for section b
for t in cg cgemb nginx varnish; do stop_pid "${PID_OF[$t]}"; done

# =======================================================================================
# b. sustained hot key, TTL 1 s: origin requests over the run
# =======================================================================================

start_nginx ttl bench/nginx.conf.tmpl WORKERS="$NGINX_WORKERS" PORT="$NGINX_T_PORT" \
    ORIGIN_PORT="$ORIGIN_PORT" TTL="${TTL_S}s"
PID_OF[nginxT]=$LAST_PID
URL_OF[nginxT]=http://127.0.0.1:$NGINX_T_PORT
wait_http "${URL_OF[nginxT]}/nginx-ready" "$LAST_PID" "nginx proxy_cache (ttl ${TTL_S}s)"
cp "$BENCH_TMP/nginx-ttl/nginx.conf" "$OUT/nginx-ttl.conf"

start_varnish ttl "$VARNISH_T_PORT" bench/varnish.vcl.tmpl ORIGIN_PORT="$ORIGIN_PORT" \
    TTL="${TTL_S}s" GRACE="$TTL_GRACE"
PID_OF[varnishT]=$LAST_PID
URL_OF[varnishT]=http://127.0.0.1:$VARNISH_T_PORT
wait_http "${URL_OF[varnishT]}/varnish-ready" "$LAST_PID" "varnishd (ttl ${TTL_S}s)"
cp "$BENCH_TMP/varnish-ttl/default.vcl" "$OUT/varnish-ttl.vcl"

start_cacheguard cgA "$CGA_PORT" "$CGA_ADMIN" 1 "cghk-ttl:" "${TTL_S}s" "$EARLY_REFRESH_BETA"
start_cacheguard cgB "$CGB_PORT" "$CGB_ADMIN" 1 "cghk-ttl:" "${TTL_S}s" "$EARLY_REFRESH_BETA"
start_cacheguard cgC "$CGC_PORT" "$CGC_ADMIN" 1 "cghk-ttlx:" "${TTL_S}s" "$EARLY_REFRESH_BETA_X"
start_cacheguard cgD "$CGD_PORT" "$CGD_ADMIN" 1 "cghk-ttlx:" "${TTL_S}s" "$EARLY_REFRESH_BETA_X"
for inst in cgA cgB cgC cgD; do wait_bus "$inst"; done

declare -A TLABEL=(
    [cg2]="cacheguard shared (Redis), 2 instances, early_refresh_beta $EARLY_REFRESH_BETA"
    [cg2x]="cacheguard shared (Redis), 2 instances, early_refresh_beta $EARLY_REFRESH_BETA_X"
    [nginx]="nginx 1.22 proxy_cache, 1 instance (\`proxy_cache_valid 200 ${TTL_S}s\`)"
    [varnish]="Varnish 7.1, 1 instance (ttl ${TTL_S}s, grace $TTL_GRACE)"
)
declare -A TINST=([cg2]="cgA cgB" [cg2x]="cgC cgD" [nginx]="nginxT" [varnish]="varnishT")

log "warming $TTL_PATH"
warm "${URL_OF[nginxT]}$TTL_PATH" HIT
warm "${URL_OF[varnishT]}$TTL_PATH" HIT
warm "${URL_OF[cgA]}$TTL_PATH" HIT-L1 HIT-L2
warm "${URL_OF[cgB]}$TTL_PATH" HIT-L1 HIT-L2
warm "${URL_OF[cgC]}$TTL_PATH" HIT-L1 HIT-L2
warm "${URL_OF[cgD]}$TTL_PATH" HIT-L1 HIT-L2

TTL_RAW=$OUT/ttl.tsv
printf 'target\trep\torigin_key\torigin_total\torigin_max_inflight\tmax_per_1s_window\tgaps_ms\trps\tp99_ms\tmax_ms\tsocket_errors\tnon2xx\thot_before\toutcomes\torigin_by_instance\tlog_warnings\tload1_after\n' >"$TTL_RAW"
TTL_WARNINGS=()

# run_ttl TARGET REP: one 10 s run on the 1 s-TTL key, parsed into ttl.tsv.
run_ttl() {
    local t=$1 rep=$2 tag="ttl-$1-rep$2" inst urls=() insts
    read -r -a insts <<<"${TINST[$t]}"
    for inst in "${insts[@]}"; do urls+=("${URL_OF[$inst]}$TTL_PATH"); done
    local is_cg=0 hot="-"
    [[ $t == cg* ]] && is_cg=1
    declare -A log_before=()
    if ((is_cg)); then
        for inst in "${insts[@]}"; do log_before[$inst]=$(wc -l <"$OUT/$inst.log"); done
    fi
    pre_burst "$tag" "${urls[@]}"
    if ((is_cg)); then
        local hs=()
        for inst in "${insts[@]}"; do
            hs+=("$inst=$(hot_check "$inst" "$TTL_PATH" "$OUT/runs/$tag-hotkeys-$inst-before.json")")
            curl -s --max-time 2 "${ADMIN_OF[$inst]}/metrics" >"$OUT/runs/$tag-metrics-$inst-before.txt" || true
        done
        hot=$(
            IFS=,
            echo "${hs[*]}"
        )
        hot=${hot// /_}
    fi
    origin_reset
    # one wrk per instance, all at once: 2 threads and 64 connections in all
    local n=${#insts[@]} files=() pids=() i
    local threads=$((2 / n)) conns=$((64 / n))
    ((threads >= 1)) || threads=1
    log "ttl rep $rep/$REPS: $t ($TTL_PATH, hot=$hot): ${n}× wrk -t$threads -c$conns -d$DURATION ${urls[*]}"
    for i in "${!urls[@]}"; do
        files+=("$OUT/runs/$tag-wrk-${insts[$i]}.txt")
        run_wrk_bg "${files[$i]}" "${urls[$i]}" -t"$threads" -c"$conns" -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency
        pids+=("$LAST_PID")
    done
    for i in "${!pids[@]}"; do finish_wrk "${files[$i]}" "${pids[$i]}"; done
    sleep 0.3 # a refresh still on its way to the origin
    curl -s --max-time 5 "$ORIGIN/stats" >"$OUT/runs/$tag-origin.json" || die "cannot read origin stats"
    curl -s --max-time 5 "$ORIGIN/stats/timeline" >"$OUT/runs/$tag-timeline.json" || die "cannot read origin timeline"
    local o_key o_total o_max win gaps
    o_key=$(jq --arg p "$TTL_PATH" '.paths[$p] // 0' "$OUT/runs/$tag-origin.json")
    o_total=$(jq '.total' "$OUT/runs/$tag-origin.json")
    o_max=$(jq '.max_in_flight' "$OUT/runs/$tag-origin.json")
    # the most origin requests in any 1 s window (10 consecutive 100 ms buckets), and the
    # gaps between consecutive origin requests (bucket resolution)
    win=$(jq '.counts as $c | ($c | length) as $n
        | if $n < 10 then ($c | add // 0) else [range(0; $n - 9) | $c[.:. + 10] | add] | max end' \
        "$OUT/runs/$tag-timeline.json")
    gaps=$(jq -r '.bucket_ms as $b | [.counts | to_entries[] | select(.value > 0) | range(0; .value) as $_ | .key]
        | [range(1; length) as $i | (.[$i] - .[$i - 1]) * $b] | map(tostring) | join(",")' \
        "$OUT/runs/$tag-timeline.json")
    [[ -n $gaps ]] || gaps="-"
    # wrk: summed req/s, worst p99 and max, summed errors
    local rps=0 p99=0 mx=0 errs=0 non2xx=0 f parsed r a b m e nx
    for f in "${files[@]}"; do
        parsed=$(wrk_parse "$f") || die "cannot parse wrk output $f"
        read -r r a b m _ e nx <<<"$parsed"
        rps=$(awk -v x="$rps" -v y="$r" 'BEGIN { printf "%.2f", x + y }')
        p99=$(awk -v x="$p99" -v y="$b" 'BEGIN { printf "%.3f", (y > x) ? y : x }')
        mx=$(awk -v x="$mx" -v y="$m" 'BEGIN { printf "%.3f", (y > x) ? y : x }')
        errs=$((errs + e))
        non2xx=$((non2xx + nx))
    done
    local outcomes="-" by_inst="-" warn="-"
    if ((is_cg)); then
        local o sum parts=() oi=() w=0 mb ma
        for inst in "${insts[@]}"; do
            mb=$OUT/runs/$tag-metrics-$inst-before.txt
            ma=$OUT/runs/$tag-metrics-$inst-after.txt
            curl -s --max-time 2 "${ADMIN_OF[$inst]}/metrics" >"$ma" || true
            oi+=("$inst=$(mdelta "$mb" "$ma" 'cacheguard_origin_requests_total{route="item",status="2xx"}')")
            tail -n +"$((log_before[$inst] + 1))" "$OUT/$inst.log" >"$OUT/runs/$tag-$inst.log"
            w=$((w + $(grep -c -E 'WARN|ERROR' "$OUT/runs/$tag-$inst.log" || true)))
        done
        for o in hit_l1 hit_l2 stale miss error; do
            sum=0
            for inst in "${insts[@]}"; do
                sum=$((sum + $(mdelta "$OUT/runs/$tag-metrics-$inst-before.txt" "$OUT/runs/$tag-metrics-$inst-after.txt" \
                    "cacheguard_requests_total{outcome=\"$o\",route=\"item\"}")))
            done
            ((sum == 0)) || parts+=("$o=$sum")
        done
        outcomes=$(
            IFS=,
            echo "${parts[*]}"
        )
        by_inst=$(
            IFS=,
            echo "${oi[*]}"
        )
        warn=$w
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "$o_key" "$o_total" \
        "$o_max" "$win" "$gaps" "$rps" "$p99" "$mx" "$errs" "$non2xx" "$hot" "${outcomes:--}" "$by_inst" "$warn" \
        "$(cut -d' ' -f1 /proc/loadavg)" >>"$TTL_RAW"
    local problems=()
    ((errs == 0)) || problems+=("$errs socket errors")
    ((non2xx == 0)) || problems+=("$non2xx non-2xx")
    [[ $hot != *=no* ]] || problems+=("not hot on every instance before the run ($hot)")
    if ((${#problems[@]} > 0)); then
        local msg
        msg=$(printf '%s; ' "${problems[@]}")
        TTL_WARNINGS+=("$t rep $rep: ${msg%; }")
        log "WARNING: $t rep $rep: ${msg%; }"
    fi
    printf '  %-8s origin %3s (max %s in any 1 s, in flight ≤ %s)  %12s req/s  p99 %7.3f ms  max %8.3f ms  %s %s\n' \
        "$t" "$o_key" "$win" "$o_max" "$rps" "$p99" "$mx" "$outcomes" "$by_inst" >&2
}

for ((rep = 1; rep <= REPS; rep++)); do
    # shellcheck disable=SC2086 # word splitting of TTL_TARGETS is intended
    for t in $(rotate $((rep - 1)) $TTL_TARGETS); do
        run_ttl "$t" "$rep"
    done
done

for inst in cgA cgB cgC cgD; do
    curl -s --max-time 2 "${ADMIN_OF[$inst]}/metrics" >"$OUT/metrics-$inst-end.txt" || true
done
redis_info "$OUT/redis-end.txt"

LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load_end: $LOAD_END" >>"$OUT/env.txt"
WALL=$((SECONDS - started_at))

# =======================================================================================
# summary
# =======================================================================================

tcol() { # tcol TARGET FIELD_NO: one throughput.tsv column, in rep order
    awk -F'\t' -v t="$1" -v f="$2" 'NR > 1 && $1 == t { print $2, $f }' "$TP_RAW" | sort -n -k1,1 | cut -d' ' -f2-
}
bcol() { # bcol TARGET FIELD_NO: one ttl.tsv column, in rep order
    awk -F'\t' -v t="$1" -v f="$2" 'NR > 1 && $1 == t { print $2, $f }' "$TTL_RAW" | sort -n -k1,1 | cut -d' ' -f2-
}
has_tp() { [[ " $TP_TARGETS " == *" $1 "* ]]; }
has_ttl() { [[ " $TTL_TARGETS " == *" $1 "* ]]; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0 && a + 0 > 0) printf "%.2f", a / b; else printf "–" }'; }
verdict() { if [[ $1 == 1 ]]; then echo "**met**"; else echo "**MISSED**"; fi; }
# paired A B: per-rep req/s ratios A/B as "min–max"
paired() {
    local r
    r=$(paste <(tcol "$1" 3) <(tcol "$2" 3) | awk '{ print $1 / $2 }')
    # shellcheck disable=SC2086
    stats $r | awk '{ printf "%.2f–%.2f", $2, $3 }'
}
declare -A RPS_MED
for t in $TP_TARGETS; do
    # shellcheck disable=SC2046
    RPS_MED[$t]=$(median $(tcol "$t" 3))
done

tp_table() {
    local t
    echo "| target | req/s | p50 ms | p99 ms | max ms | ×nginx | ×Varnish | origin requests | X-Cache before / after | errors / non-2xx |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    for t in cg cgemb nginx varnish; do
        has_tp "$t" || continue
        # shellcheck disable=SC2046
        printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "${LABEL[$t]}" \
            "$(cell int $(tcol "$t" 3))" "$(cell ms $(tcol "$t" 4))" "$(cell ms $(tcol "$t" 5))" \
            "$(LC_ALL=C printf '%.2f' "$(stats $(tcol "$t" 6) | awk '{ print $3 }')")" \
            "$(if has_tp nginx; then ratio "${RPS_MED[$t]}" "${RPS_MED[nginx]}"; else echo –; fi)" \
            "$(if has_tp varnish; then ratio "${RPS_MED[$t]}" "${RPS_MED[varnish]}"; else echo –; fi)" \
            "$(tcol "$t" 10 | paste -sd/)" \
            "$(paste -d' ' <(tcol "$t" 11) <(tcol "$t" 12) | awk '{ printf "%s%s→%s", (NR > 1 ? ", " : ""), $1, $2 }')" \
            "$(tcol "$t" 8 | awk '{ s += $1 } END { print s + 0 }') / $(tcol "$t" 9 | awk '{ s += $1 } END { print s + 0 }')"
    done
}

# per-second rates of the cacheguard shared runs (Redis commands, past-L1 requests)
per_s() { awk -v v="$1" -v d="$DURATION_S" 'BEGIN { if (v == "-") print "-"; else printf "%.1f\n", v / d }'; }

# gap_cell TARGET: "min–max (median M)" of the gaps between origin requests over all reps
gap_cell() {
    local g
    g=$(bcol "$1" 7 | tr ',' '\n' | grep -E '^[0-9]+$' | sort -n || true)
    if [[ -z $g ]]; then
        printf '–'
        return 0
    fi
    # shellcheck disable=SC2086
    printf '%s–%s (median %s)' "$(head -n1 <<<"$g")" "$(tail -n1 <<<"$g")" "$(median $g)"
}

ttl_table() {
    local t
    echo "| target | origin requests for the key in ${DURATION_S} s (per rep) | max in any 1 s window | origin max in flight | gaps between origin requests, ms (100 ms buckets) | req/s | p99 ms | max ms | errors / non-2xx |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for t in cg2 cg2x nginx varnish; do
        has_ttl "$t" || continue
        # shellcheck disable=SC2046
        printf '| %s | **%s** (%s) | %s | %s | %s | %s | %s | %s | %s |\n' "${TLABEL[$t]}" \
            "$(median $(bcol "$t" 3))" "$(bcol "$t" 3 | paste -sd/)" \
            "$(bcol "$t" 6 | paste -sd/)" "$(bcol "$t" 5 | paste -sd/)" \
            "$(gap_cell "$t")" \
            "$(cell int $(bcol "$t" 8))" "$(cell ms $(bcol "$t" 9))" \
            "$(LC_ALL=C printf '%.2f' "$(stats $(bcol "$t" 10) | awk '{ print $3 }')")" \
            "$(bcol "$t" 11 | awk '{ s += $1 } END { print s + 0 }') / $(bcol "$t" 12 | awk '{ s += $1 } END { print s + 0 }')"
    done
}

T_NGINX="" T_VARNISH="" T_TTL=""
if has_tp cg && has_tp nginx; then
    T_NGINX=$(awk -v a="${RPS_MED[cg]}" -v b="${RPS_MED[nginx]}" 'BEGIN { print (a >= b) ? 1 : 0 }')
fi
if has_tp cg && has_tp varnish; then
    T_VARNISH=$(awk -v a="${RPS_MED[cg]}" -v b="${RPS_MED[varnish]}" 'BEGIN { print (a >= b) ? 1 : 0 }')
fi
# ttl_ok TARGET: 1 when every rep stayed within TTL_LIMIT origin requests
ttl_ok() {
    local ok=1 x
    for x in $(bcol "$1" 3); do ((x <= TTL_LIMIT)) || ok=0; done
    echo "$ok"
}
has_ttl cg2 && T_TTL=$(ttl_ok cg2)

{
    echo "# cacheguard hot keys: $STAMP"
    echo
    echo "Each cell is **median (min–max) over $REPS runs** unless it says otherwise; targets rotate within each rep."
    echo "All processes on 127.0.0.1 on the same $(nproc) cores: wrk, the proxies, Redis and the origin compete for CPU."
    echo "Load average (1/5/15 min) at start: $LOAD_START; at end: $LOAD_END. Wall time: ${WALL} s."
    echo
    echo "| item | value |"
    echo "|---|---|"
    sed -n 's/^\([a-z_]*\): \(.*\)$/| \1 | \2 |/p' "$OUT/env.txt"
    echo
    if [[ -n ${TP_TARGETS// /} ]]; then
        echo "## a. Hot-key throughput: \`wrk -t2 -c64 -d$DURATION --timeout $WRK_TIMEOUT --latency\`, one hot 1 KiB key ($HOT_PATH)"
        echo
        echo "Before every run each target gets the same unmeasured 1 s burst (\`wrk -t1 -c4 -d1s\`); for cacheguard the script then"
        echo "checks \`GET /admin/hotkeys\` (hot before each run: $(tcol cg 13 | paste -sd/) for shared$(has_tp cgemb && echo ", $(tcol cgemb 13 | paste -sd/) for embedded"))."
        echo
        tp_table
        echo
        if has_tp cg && has_tp nginx; then
            echo "- **cacheguard shared / nginx proxy_cache: $(ratio "${RPS_MED[cg]}" "${RPS_MED[nginx]}")×** req/s (medians; per-rep paired $(paired cg nginx))."
        fi
        if has_tp cg && has_tp varnish; then
            echo "- **cacheguard shared / Varnish: $(ratio "${RPS_MED[cg]}" "${RPS_MED[varnish]}")×** req/s (medians; per-rep paired $(paired cg varnish))."
        fi
        if has_tp cgemb; then
            has_tp nginx && echo "- cacheguard embedded / nginx: $(ratio "${RPS_MED[cgemb]}" "${RPS_MED[nginx]}")× (per rep $(paired cgemb nginx)); / Varnish: $(ratio "${RPS_MED[cgemb]}" "${RPS_MED[varnish]:-0}")×."
            has_tp cg && echo "- cacheguard shared / embedded: $(ratio "${RPS_MED[cg]}" "${RPS_MED[cgemb]}")× (per rep $(paired cg cgemb))."
        fi
        if has_tp cg; then
            echo "- cacheguard shared, per rep: hot-key requests served from L1 / past L1 (to Redis) / over \`max_backend_rps_per_key\` (L1 copy): $(paste -d/ <(tcol cg 14) <(tcol cg 15) <(tcol cg 16) | paste -sd' ')."
            echo "  Past-L1 requests per second: $(for v in $(tcol cg 15); do per_s "$v"; done | paste -sd/) (limit $MAX_BACKEND_RPS per key and instance: \`max_backend_rps_per_key\`)."
            echo "- Redis during each shared run: commands $(tcol cg 17 | paste -sd/) ($(for v in $(tcol cg 17); do per_s "$v"; done | paste -sd/) per s; event-bus PINGs and \`hot\` broadcasts included), of which GET $(tcol cg 18 | paste -sd/)."
            echo "- WARN/ERROR log lines during the cacheguard runs: shared $(tcol cg 19 | paste -sd/)$(has_tp cgemb && echo ", embedded $(tcol cgemb 19 | paste -sd/)")."
            echo "- cacheguard's own request duration (head in to head out, \`cacheguard_request_duration_seconds\` deltas), share ≤ 1 ms per rep: shared $(tcol cg 20 | paste -sd/)$(has_tp cgemb && echo ", embedded $(tcol cgemb 20 | paste -sd/)"). wrk's p99 above includes waiting for a CPU on this shared box."
        fi
        echo "- origin requests = bench-origin's counter over the run (reset just before it); 0 means every answer came from the cache."
        echo "- 1-min load average after each run (rep order): $(for t in $TP_TARGETS; do echo "$t $(tcol "$t" 21 | paste -sd/)"; done | paste -sd';' | sed 's/;/; /g'). wrk (2 threads) and the proxy's workers alone keep about 4 threads runnable; much more means other work was competing for the 2 cores."
        if ((${#TP_WARNINGS[@]} > 0)); then
            echo "- **Runs that were not clean:**"
            printf '  - %s\n' "${TP_WARNINGS[@]}"
        else
            echo "- Every run: no socket errors, no non-2xx, 0 origin requests, the expected X-Cache after the run, and (cacheguard) the key listed hot before it."
        fi
        echo
    fi
    if [[ -n ${TTL_TARGETS// /} ]]; then
        echo "## b. Sustained hot key, TTL ${TTL_S} s: origin requests over ${DURATION_S} s (origin delay $DELAY_MS ms)"
        echo
        echo "cacheguard: route \`ttl = \"${TTL_S}s\"\`, \`jitter = 0.0\`, \`grace = \"$TTL_GRACE\"\`, \`early_refresh_beta = $EARLY_REFRESH_BETA\` (cg2; cg2x: $EARLY_REFRESH_BETA_X); two instances sharing one Redis,"
        echo "each under \`wrk -t1 -c32 -d$DURATION\` at the same time (64 connections in all). nginx and Varnish: one instance each under"
        echo "\`wrk -t2 -c64 -d$DURATION\`. The key is cached and (cacheguard) hot on every instance before the origin counters are reset"
        echo "(hot before each run: $(for t in cg2 cg2x; do has_ttl "$t" && echo "$t $(bcol "$t" 13 | paste -sd' ')"; done | paste -sd';'))."
        echo
        ttl_table
        echo
        for t in cg2 cg2x; do
            has_ttl "$t" || continue
            echo "- $t (early_refresh_beta $(if [[ $t == cg2 ]]; then echo "$EARLY_REFRESH_BETA"; else echo "$EARLY_REFRESH_BETA_X"; fi)), per rep: answers by outcome (both instances) $(bcol "$t" 14 | paste -sd' '); origin requests by instance (\`cacheguard_origin_requests_total\` deltas) $(bcol "$t" 15 | paste -sd' '); WARN/ERROR log lines $(bcol "$t" 16 | paste -sd/)."
        done
        echo "- max in any 1 s window: the most origin requests in 10 consecutive 100 ms buckets of bench-origin's timeline; gaps: time between consecutive origin requests at 100 ms resolution."
        echo "- A refresh still in flight when wrk stops is counted (the count is read 0.3 s after the run)."
        echo "- A refresh interval just under 1 s (early refresh) puts 2 requests in one 1 s window at this bucket resolution; the gaps column tells a short interval from a duplicate (gap 0–100 ms)."
        echo "- 1-min load average after each run (rep order): $(for t in $TTL_TARGETS; do echo "$t $(bcol "$t" 17 | paste -sd/)"; done | paste -sd';' | sed 's/;/; /g')."
        if ((${#TTL_WARNINGS[@]} > 0)); then
            echo "- **Runs that were not clean:**"
            printf '  - %s\n' "${TTL_WARNINGS[@]}"
        else
            echo "- Every run: no socket errors and no non-2xx."
        fi
        echo
    fi
    echo "## Hot-key benchmark targets"
    echo
    echo "| target | result | |"
    echo "|---|---|---|"
    [[ -z $T_NGINX ]] || echo "| hot-key req/s ≥ 1.0× nginx proxy_cache (cacheguard shared) | $(ratio "${RPS_MED[cg]}" "${RPS_MED[nginx]}")× ($(fmt_int "${RPS_MED[cg]}") vs $(fmt_int "${RPS_MED[nginx]}")) | $(verdict "$T_NGINX") |"
    [[ -z $T_VARNISH ]] || echo "| hot-key req/s ≥ 1.0× Varnish (cacheguard shared) | $(ratio "${RPS_MED[cg]}" "${RPS_MED[varnish]}")× ($(fmt_int "${RPS_MED[cg]}") vs $(fmt_int "${RPS_MED[varnish]}")) | $(verdict "$T_VARNISH") |"
    [[ -z $T_TTL ]] || echo "| ≤ 1 origin request per TTL period across 2 instances (≤ $TTL_LIMIT in ${DURATION_S} s, every rep), early_refresh_beta $EARLY_REFRESH_BETA | per rep $(bcol cg2 3 | paste -sd/)$(has_ttl nginx && echo "; nginx (1 instance) $(bcol nginx 3 | paste -sd/)")$(has_ttl varnish && echo "; Varnish (1 instance) $(bcol varnish 3 | paste -sd/)") | $(verdict "$T_TTL") |"
    has_ttl cg2x && echo "| the same, early_refresh_beta $EARLY_REFRESH_BETA_X (for comparison) | per rep $(bcol cg2x 3 | paste -sd/); most in any 1 s window $(bcol cg2x 6 | paste -sd/) | $(verdict "$(ttl_ok cg2x)") |"
    echo
    echo "Raw data: \`bench/results/hot-key-$STAMP/\` (throughput.tsv, ttl.tsv, runs/: wrk outputs, origin stats and timelines, /admin/hotkeys, /metrics and Redis INFO around each run; configs, logs)."
} >"$OUT/summary.md"

cat "$OUT/summary.md"
log "done in ${WALL} s; results in $OUT"
