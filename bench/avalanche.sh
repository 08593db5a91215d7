#!/usr/bin/env bash
# Avalanche benchmark, in one run on this machine:
#
#   origin   bench/tools `bench-origin`: GET /items/{id} -> 1024 bytes of JSON after DELAY_MS
#            (20 ms); /stats/timeline counts the requests that reached it per 100 ms (and the
#            most in flight per 100 ms), so any 1 s window can be read off afterwards
#   load     bench/tools `loadgen cycle`: open loop at a fixed rate cycling over N keys
#            (request j asks for key j mod N; with 2 URLs they alternate and each URL cycles
#            over all N keys), with a per-second timeline of statuses and X-Cache
#
#   1. Mass expiry. KEYS (10,000) keys filled in one burst (one pass at FILL_RATE, 5,000/s,
#      so the fill takes 2 s, as long as one load cycle; this 2-core machine does not keep
#      up with 10,000 cold misses/s reliably, and a fill that drags spreads the expiry)
#      with the same nominal TTL (TTL_S, 10 s), then STEADY_S (24 s: two TTLs) of steady load
#      at RATE (5,000 req/s: every key every 2 s) past the expiry. Per target:
#      peak origin req/s in any 1 s window of the steady phase (sliding, 100 ms steps), mean
#      origin req/s over it, client non-2xx/errors. Targets (rotating within each rep):
#        cg-j0     cacheguard embedded, jitter = 0, origin guard caps off
#        cg-j05    cacheguard embedded, jitter = JITTER (0.5), caps off
#        cg-cap    cacheguard shared (Redis), jitter = 0, max_rps = CAP_RPS (1000),
#                  max_concurrency = CAP_CONCURRENCY (32): the cap. The fill goes through a
#                  second, uncapped instance on the same Redis (a capped instance cannot take
#                  a cold 5,000/s burst without shedding it: there is no stale copy yet)
#        nginx     nginx 1.22 proxy_cache (bench/nginx.conf.tmpl: proxy_cache_valid 200 TTL,
#                  proxy_cache_lock on, proxy_cache_use_stale updating)
#        varnish   Varnish 7.1 (bench/varnish.vcl.tmpl: beresp.ttl TTL, beresp.grace 10 s =
#                  Varnish's default_grace)
#      cacheguard keeps its default grace (30 s): an expired key is answered STALE at once and
#      refreshed by one background request.
#   2. Redis restart. Two cacheguard instances in shared mode (a redis-server started here,
#      no persistence), both with max_rps = RS_MAX_RPS (400) and max_concurrency =
#      RS_MAX_CONCURRENCY (16) each, TTL 600 s. RS_KEYS (5,000) keys are filled into Redis
#      through a third, uncapped instance, then RS_RATE (2,000 req/s, half to each instance)
#      cycles over them for RS_TOTAL_S (35 s). At RS_KILL_AT_S (10 s) redis-server is killed
#      (SIGKILL) and RS_DOWN_S (2 s) later a new, empty one is started on the same port.
#      Reported per second: client answers by status, origin req/s, breaker state (sampled
#      every 200 ms from /metrics); and the peak origin req/s in any 1 s window against the
#      fleet cap (2 × RS_MAX_RPS), the client error rate, breaker open/close delays. Run once
#      per `l1` policy in RS_L1 ("hot" = the default: L1 holds nothing while Redis is up;
#      "all": every entry is kept in L1 too). Peers have no Redis: their comparable event is
#      the mass expiry of scenario 1.
#
# usage: bash bench/avalanche.sh
# env:   REPS=3 (scenario 1) KEYS=10000 TTL_S=10 JITTER=0.5 RATE=5000 FILL_RATE=5000
#        STEADY_S=24 CONNECTIONS=256 DELAY_MS=20 CAP_RPS=1000 CAP_CONCURRENCY=32
#        TARGETS="cg-j0 cg-j05 cg-cap nginx varnish"
#        RS_L1="hot all" RS_KEYS=5000 RS_RATE=2000 RS_TOTAL_S=35 RS_KILL_AT_S=10 RS_DOWN_S=2
#        RS_MAX_RPS=400 RS_MAX_CONCURRENCY=16 RS_CONNECTIONS=128 REDIS_COMMAND_TIMEOUT=500ms
#        SCENARIOS="expiry restart" BASE_PORT=29480 (uses BASE_PORT+1 .. +4, then
#        2 ports per cacheguard instance: +5 .. +76 with the defaults)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        TOOLS_TARGET=dir (cargo target dir of bench/tools; default bench/results/tools-target)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx/varnish/redis dirs)
#
# Writes bench/results/avalanche-<UTC timestamp>/ (loadgen JSON per phase, origin timelines
# and stats, cacheguard configs, logs and /metrics, breaker samples, raw TSVs, summary.md)
# and prints the markdown summary on stdout. Every process it starts is stopped on exit,
# by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults REPS=3 KEYS=10000 TTL_S=10 JITTER=0.5 RATE=5000 FILL_RATE=5000 STEADY_S=24 \
    CONNECTIONS=256 DELAY_MS=20 CAP_RPS=1000 CAP_CONCURRENCY=32 TARGETS="cg-j0 cg-j05 cg-cap nginx varnish"
bench_defaults RS_L1="hot all" RS_KEYS=5000 RS_RATE=2000 RS_TOTAL_S=35 RS_KILL_AT_S=10 RS_DOWN_S=2 \
    RS_MAX_RPS=400 RS_MAX_CONCURRENCY=16 RS_CONNECTIONS=128 SCENARIOS="expiry restart" BASE_PORT=29480
# 500 ms, as in tests/it/avalanche.rs: on this shared 2-core machine a stall can hold a Redis
# answer past a shorter timeout and open the breaker before the kill.
bench_defaults REDIS_COMMAND_TIMEOUT=500ms
VARNISH_GRACE_S=10

require_positive REPS KEYS TTL_S RATE FILL_RATE STEADY_S CONNECTIONS DELAY_MS CAP_RPS CAP_CONCURRENCY \
    RS_KEYS RS_RATE RS_TOTAL_S RS_KILL_AT_S RS_DOWN_S RS_MAX_RPS RS_MAX_CONCURRENCY RS_CONNECTIONS
[[ $JITTER =~ ^0(\.[0-9]+)?$ ]] || die "JITTER must be a number in [0, 1) (got '$JITTER')"
((RS_KILL_AT_S + RS_DOWN_S + 5 <= RS_TOTAL_S)) ||
    die "RS_TOTAL_S ($RS_TOTAL_S) must leave at least 5 s after RS_KILL_AT_S + RS_DOWN_S"
check_list TARGETS target cg-j0 cg-j05 cg-cap nginx varnish
for l in $RS_L1; do
    case $l in hot | all) ;; *) die "RS_L1 takes hot and/or all (got '$l')" ;; esac
done
for s in $SCENARIOS; do
    case $s in expiry | restart) ;; *) die "SCENARIOS takes expiry and/or restart (got '$s')" ;; esac
done
has_scenario() { [[ " $SCENARIOS " == *" $1 "* ]]; }
MAX_ID=$((REPS * KEYS + RS_KEYS + 1000))

bench_ports ORIGIN_PORT NGINX_PORT VARNISH_PORT REDIS_PORT
# cacheguard instances: a fresh process (and fresh ports) per run, so no run inherits L1
# contents, metrics or TIME_WAIT sockets from another; two ports each, from BASE_PORT+5 on.
cg_instances=0
if has_scenario expiry; then
    for t in $TARGETS; do
        case $t in cg-j0 | cg-j05) cg_instances=$((cg_instances + REPS)) ;; cg-cap) cg_instances=$((cg_instances + 2 * REPS)) ;; esac
    done
fi
if has_scenario restart; then
    for l in $RS_L1; do cg_instances=$((cg_instances + 3)); done
fi
CG_PORT_FIRST=$((BASE_PORT + 5))
CG_PORT_LAST=$((BASE_PORT + 4 + 2 * cg_instances))

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish redis-server:redis-server redis-cli:redis-tools \
    curl:curl jq:jq
require_tools cargo awk sort mktemp id ss timeout date
cg_ports=()
for ((p = CG_PORT_FIRST; p <= CG_PORT_LAST; p++)); do cg_ports+=("$p"); done
require_free_ports "${BENCH_PORTS[@]}" "${cg_ports[@]}"

require_fd_limit $((4 * CONNECTIONS + 1024)) "CONNECTIONS=$CONNECTIONS"

build_bench_tools

build_cacheguard

bench_results avalanche- expiry restart

# --- environment -----------------------------------------------------------------------

write_env nginx varnishd redis <<EOF
scenarios: $SCENARIOS
expiry: reps $REPS, keys $KEYS, ttl ${TTL_S}s, jitter $JITTER, fill $FILL_RATE/s, steady $RATE/s for ${STEADY_S}s, $CONNECTIONS connections, cap $CAP_RPS rps / $CAP_CONCURRENCY in flight
restart: l1 $RS_L1, keys $RS_KEYS, $RS_RATE/s for ${RS_TOTAL_S}s over 2 instances, kill at ${RS_KILL_AT_S}s, down ${RS_DOWN_S}s, per instance max_rps $RS_MAX_RPS / max_concurrency $RS_MAX_CONCURRENCY
origin_delay_ms: $DELAY_MS
EOF

# --- origin, peers, Redis ----------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" --delay-ms "$DELAY_MS" --max-id "$MAX_ID" --threads 2
curl -s --max-time 2 "$ORIGIN/stats/timeline" | jq -e '.bucket_ms == 100' >/dev/null ||
    die "bench-origin has no /stats/timeline with 100 ms buckets (stale bench/tools build?)"

if has_scenario expiry; then
    if [[ " $TARGETS " == *" nginx "* ]]; then
        start_nginx_cache nginx "$NGINX_PORT" nginx "$OUT/nginx.conf" WORKERS=2 TTL="${TTL_S}s"
    fi
    if [[ " $TARGETS " == *" varnish "* ]]; then
        start_varnish_cache varnish "$VARNISH_PORT" varnishd "$OUT/varnish.vcl" TTL="${TTL_S}s" \
            GRACE="${VARNISH_GRACE_S}s"
    fi
fi
REDIS_GEN=1
start_redis "gen$REDIS_GEN" "$REDIS_PORT"
REDIS_PID=$LAST_PID

# --- cacheguard ------------------------------------------------------------------------

next_cg_port=$CG_PORT_FIRST

# start_cacheguard NAME SHARED TTL JITTER MAX_RPS MAX_CONCURRENCY L1: a fresh instance on the
# next two free ports; sets URL_OF/ADMIN_OF/PID_OF[NAME].
start_cacheguard() {
    local name=$1 port=$next_cg_port admin=$((next_cg_port + 1)) shared=()
    ((admin <= CG_PORT_LAST)) || die "out of cacheguard ports (BASE_PORT+5 .. $((CG_PORT_LAST - BASE_PORT)))"
    next_cg_port=$((next_cg_port + 2))
    [[ $2 == 0 ]] || shared=(redis.url="redis://127.0.0.1:$REDIS_PORT"
        redis.command_timeout="$REDIS_COMMAND_TIMEOUT" journal.path="journal-$port")
    cg_config "$port" "$admin" "$ORIGIN_PORT" upstream.max_concurrency="$6" upstream.max_rps="$5" \
        "${shared[@]}" cache.ttl="$3" cache.jitter="$4" cache.l1="$7" >"$OUT/cg-$name.toml"
    launch_cacheguard "$name" "$OUT/cg-$name.toml" "$port" "$admin" "$OUT/cg-$name.log"
}

stop_cacheguard() {
    save_metrics "${ADMIN_OF[$1]}" "$OUT/metrics-$1-end.txt"
    stop_pid "${PID_OF[$1]}"
}

# msum FILE NAME: the sum of every sample of metric NAME (any labels) in a /metrics dump.
msum() {
    awk -v m="$2" '!/^#/ { n = $1; sub(/\{.*/, "", n); if (n == m) s += $2 } END { printf "%.0f", s + 0 }' "$1"
}
# msum_delta BEFORE AFTER NAME: the change of msum between two /metrics dumps.
msum_delta() { echo $(($(msum "$2" "$3") - $(msum "$1" "$3"))); }

now_ms() { date +%s%3N; }

# save_origin_timeline PREFIX: the origin's /stats/timeline into PREFIX-origin-timeline.json and
# its /stats (without the per-path counters) into PREFIX-origin-stats.json.
save_origin_timeline() {
    curl -s --max-time 5 "$ORIGIN/stats/timeline" >"$1-origin-timeline.json" ||
        die "cannot read the origin timeline"
    curl -s --max-time 5 "$ORIGIN/stats" | jq 'del(.paths)' >"$1-origin-stats.json" ||
        die "cannot read origin stats"
}

# run_loadgen JSON ARGS...: one bounded `loadgen cycle`, waited for.
run_loadgen() {
    local json=$1
    shift
    run_bg "$json" timeout --signal=TERM 600 "$LOADGEN_BIN" cycle "$@" || die "loadgen cycle failed ($?); see $json"
}

# origin_window TIMELINE FROM_MS TO_MS [CAP]: over the origin's 100 ms buckets inside
# [FROM_MS, TO_MS) (unix ms): "peak_1s total mean_per_s max_in_flight peak_at_s excess",
# where peak_1s is the most requests in any 1 s window (10 consecutive buckets), peak_at_s
# where that window starts (seconds after FROM_MS), and excess the largest burst above a
# steady CAP req/s: max over every window [a, b) of count - CAP × (b - a) (0 without CAP).
# A token bucket of rate CAP and burst CAP (governor's Quota::per_second(CAP)) keeps
# excess ≤ CAP, and so allows up to 2 × CAP in a 1 s window after a quiet spell.
origin_window() {
    jq -r '"\(.bucket_ms) \(.t0_unix_ms)", (range(0; .counts | length) as $i | "\(.counts[$i]) \(.max_in_flight[$i])")' "$1" |
        awk -v from="$2" -v to="$3" -v cap="${4:-0}" '
            NR == 1 { b = $1; t0 = $2; next }
            { c[NR - 2] = $1; f[NR - 2] = $2; n = NR - 1 }
            END {
                lo = int((from - t0) / b + 0.5); if (lo < 0) lo = 0
                hi = int((to - t0) / b + 0.5); if (hi > n) hi = n
                w = int(1000 / b)
                total = 0; mif = 0
                for (i = lo; i < hi; i++) { total += c[i]; if (f[i] > mif) mif = f[i] }
                peak = 0; at = lo
                for (i = lo; i + w <= hi; i++) {
                    s = 0
                    for (j = i; j < i + w; j++) s += c[j]
                    if (s > peak) { peak = s; at = i }
                }
                excess = 0
                if (cap > 0) {
                    per = cap * b / 1000
                    for (i = lo; i < hi; i++) {
                        s = 0
                        for (j = i; j < hi; j++) { s += c[j]; e = s - per * (j - i + 1); if (e > excess) excess = e }
                    }
                }
                len = (hi - lo) * b / 1000
                printf "%d %d %.1f %d %.1f %d\n", peak, total, (len > 0 ? total / len : 0), mif, (at - lo) * b / 1000, excess
            }'
}

# origin_per_second TIMELINE FROM_MS NSEC: origin requests in each second [FROM + k s,
# FROM + (k+1) s), k = 0 .. NSEC-1, one per line; then the most in flight in that second,
# tab-separated.
origin_per_second() {
    jq -r '"\(.bucket_ms) \(.t0_unix_ms)", (range(0; .counts | length) as $i | "\(.counts[$i]) \(.max_in_flight[$i])")' "$1" |
        awk -v from="$2" -v nsec="$3" '
            NR == 1 { b = $1; t0 = $2; next }
            { c[NR - 2] = $1; f[NR - 2] = $2 }
            END {
                lo = int((from - t0) / b + 0.5); w = int(1000 / b)
                for (k = 0; k < nsec; k++) {
                    s = 0; m = 0
                    for (j = lo + k * w; j < lo + (k + 1) * w; j++) { if (j >= 0) { s += c[j]; if (f[j] > m) m = f[j] } }
                    printf "%d\t%d\n", s, m
                }
            }'
}

# ======================================================================================
# 1. Mass expiry
# ======================================================================================

EXP_RAW=$OUT/expiry/raw.tsv
printf 'rep\ttarget\tfirst_id\tfill_s\tfill_origin\tfill_ok\tfill_bad\tpeak_1s\tpeak_at_s\tsteady_origin\tmean_per_s\tmax_in_flight\tsent\tok\tnon2xx\terrors\tunsent\tx_cache\tper_second\tcg_metrics\texcess_over_cap\n' >"$EXP_RAW"

declare -A LABEL=(
    [cg-j0]="cacheguard embedded, jitter 0, no caps"
    [cg-j05]="cacheguard embedded, jitter $JITTER, no caps"
    [cg-cap]="cacheguard shared, jitter 0, max_rps $CAP_RPS, max_concurrency $CAP_CONCURRENCY"
    [nginx]="nginx 1.22 proxy_cache"
    [varnish]="Varnish 7.1 (grace ${VARNISH_GRACE_S} s)"
)

# expiry_run TARGET REP: one mass-expiry run, parsed into expiry/raw.tsv.
expiry_run() {
    local target=$1 rep=$2 tag="rep$2-$1"
    local first_id=$(((rep - 1) * KEYS + 1)) fill_url load_url cg=() inst
    case $target in
    cg-j0 | cg-j05)
        local j=0
        [[ $target == cg-j05 ]] && j=$JITTER
        start_cacheguard "$tag" 0 "${TTL_S}s" "$j" 0 4096 hot
        cg=("$tag")
        fill_url=${URL_OF[$tag]}
        load_url=$fill_url
        ;;
    cg-cap)
        redis-cli -h 127.0.0.1 -p "$REDIS_PORT" flushall >/dev/null || die "redis FLUSHALL failed"
        start_cacheguard "$tag-filler" 1 "${TTL_S}s" 0 0 4096 hot
        start_cacheguard "$tag" 1 "${TTL_S}s" 0 "$CAP_RPS" "$CAP_CONCURRENCY" hot
        cg=("$tag" "$tag-filler")
        fill_url=${URL_OF[$tag-filler]}
        load_url=${URL_OF[$tag]}
        ;;
    nginx | varnish)
        fill_url=${URL_OF[$target]}
        load_url=$fill_url
        ;;
    esac
    for inst in "${cg[@]}"; do
        save_metrics "${ADMIN_OF[$inst]}" "$OUT/expiry/$tag-metrics-$inst-before.txt"
    done
    origin_reset

    log "expiry rep $rep/$REPS: $target: fill $KEYS keys at $FILL_RATE/s, then $RATE/s for ${STEADY_S}s"
    local fill_s
    fill_s=$(awk -v k="$KEYS" -v r="$FILL_RATE" 'BEGIN { printf "%.3f", k / r }')
    run_loadgen "$OUT/expiry/$tag-fill.json" --url "$fill_url/items/{id}" --first-id "$first_id" \
        --keys "$KEYS" --rate "$FILL_RATE" --duration-s "$fill_s" --connections "$CONNECTIONS" \
        --drain-s 10
    run_loadgen "$OUT/expiry/$tag-steady.json" --url "$load_url/items/{id}" --first-id "$first_id" \
        --keys "$KEYS" --rate "$RATE" --duration-s "$STEADY_S" --connections "$CONNECTIONS" \
        --drain-s 10
    sleep 0.3
    save_origin_timeline "$OUT/expiry/$tag"

    local cgm="-"
    if ((${#cg[@]} > 0)); then
        inst=${cg[0]}
        local b=$OUT/expiry/$tag-metrics-$inst-before.txt a=$OUT/expiry/$tag-metrics-$inst-after.txt
        save_metrics "${ADMIN_OF[$inst]}" "$a"
        cgm="stale=$(msum_delta "$b" "$a" cacheguard_stale_served_total),refreshes=$(msum_delta "$b" "$a" cacheguard_background_refreshes_total),shed=$(msum_delta "$b" "$a" cacheguard_shed_total),origin=$(msum_delta "$b" "$a" cacheguard_origin_requests_total)"
        for inst in "${cg[@]}"; do stop_cacheguard "$inst"; done
    fi

    local fj=$OUT/expiry/$tag-fill.json sj=$OUT/expiry/$tag-steady.json tl=$OUT/expiry/$tag-origin-timeline.json
    local f_start f_span s_start fill_origin fill_ok fill_bad
    f_start=$(jq '.start_unix_ms' "$fj")
    s_start=$(jq '.start_unix_ms' "$sj")
    f_span=$(jq '.first_send_to_last_answer_s' "$fj")
    fill_ok=$(jq '.ok' "$fj")
    fill_bad=$(jq '.non_2xx + .errors + .unsent' "$fj")
    read -r _ fill_origin _ _ _ _ < <(origin_window "$tl" "$((f_start - 100))" "$s_start")
    local peak total mean mif at excess cap=0
    [[ $target == cg-cap ]] && cap=$CAP_RPS
    read -r peak total mean mif at excess < <(origin_window "$tl" "$s_start" "$((s_start + STEADY_S * 1000))" "$cap")
    local per_sec
    per_sec=$(origin_per_second "$tl" "$s_start" "$STEADY_S" | cut -f1 | paste -sd' ')
    local sent ok non2xx errors unsent xc
    read -r sent ok non2xx errors unsent < <(jq -r '"\(.sent) \(.ok) \(.non_2xx) \(.errors) \(.unsent)"' "$sj")
    xc=$(json_counts "$sj")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
        "$rep" "$target" "$first_id" "$f_span" "$fill_origin" "$fill_ok" "$fill_bad" "$peak" "$at" \
        "$total" "$mean" "$mif" "$sent" "$ok" "$non2xx" "$errors" "$unsent" "$xc" "$per_sec" "$cgm" "$excess" >>"$EXP_RAW"
    printf '  %-8s fill %ss (origin %s)  steady: origin peak %s/s (at +%ss; burst over the cap %s), mean %s/s, %s total, max in flight %s; client ok %s non-2xx %s errors %s  %s\n' \
        "$target" "$f_span" "$fill_origin" "$peak" "$at" "$excess" "$mean" "$total" "$mif" "$ok" "$non2xx" "$errors" "$cgm" >&2
    log "  origin per second: $per_sec"
    ((fill_bad == 0)) || log "WARNING: $tag: $fill_bad fill requests failed, got no 2xx or were not sent (see $fj)"
    ((non2xx + errors + unsent == 0)) || log "WARNING: $tag: client non-2xx $non2xx, errors $errors, unsent $unsent (see $sj)"
    sleep 1
}

if has_scenario expiry; then
    each_rep "$TARGETS" expiry_run
fi

# ======================================================================================
# 2. Redis restart
# ======================================================================================

RS_RAW=$OUT/restart/raw.tsv
printf 'l1\tsecond\tevent\tscheduled\tok\tstatus_503\tother_non2xx\terrors\tx_cache\torigin\torigin_max_in_flight\tbreaker_A\tbreaker_B\n' >"$RS_RAW"
RS_SUM=$OUT/restart/summary.tsv
printf 'l1\tpeak_1s\tpeak_at_s\ttotal_origin\tmax_in_flight\tfleet_cap_rps\tfleet_cap_conc\tscheduled\tok\tnon2xx\terrors\tunsent\tafter_kill_scheduled\tafter_kill_bad\topen_after_kill_ms\tclosed_after_up_ms\tcg_metrics\tx_cache\trecovered_s\texcess_over_cap\tkill_at_s\tup_at_s\tbreaker_open_before_kill\n' >"$RS_SUM"

# breaker_sampler SECONDS NAME=ADMIN_URL...: every 200 ms, "unix_ms NAME breaker_open" per
# instance (na when /metrics did not answer), for SECONDS.
breaker_sampler() {
    local end=$((SECONDS + $1)) spec v t
    shift
    while ((SECONDS < end)); do
        t=$(now_ms)
        for spec in "$@"; do
            v=$(curl -s --max-time 0.5 "${spec#*=}/metrics" |
                awk '$1 == "cacheguard_redis_breaker_open" { print $2 }' || true)
            echo "$t ${spec%%=*} ${v:-na}"
        done
        sleep 0.2
    done
}

restart_run() {
    local l1=$1 tag="l1-$1" ia="rs-$1-A" ib="rs-$1-B" f="rs-$1-filler" inst
    local dir=$OUT/restart
    redis-cli -h 127.0.0.1 -p "$REDIS_PORT" flushall >/dev/null || die "redis FLUSHALL failed"
    start_cacheguard "$f" 1 600s 0.2 0 4096 hot
    start_cacheguard "$ia" 1 600s 0.2 "$RS_MAX_RPS" "$RS_MAX_CONCURRENCY" "$l1"
    start_cacheguard "$ib" 1 600s 0.2 "$RS_MAX_RPS" "$RS_MAX_CONCURRENCY" "$l1"
    local fill_s
    fill_s=$(awk -v k="$RS_KEYS" -v r="$FILL_RATE" 'BEGIN { printf "%.3f", k / r }')
    log "restart ($tag): fill $RS_KEYS keys into Redis through the uncapped instance"
    run_loadgen "$dir/$tag-fill.json" --url "${URL_OF[$f]}/items/{id}" --first-id 1 --keys "$RS_KEYS" \
        --rate "$FILL_RATE" --duration-s "$fill_s" --connections "$CONNECTIONS" --drain-s 10
    stop_cacheguard "$f"
    local in_redis
    in_redis=$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" dbsize)
    log "  Redis holds $in_redis keys after the fill"
    for inst in "$ia" "$ib"; do
        save_metrics "${ADMIN_OF[$inst]}" "$dir/$tag-metrics-$inst-before.txt"
    done
    origin_reset

    start_bg "$dir/$tag-breaker.txt" breaker_sampler "$((RS_TOTAL_S + 8))" "A=${ADMIN_OF[$ia]}" "B=${ADMIN_OF[$ib]}"
    local sampler=$LAST_PID
    log "restart ($tag): $RS_RATE req/s over $RS_KEYS keys on 2 instances for ${RS_TOTAL_S}s; Redis killed at ${RS_KILL_AT_S}s for ${RS_DOWN_S}s"
    local launched json=$dir/$tag-load.json
    launched=$(now_ms)
    start_bg "$json" timeout --signal=TERM 600 "$LOADGEN_BIN" cycle --url "${URL_OF[$ia]}/items/{id}" \
        --url "${URL_OF[$ib]}/items/{id}" --first-id 1 --keys "$RS_KEYS" --rate "$RS_RATE" \
        --duration-s "$RS_TOTAL_S" --connections "$RS_CONNECTIONS" --drain-s 10
    local lg=$LAST_PID
    # the loadgen starts its clock after its connections are up (well under a second here);
    # the kill is placed on its timeline afterwards from the wall-clock times
    sleep "$RS_KILL_AT_S"
    local kill_ms up_ms
    kill_ms=$(now_ms)
    kill -KILL "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
    forget_pid "$REDIS_PID"
    log "  redis-server (PID $REDIS_PID) killed"
    sleep "$RS_DOWN_S"
    REDIS_GEN=$((REDIS_GEN + 1))
    start_redis "gen$REDIS_GEN" "$REDIS_PORT"
    REDIS_PID=$LAST_PID
    up_ms=$(now_ms)
    log "  redis-server restarted empty (PID $REDIS_PID), answering PING $((up_ms - kill_ms)) ms after the kill"
    reap "$lg" || die "loadgen cycle failed ($?); see $json"
    sleep 0.3
    stop_pid "$sampler"
    save_origin_timeline "$dir/$tag"
    local cgm=""
    for inst in "$ia" "$ib"; do
        local mb=$dir/$tag-metrics-$inst-before.txt ma=$dir/$tag-metrics-$inst-after.txt
        save_metrics "${ADMIN_OF[$inst]}" "$ma"
        cgm+="${inst##*-}: restarts=$(msum_delta "$mb" "$ma" cacheguard_redis_restarts_total),breaker_transitions=$(msum_delta "$mb" "$ma" cacheguard_redis_breaker_transitions_total),shed=$(msum_delta "$mb" "$ma" cacheguard_shed_total),stale=$(msum_delta "$mb" "$ma" cacheguard_stale_served_total),origin=$(msum_delta "$mb" "$ma" cacheguard_origin_requests_total); "
        stop_cacheguard "$inst"
    done
    cgm=${cgm%; }
    echo "kill_ms: $kill_ms" >"$dir/$tag-events.txt"
    echo "up_ms: $up_ms" >>"$dir/$tag-events.txt"
    echo "launched_ms: $launched" >>"$dir/$tag-events.txt"

    # --- per second ---
    local start tl=$dir/$tag-origin-timeline.json
    start=$(jq '.start_unix_ms' "$json")
    local kill_s up_s
    kill_s=$(((kill_ms - start) / 1000))
    up_s=$(((up_ms - start) / 1000))
    origin_per_second "$tl" "$start" "$RS_TOTAL_S" >"$dir/$tag-origin-per-second.tsv"
    jq -r '.timeline[] | [.scheduled, .ok, (.status["503"] // 0), (.non_2xx - (.status["503"] // 0)), .errors,
            (.x_cache | to_entries | map("\(.key)=\(.value)") | join(","))] | @tsv' "$json" >"$dir/$tag-client-per-second.tsv"
    # breaker state per second and instance: "1" if any sample in that second read open,
    # "0" if all read closed, "?" without samples
    awk -v start="$start" -v nsec="$RS_TOTAL_S" '
        { s = int(($1 - start) / 1000); if ($1 < start || s >= nsec) next
          k = s SUBSEP $2; if ($3 == "1") open[k] = 1; else if ($3 == "0" && !(k in open)) open[k] = 0 }
        END { for (s = 0; s < nsec; s++) {
                a = (s SUBSEP "A") in open ? open[s SUBSEP "A"] : "?"
                b = (s SUBSEP "B") in open ? open[s SUBSEP "B"] : "?"
                printf "%s\t%s\n", a, b } }' "$dir/$tag-breaker.txt" >"$dir/$tag-breaker-per-second.tsv"
    paste "$dir/$tag-client-per-second.tsv" "$dir/$tag-origin-per-second.tsv" "$dir/$tag-breaker-per-second.tsv" |
        awk -F'\t' -v l1="$l1" -v ks="$kill_s" -v us="$up_s" \
            -v ka="$(awk -v a="$kill_ms" -v s="$start" 'BEGIN { printf "%.1f", (a - s) / 1000 }')" \
            -v ua="$(awk -v a="$up_ms" -v s="$start" 'BEGIN { printf "%.1f", (a - s) / 1000 }')" 'BEGIN { OFS = "\t" }
            { s = NR - 1; ev = ""
              if (s == ks) ev = "Redis killed (+" ka " s)"
              if (s == us) ev = (ev == "" ? "" : ev "; ") "Redis back, empty (+" ua " s)"
              print l1, s, ev, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10 }' >>"$RS_RAW"

    # --- totals ---
    local peak at total mif excess
    read -r peak total _ mif at excess < <(origin_window "$tl" "$start" "$((start + RS_TOTAL_S * 1000))" "$((2 * RS_MAX_RPS))")
    local kill_at up_at
    kill_at=$(awk -v a="$kill_ms" -v s="$start" 'BEGIN { printf "%.1f", (a - s) / 1000 }')
    up_at=$(awk -v a="$up_ms" -v s="$start" 'BEGIN { printf "%.1f", (a - s) / 1000 }')
    local sched ok non2xx errors unsent xc
    read -r sched ok non2xx errors unsent < <(jq -r '"\(.scheduled) \(.ok) \(.non_2xx) \(.errors) \(.unsent)"' "$json")
    xc=$(json_counts "$json")
    local ak_sched ak_bad
    read -r ak_sched ak_bad < <(jq -r --argjson k "$kill_s" \
        '[.timeline[] | select(.t_s >= $k)] | "\(map(.scheduled) | add // 0) \(map(.non_2xx + .errors) | add // 0)"' "$json")
    # breaker: first sample reading open after the kill (either instance, the later of the
    # two), first sample reading closed after Redis answered
    local opened closed
    opened=$(awk -v k="$kill_ms" '$1 >= k && $3 == "1" && !($2 in o) { o[$2] = $1 - k }
        END { m = -1; n = 0; for (i in o) { n++; if (o[i] > m) m = o[i] } print (n == 2 ? m : "never") }' "$dir/$tag-breaker.txt")
    closed=$(awk -v u="$up_ms" '$1 >= u && $3 == "0" && !($2 in c) { c[$2] = $1 - u }
        END { m = -1; n = 0; for (i in c) { n++; if (c[i] > m) m = c[i] } print (n == 2 ? m : "never") }' "$dir/$tag-breaker.txt")
    # recovered: the first second, from the kill's on, after which every second is error-free
    local recovered
    recovered=$(jq -r --argjson k "$kill_s" '.timeline as $t
        | [range($k; $t | length) | select(. as $i | all($t[$i:][]; .non_2xx + .errors == 0))]
        | first // "never"' "$json")
    # the breaker should open because of the kill, not before (a stall of this shared
    # machine longer than command_timeout opens it too, and changes the scenario)
    local pre_open
    pre_open=$(awk -v k="$kill_ms" '$1 < k && $3 == "1" { n++ } END { print n + 0 }' "$dir/$tag-breaker.txt")
    ((pre_open == 0)) || log "WARNING: $tag: the breaker read open in $pre_open samples before the kill (see $dir/$tag-breaker.txt and the cacheguard logs)"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$l1" "$peak" "$at" "$total" "$mif" \
        "$((2 * RS_MAX_RPS))" "$((2 * RS_MAX_CONCURRENCY))" "$sched" "$ok" "$non2xx" "$errors" "$unsent" \
        "$ak_sched" "$ak_bad" "$opened" "$closed" "$cgm" "$xc" "$recovered" "$excess" "$kill_at" "$up_at" "$pre_open" >>"$RS_SUM"
    log "  origin peak $peak/s in a 1 s window (largest burst over the cap rate: $excess; fleet cap $((2 * RS_MAX_RPS))/s), max in flight $mif; client non-2xx $non2xx, errors $errors of $sched; breaker opened +${opened} ms after the kill, closed +${closed} ms after Redis answered; $cgm"
}

if has_scenario restart; then
    for l1 in $RS_L1; do
        restart_run "$l1"
        sleep 1
    done
fi

end_env

# ======================================================================================
# summary
# ======================================================================================

col() { # col TARGET FIELD_NO: one expiry raw.tsv column for one target, every rep
    awk -F'\t' -v t="$1" -v f="$2" 'NR > 1 && $2 == t { print $f }' "$EXP_RAW"
}
sum_col() { col "$@" | sum_lines; }
merge_hist() { col "$@" | merge_counts; } # merge_hist TARGET FIELD_NO: "K=V,K=V" cells summed over the reps

{
    echo "# cacheguard avalanche: $STAMP"
    echo
    echo "All processes on 127.0.0.1 on the same $(nproc) cores; origin delay $DELAY_MS ms."
    env_summary
    if has_scenario expiry; then
        echo
        echo "## 1. Mass expiry: $(fmt_int "$KEYS") keys filled in one burst, nominal TTL ${TTL_S} s, then $(fmt_int "$RATE") req/s cycling over them for ${STEADY_S} s"
        echo
        echo "Each cell is **median (min–max) over $REPS reps** (targets rotate within each rep). Origin figures are counted at the origin in 100 ms buckets; \"peak 1 s\" is the most origin requests in any 1 s window (sliding, 100 ms steps) of the steady phase, which starts right after the fill."
        echo
        echo "| target | origin peak req/s, any 1 s | peak ÷ cacheguard jitter $JITTER | peak ÷ load rate | burst over the cap rate (cap runs) | origin mean req/s | origin requests (steady phase) | origin max in flight | fill s | client non-2xx / errors | X-Cache (all reps) |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|"
        ref=0
        # shellcheck disable=SC2046
        [[ " $TARGETS " == *" cg-j05 "* ]] && ref=$(median $(col cg-j05 8))
        for t in $TARGETS; do
            # shellcheck disable=SC2046
            pk=$(median $(col "$t" 8))
            ratio=$(awk -v a="$pk" -v b="$ref" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else printf "–" }')
            lratio=$(awk -v a="$pk" -v b="$RATE" 'BEGIN { printf "%.2f", a / b }')
            # shellcheck disable=SC2046
            printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s |\n' "${LABEL[$t]}" \
                "$(cell_dec 0 $(col "$t" 8))" "$ratio" "$lratio" "$([[ $t == cg-cap ]] && cell_dec 0 $(col "$t" 21) || echo –)" "$(cell_dec 0 $(col "$t" 11))" \
                "$(cell_dec 0 $(col "$t" 10))" "$(cell_dec 0 $(col "$t" 12))" "$(cell_dec 2 $(col "$t" 4))" \
                "$(sum_col "$t" 15)" "$(($(sum_col "$t" 16) + $(sum_col "$t" 17)))" "$(merge_hist "$t" 18)"
        done
        echo
        echo "Origin requests per second of the steady phase (second 0 starts right after the fill), rep 1:"
        echo
        echo "| target | origin req/s, second 0, 1, 2, … |"
        echo "|---|---|"
        for t in $TARGETS; do
            printf '| %s | %s |\n' "${LABEL[$t]}" "$(awk -F'\t' -v t="$t" 'NR > 1 && $1 == 1 && $2 == t { print $19 }' "$EXP_RAW")"
        done
        if [[ " $TARGETS " == *" cg-"* ]]; then
            echo
            echo "cacheguard metric deltas per run (the loaded instance): stale = \`cacheguard_stale_served_total\`, refreshes = \`cacheguard_background_refreshes_total\`, shed = \`cacheguard_shed_total\`, origin = \`cacheguard_origin_requests_total\` (fill included):"
            echo
            awk -F'\t' 'NR > 1 && $2 ~ /^cg-/ { printf "- rep %s %s: %s\n", $1, $2, $20 }' "$EXP_RAW"
        fi
    fi
    if has_scenario restart; then
        echo
        echo "## 2. Redis restart: 2 shared instances, $(fmt_int "$RS_RATE") req/s over $(fmt_int "$RS_KEYS") cached keys, Redis killed about ${RS_KILL_AT_S} s in and restarted empty ${RS_DOWN_S} s later"
        echo
        echo "Each instance: \`max_rps = $RS_MAX_RPS\`, \`max_concurrency = $RS_MAX_CONCURRENCY\`, \`queue_timeout\` 100 ms (default), \`redis.command_timeout\` $REDIS_COMMAND_TIMEOUT, ttl 600 s, grace 30 s. Fleet cap: $((2 * RS_MAX_RPS)) origin req/s, $((2 * RS_MAX_CONCURRENCY)) in flight. One run per \`l1\` policy."
        echo
        echo "| l1 | Redis killed / back at | origin peak req/s, any 1 s | peak ÷ fleet cap | burst over the cap rate | origin requests | origin max in flight | client requests | non-2xx / errors | error rate, whole run | error rate from the kill on | error-free from second | breaker open after kill | breaker closed after Redis answered | X-Cache |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        awk -F'\t' 'NR > 1 {
            printf "| %s | +%s s / +%s s | %d (at +%ss) | %.2f | %d (%.2f × cap) | %d | %d (cap %d) | %d | %d / %d | %.2f%% | %.2f%% | %s | %s | %s | %s |\n",
                $1, $21, $22, $2, $3, $2 / $6, $20, $20 / $6, $4, $5, $7, $8, $10, $11 + $12, 100 * ($10 + $11 + $12) / $8,
                100 * $14 / ($13 > 0 ? $13 : 1), ($14 == 0 ? "no errors" : ($19 == "never" ? "never" : $19 " s")),
                ($15 == "never" ? "never" : $15 " ms"), ($16 == "never" ? "never" : $16 " ms"), $18 }' "$RS_SUM"
        echo
        awk -F'\t' 'NR > 1 { printf "- l1 = %s, metric deltas: %s%s\n", $1, $17, ($23 > 0 ? "; **the breaker was already open before the kill** (" $23 " samples): a machine stall longer than command_timeout" : "") }' "$RS_SUM"
        for l1 in $RS_L1; do
            echo
            echo "### l1 = \"$l1\": per second (second 0 = start of the load)"
            echo
            echo "Client columns count the requests *scheduled* in that second (open loop; a request that waited for a connection still counts in the second it was due); origin columns count arrivals at the origin. Breaker: 1 if any 200 ms sample of \`cacheguard_redis_breaker_open\` in that second read open, ? if /metrics did not answer in time."
            echo
            echo "| s | event | client requests | 2xx | 503 | other non-2xx | errors | origin req | origin max in flight | breaker A/B open | X-Cache |"
            echo "|---|---|---|---|---|---|---|---|---|---|---|"
            awk -F'\t' -v l="$l1" 'NR > 1 && $1 == l {
                printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s/%s | %s |\n", $2, $3, $4, $5, $6, $7, $8, $10, $11, $12, $13, $9 }' "$RS_RAW"
        done
        echo
        echo "Peers have no Redis: the comparable event for nginx and Varnish is section 1, where their caches expire together."
    fi
    echo
    echo "Raw data: \`bench/results/avalanche-$STAMP/\` (loadgen JSON with per-second timelines, origin timelines in 100 ms buckets, cacheguard configs, logs and /metrics, breaker samples, raw TSVs)."
} >"$OUT/summary.md"

show_summary
