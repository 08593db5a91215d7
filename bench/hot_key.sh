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

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults REPS=3 DURATION=10s DELAY_MS=50 BASE_PORT=29580 NGINX_WORKERS=2 CG_WORKERS=0 TTL_GRACE=2s \
    EARLY_REFRESH_BETA=0 EARLY_REFRESH_BETA_X=1.0
# an empty list skips its section
TP_TARGETS=${TP_TARGETS-cg cgemb nginx varnish}
TTL_TARGETS=${TTL_TARGETS-cg2 cg2x nginx varnish}
WRK_TIMEOUT=10s
MAX_ID=100000
HOT_PATH=/items/1
TTL_PATH=/items/2
TTL_S=1
MAX_BACKEND_RPS=50 # [hot_keys] max_backend_rps_per_key (the default)

bench_ports ORIGIN_PORT NGINX_PORT VARNISH_PORT REDIS_PORT CG_PORT CG_ADMIN CGE_PORT CGE_ADMIN \
    NGINX_T_PORT VARNISH_T_PORT CGA_PORT CGA_ADMIN CGB_PORT CGB_ADMIN CGC_PORT CGC_ADMIN CGD_PORT CGD_ADMIN

require_positive REPS NGINX_WORKERS
[[ $DELAY_MS =~ ^[0-9]+$ ]] || die "DELAY_MS must be a non-negative integer (got '$DELAY_MS')"
# shellcheck disable=SC2153 # DURATION is set by bench_defaults
[[ $DURATION =~ ^([1-9][0-9]*)s$ ]] || die "DURATION must be whole seconds, e.g. 10s (got '$DURATION')"
DURATION_S=${BASH_REMATCH[1]}
[[ $CG_WORKERS =~ ^[0-9]+$ ]] || die "CG_WORKERS must be a non-negative integer"
[[ $TTL_GRACE =~ ^[0-9]+s$ ]] || die "TTL_GRACE must be whole seconds, e.g. 2s (got '$TTL_GRACE')"
[[ $EARLY_REFRESH_BETA =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "EARLY_REFRESH_BETA must be a number ≥ 0"
[[ $EARLY_REFRESH_BETA_X =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "EARLY_REFRESH_BETA_X must be a number ≥ 0"
check_list TP_TARGETS "TP_TARGETS entry" cg cgemb nginx varnish
check_list TTL_TARGETS "TTL_TARGETS entry" cg2 cg2x nginx varnish
[[ -n ${TP_TARGETS// /} || -n ${TTL_TARGETS// /} ]] || die "TP_TARGETS and TTL_TARGETS are both empty: nothing to run"
# The most origin requests the 1 s-TTL run may see: one per TTL period, plus one for the
# period the run starts in.
TTL_LIMIT=$((DURATION_S / TTL_S + 1))

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish redis-server:redis-server redis-cli:redis-tools \
    wrk:wrk curl:curl jq:jq
require_tools cargo awk sort mktemp id ss timeout
require_free_ports "${BENCH_PORTS[@]}"

build_bench_tools

build_cacheguard

bench_results hot-key- runs

# --- environment -----------------------------------------------------------------------

write_env nginx varnishd redis wrk <<EOF
reps: $REPS
duration: $DURATION
origin_delay_ms: $DELAY_MS
nginx_workers: $NGINX_WORKERS
cacheguard_worker_threads: $CG_WORKERS (0 = one per CPU)
ttl_section: route ttl ${TTL_S}s, jitter 0, grace $TTL_GRACE, early_refresh_beta $EARLY_REFRESH_BETA (cg2) / $EARLY_REFRESH_BETA_X (cg2x)
EOF

# --- origin ----------------------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" --delay-ms "$DELAY_MS" --max-id "$MAX_ID" --threads 2
check_origin_body "$ORIGIN$HOT_PATH?delay_ms=0" 1024

# --- peers -----------------------------------------------------------------------------

start_nginx_cache nginx "$NGINX_PORT" "nginx proxy_cache" "$OUT/nginx-hot.conf" WORKERS="$NGINX_WORKERS" TTL=600s
start_varnish_cache varnish "$VARNISH_PORT" varnishd "$OUT/varnish-hot.vcl" TTL=600s GRACE=10s

# --- Redis and cacheguard ----------------------------------------------------------------

start_redis shared "$REDIS_PORT"
PID_OF[redis]=$LAST_PID

# start_cacheguard NAME PORT ADMIN_PORT SHARED(1|0) KEY_PREFIX ROUTE_TTL [BETA]: one instance,
# [hot_keys] spelled out at the documented defaults (worker_threads CG_WORKERS, 0 = one per
# CPU, as bench/hit_path.sh). ROUTE_TTL 600s (section a) or the 1 s route of section b
# (jitter 0, grace TTL_GRACE, early_refresh_beta BETA).
start_cacheguard() {
    local shared=() route=()
    [[ $4 == 0 ]] || shared=(redis.url="redis://127.0.0.1:$REDIS_PORT" redis.key_prefix="$5" journal.path="journal-$2")
    [[ $6 == 600s ]] || route=(route.ttl="$6" route.jitter=0.0 route.grace="$TTL_GRACE" route.early_refresh_beta="${7:-0}")
    cg_config "$2" "$3" "$ORIGIN_PORT" server.worker_threads="$CG_WORKERS" "${shared[@]}" cache.ttl=600s \
        hot_keys.threshold_rps=100 hot_keys.cool_rps=50 hot_keys.window=250ms hot_keys.l1_ttl=1s \
        hot_keys.max_backend_rps_per_key="$MAX_BACKEND_RPS" hot_keys.max_hot_keys=256 "${route[@]}" >"$OUT/$1.toml"
    launch_cacheguard "$1" "$OUT/$1.toml" "$2" "$3" "$OUT/$1.log"
}

# bus_ready NAME: wait_bus for one shared instance (its /metrics into metrics-NAME-start.txt).
bus_ready() { wait_bus "$1" "${ADMIN_OF[$1]}" "$OUT/metrics-$1-start.txt"; }

# redis_info FILE: INFO stats + commandstats of the shared Redis.
redis_info() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" INFO all >"$1" 2>/dev/null || true; }
# redis_calls FILE CMD: calls of one command (cmdstat_CMD) in an INFO dump; 0 when absent.
redis_calls() {
    tr -d '\r' <"$1" | awk -F'[:=,]' -v c="cmdstat_$2" '$1 == c { v = $3 } END { print v + 0 }'
}
redis_total() { tr -d '\r' <"$1" | awk -F: '$1 == "total_commands_processed" { print $2 + 0 }'; }

# pre_burst TAG URL...: the same unmeasured 1 s burst before every run (all URLs at once).
pre_burst() {
    local tag=$1 url pids=() files=() i=0
    shift
    local c=$((4 / $#))
    ((c >= 1)) || c=1
    for url in "$@"; do
        files+=("$OUT/runs/$tag-preburst-$i.txt")
        wrk_start "${files[-1]}" -t1 -c"$c" -d1s --timeout "$WRK_TIMEOUT" "$url"
        pids+=("$LAST_PID")
        i=$((i + 1))
    done
    for i in "${!pids[@]}"; do wrk_finish "${files[$i]}" "${pids[$i]}"; done
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
bus_ready cg

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
    check_answer "$t" "${URL_OF[$t]}$HOT_PATH" "$OUT/headers-warm-$t.txt" 1024
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
    ((is_cg)) && log_before=$(log_lines "$OUT/$t.log")
    pre_burst "$tag" "$url"
    if ((is_cg)); then
        hot=$(hot_check "$t" "$HOT_PATH" "$OUT/runs/$tag-hotkeys-before.json")
        [[ $hot != no ]] || log "WARNING: $tag: $HOT_PATH not listed by /admin/hotkeys after the pre-burst"
        save_metrics "${ADMIN_OF[$t]}" "$OUT/runs/$tag-metrics-before.txt"
    fi
    xb=$(x_cache "$url")
    [[ $t == cg ]] && redis_info "$OUT/runs/$tag-redis-before.txt"
    origin_reset
    log "throughput rep $rep/$REPS: $t (hot=$hot, X-Cache $xb): wrk -t2 -c64 -d$DURATION $url"
    wrk_once "$file" "" -t2 -c64 -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency "$url"
    [[ $t == cg ]] && redis_info "$OUT/runs/$tag-redis-after.txt"
    save_origin_stats "$OUT/runs/$tag-origin.json"
    local origin
    origin=$(jq '.total' "$OUT/runs/$tag-origin.json")
    xa=$(x_cache "$url")
    local h_l1="-" h_be="-" h_lim="-" r_cmds="-" r_get="-" warn="-" srv="-"
    if ((is_cg)); then
        local mb="$OUT/runs/$tag-metrics-before.txt" ma="$OUT/runs/$tag-metrics-after.txt"
        save_metrics "${ADMIN_OF[$t]}" "$ma"
        curl -s --max-time 2 "${ADMIN_OF[$t]}/admin/hotkeys" >"$OUT/runs/$tag-hotkeys-after.json" || true
        h_l1=$(mdelta "$mb" "$ma" 'cacheguard_hot_key_requests_total{tier="l1"}')
        h_be=$(mdelta "$mb" "$ma" 'cacheguard_hot_key_requests_total{tier="backend"}')
        h_lim=$(mdelta "$mb" "$ma" 'cacheguard_hot_key_limited_total{route="item"}')
        warn=$(log_since "$OUT/$t.log" "$log_before" "$OUT/runs/$tag.log")
        local le1 cnt
        le1=$(mdelta "$mb" "$ma" 'cacheguard_request_duration_seconds_bucket{route="item",le="0.001"}')
        cnt=$(mdelta "$mb" "$ma" 'cacheguard_request_duration_seconds_count{route="item"}')
        srv=$(awk -v a="$le1" -v b="$cnt" 'BEGIN { if (b > 0) printf "%.2f%%", 100 * a / b; else print "-" }')
    fi
    if [[ $t == cg ]]; then
        r_cmds=$(($(redis_total "$OUT/runs/$tag-redis-after.txt") - $(redis_total "$OUT/runs/$tag-redis-before.txt") - 1))
        # Entry reads are GETRANGEs; GETs are the other reads (scripts, large values).
        r_get=$(($(redis_calls "$OUT/runs/$tag-redis-after.txt" get) - $(redis_calls "$OUT/runs/$tag-redis-before.txt" get)
            + $(redis_calls "$OUT/runs/$tag-redis-after.txt" getrange) - $(redis_calls "$OUT/runs/$tag-redis-before.txt" getrange)))
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
    note_problems TP_WARNINGS "$t rep $rep" "" "${problems[@]}"
    printf '  %-8s %12s req/s  p50 %7.3f ms  p99 %7.3f ms  origin %s  hot l1/backend/limited %s/%s/%s  redis cmds %s (GET %s)\n' \
        "$t" "$rps" "$p50" "$p99" "$origin" "$h_l1" "$h_be" "$h_lim" "$r_cmds" "$r_get" >&2
}

each_rep "$TP_TARGETS" run_tp

for t in cg cgemb; do
    save_metrics "${ADMIN_OF[$t]}" "$OUT/metrics-$t-end.txt"
done
vmhwm_lines cg cgemb nginx varnish >"$OUT/memory-throughput.txt"

# free the CPU and the memory for section b
for t in cg cgemb nginx varnish; do stop_pid "${PID_OF[$t]}"; done

# =======================================================================================
# b. sustained hot key, TTL 1 s: origin requests over the run
# =======================================================================================

start_nginx_cache nginxT "$NGINX_T_PORT" "nginx proxy_cache (ttl ${TTL_S}s)" "$OUT/nginx-ttl.conf" \
    WORKERS="$NGINX_WORKERS" TTL="${TTL_S}s"
start_varnish_cache varnishT "$VARNISH_T_PORT" "varnishd (ttl ${TTL_S}s)" "$OUT/varnish-ttl.vcl" \
    TTL="${TTL_S}s" GRACE="$TTL_GRACE"

start_cacheguard cgA "$CGA_PORT" "$CGA_ADMIN" 1 "cghk-ttl:" "${TTL_S}s" "$EARLY_REFRESH_BETA"
start_cacheguard cgB "$CGB_PORT" "$CGB_ADMIN" 1 "cghk-ttl:" "${TTL_S}s" "$EARLY_REFRESH_BETA"
start_cacheguard cgC "$CGC_PORT" "$CGC_ADMIN" 1 "cghk-ttlx:" "${TTL_S}s" "$EARLY_REFRESH_BETA_X"
start_cacheguard cgD "$CGD_PORT" "$CGD_ADMIN" 1 "cghk-ttlx:" "${TTL_S}s" "$EARLY_REFRESH_BETA_X"
for inst in cgA cgB cgC cgD; do bus_ready "$inst"; done

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
        for inst in "${insts[@]}"; do log_before[$inst]=$(log_lines "$OUT/$inst.log"); done
    fi
    pre_burst "$tag" "${urls[@]}"
    if ((is_cg)); then
        local hs=()
        for inst in "${insts[@]}"; do
            hs+=("$inst=$(hot_check "$inst" "$TTL_PATH" "$OUT/runs/$tag-hotkeys-$inst-before.json")")
            save_metrics "${ADMIN_OF[$inst]}" "$OUT/runs/$tag-metrics-$inst-before.txt"
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
        wrk_start "${files[$i]}" -t"$threads" -c"$conns" -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency "${urls[$i]}"
        pids+=("$LAST_PID")
    done
    for i in "${!pids[@]}"; do wrk_finish "${files[$i]}" "${pids[$i]}"; done
    sleep 0.3 # a refresh still on its way to the origin
    save_origin_stats "$OUT/runs/$tag-origin.json"
    curl -s --max-time 5 "$ORIGIN/stats/timeline" >"$OUT/runs/$tag-timeline.json" || die "cannot read origin timeline"
    local o_key o_total o_max win gaps
    o_key=$(origin_path_count "$OUT/runs/$tag-origin.json" "$TTL_PATH")
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
    local rps=0 p99=0 mx=0 errs=0 non2xx=0 f parsed r b m e nx
    for f in "${files[@]}"; do
        parsed=$(wrk_parse "$f") || die "cannot parse wrk output $f"
        read -r r _ b m _ e nx <<<"$parsed"
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
            save_metrics "${ADMIN_OF[$inst]}" "$ma"
            oi+=("$inst=$(mdelta "$mb" "$ma" 'cacheguard_origin_requests_total{route="item",status="2xx"}')")
            w=$((w + $(log_since "$OUT/$inst.log" "${log_before[$inst]}" "$OUT/runs/$tag-$inst.log")))
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
    note_problems TTL_WARNINGS "$t rep $rep" "" "${problems[@]}"
    printf '  %-8s origin %3s (max %s in any 1 s, in flight ≤ %s)  %12s req/s  p99 %7.3f ms  max %8.3f ms  %s %s\n' \
        "$t" "$o_key" "$win" "$o_max" "$rps" "$p99" "$mx" "$outcomes" "$by_inst" >&2
}

each_rep "$TTL_TARGETS" run_ttl

for inst in cgA cgB cgC cgD; do
    save_metrics "${ADMIN_OF[$inst]}" "$OUT/metrics-$inst-end.txt"
done
redis_info "$OUT/redis-end.txt"

end_env

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
            "$(tcol "$t" 8 | sum_lines) / $(tcol "$t" 9 | sum_lines)"
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
            "$(bcol "$t" 11 | sum_lines) / $(bcol "$t" 12 | sum_lines)"
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
    env_summary
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
        problem_items "- Every run: no socket errors, no non-2xx, 0 origin requests, the expected X-Cache after the run, and (cacheguard) the key listed hot before it." "" "${TP_WARNINGS[@]}"
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
        problem_items "- Every run: no socket errors and no non-2xx." "" "${TTL_WARNINGS[@]}"
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

show_summary
