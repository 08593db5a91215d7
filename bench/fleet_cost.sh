#!/usr/bin/env bash
# Fleet cost: what a cache hit, a cold miss and a cached entry cost in cacheguard next to
# nginx proxy_cache and Varnish, in one run on this machine:
#
#   origin   nginx `return 200` with exactly 1024 bytes of JSON for /items/{id}
#            (bench/origin.conf.tmpl, 2 workers); also the "static nginx" reference target
#   peers    nginx 1.22 proxy_cache (bench/nginx.conf.tmpl, 2 workers) and Varnish 7.1
#            (bench/varnish.vcl.tmpl, malloc storage), in front of that origin
#   cacheguard  release build: cg-l1 = embedded mode (no [redis]), `l1 = "all"`, every
#            measured request an L1 hit; cg-l2 = shared mode with one redis-server started
#            here, `l1 = "off"`, every measured request an L2 hit (one Redis GET)
#
#   a. hit throughput  `wrk -t2 -c64 -d$DURATION --latency` on one warmed 1 KiB key; targets
#            static, nginx, varnish, cg-l1, cg-l2; REPS reps, the targets rotating within each
#            rep. A run whose answers were not all hits (requests reached the origin, or the
#            X-Cache after it is not the hit) is listed as not clean.
#   b. CPU per hit  `loadgen rate` at RATE req/s (open loop) over RATE_CONNECTIONS connections
#            for RATE_DURATION_S, one warmed key, after a RATE_WARMUP_S warm-up run of its own
#            that is not counted. CPU = utime + stime (/proc/PID/stat) of every process of the
#            target (nginx: master and workers; varnishd: manager and cache child; cacheguard:
#            its one process, threads included) read just before and after the measured run,
#            in µs per answered request; for cg-l2 also redis-server's (its /proc/PID/stat) and
#            the sum. Same targets, reps and rotation as a; a run under 98% of RATE, with
#            errors or with answers that were not hits is listed as not clean.
#   c. Redis commands per request  cacheguard shared mode with `l1 = "off"` and with
#            `l1 = "hot"`: REDIS_N GETs of never-seen ids (cold misses), then the same ids again
#            (L2 hits), `loadgen list` over 8 connections. Around each batch: `CONFIG
#            RESETSTAT`, a MONITOR capture, the batch, `INFO commandstats`, and cacheguard's
#            /metrics before and after; then an idle window of the same length, measured the
#            same way and subtracted (cacheguard's own background commands: PING, INFO, the
#            event bus's reads). Reported per request: the commands cacheguard sent (MONITOR, without the
#            calls made inside Lua scripts), the commandstats calls (which count those inner
#            calls too) with a per-command breakdown, and cacheguard's own
#            cacheguard_request_redis_commands_total / cacheguard_requests_total. Then, without
#            MONITOR (whose own output costs Redis CPU), REDIS_N more never-seen ids and the
#            same again: redis-server's CPU (INFO cpu used_cpu_sys + used_cpu_user) per cold
#            miss and per L2 hit, net of an idle window as long.
#   d. memory per cached entry  one fresh instance per target, filled with MEM_KEYS distinct
#            1 KiB keys (wrk + bench/distinct.lua): cacheguard embedded with `l1_max_bytes =
#            MEM_L1_MAX_BYTES`, nginx proxy_cache with a keys_zone and max_size for MEM_KEYS
#            keys, Varnish with malloc storage for them. Memory = (Pss summed over the target's
#            processes, /proc/PID/smaps_rollup, after the fill) − (the same before it), divided
#            by the entries stored (cacheguard_l1_entries; the files in nginx's cache dir;
#            varnishstat MAIN.n_object), in KiB and as a multiple of body + origin response
#            head; nginx also: disk bytes (du -sb) per entry. One rep.
#   e. stampede  bench/stampede.sh as a sub-step: CONCURRENCIES=STAMPEDE_C TARGETS="direct nginx2
#            varnish2 cg2" (two instances of each; cg2 = two cacheguard sharing one Redis;
#            direct = the origin itself, no proxy, the floor of this machine),
#            origin delay STAMPEDE_DELAY_MS, REPS reps; its raw.tsv gives the origin requests
#            and the waiters' p99 per run.
#
# usage: CACHEGUARD_BIN=path bash bench/fleet_cost.sh
# env:   SECTIONS="a b c d e" (leave sections out to skip them) REPS=3
#        DURATION=10s (a, wrk -d)
#        RATE=5000 RATE_CONNECTIONS=16 RATE_DURATION_S=10 RATE_WARMUP_S=1 (b)
#        REDIS_N=1000 (c, requests per batch)
#        MEM_KEYS=1000000 MEM_MAX_DURATION=600s (d, wrk -d: the bound of one fill)
#        MEM_L1_MAX_BYTES=8589934592 (d, cacheguard's l1_max_bytes)
#        MEM_KEYS_ZONE=<32m per 125,000 keys> MEM_NGINX_MAX_SIZE=<8 KiB per key, at least 1g>
#        MEM_VARNISH_MALLOC=<4 KiB per key, at least 1g> (d, the peers' room for MEM_KEYS keys)
#        STAMPEDE_C=1000 STAMPEDE_DELAY_MS=200 (e)
#        BASE_PORT=32080 (uses BASE_PORT+1 .. +18) STAMPEDE_BASE_PORT=BASE_PORT+50 (e: +1 .. +12)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        BASE_BIN=path (a and b: also measure this cacheguard build, targets base-l1 and base-l2,
#        e.g. a build from before a change; its rows are in the section tables, not the summary's)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx/varnish/redis dirs)
#
# Writes bench/results/fleet-cost-<UTC timestamp>/: throughput.tsv (a), cpu.tsv (b),
# redis.tsv and redis-batches.tsv (c), memory.tsv (d), stampede.tsv (e, from the sub-step's
# raw.tsv), the raw wrk / loadgen / MONITOR / INFO / /metrics outputs under a/ .. d/, the
# sub-step's whole results dir under e/stampede/, configs, logs, env.txt and summary.md, and
# prints the markdown summary on stdout. Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults SECTIONS="a b c d e" REPS=3 DURATION=10s RATE=5000 RATE_CONNECTIONS=16 \
    RATE_DURATION_S=10 RATE_WARMUP_S=1 REDIS_N=1000 MEM_KEYS=1000000 MEM_MAX_DURATION=600s \
    MEM_L1_MAX_BYTES=8589934592 STAMPEDE_C=1000 STAMPEDE_DELAY_MS=200 BASE_PORT=32080
require_positive REPS RATE RATE_CONNECTIONS RATE_DURATION_S RATE_WARMUP_S REDIS_N MEM_KEYS \
    MEM_L1_MAX_BYTES STAMPEDE_C STAMPEDE_DELAY_MS BASE_PORT
check_list SECTIONS section a b c d e
# room in the peers for MEM_KEYS keys: nginx keeps ~8,000 keys per MB of keys_zone (here half
# that, rounded up to 32m steps) and a 1 KiB entry takes one 4 KiB block in its cache dir (its
# max_size: twice that), and Varnish gets 4 KiB per key of malloc storage
bench_defaults MEM_KEYS_ZONE=$((32 * ((MEM_KEYS + 124999) / 125000)))m \
    MEM_NGINX_MAX_SIZE=$(((MEM_KEYS * 8 + 1048575) / 1048576))g \
    MEM_VARNISH_MALLOC=$(((MEM_KEYS * 4 + 1048575) / 1048576))g \
    STAMPEDE_BASE_PORT=$((BASE_PORT + 50))
BODY_BYTES=1024
KEY=/items/1
LIST_CONNECTIONS=8
SETTLE_S=0.5
RATE_DRAIN_S=5
MAIN_TARGETS="static nginx varnish cg-l1 cg-l2"
TARGETS=$MAIN_TARGETS
# BASE_BIN: another cacheguard build, measured beside the rest in sections a and b.
BASE_BIN=${BASE_BIN:-}
[[ -z $BASE_BIN ]] || TARGETS+=" base-l1 base-l2"
L1_MODES="off hot"

bench_ports ORIGIN_PORT NGINX_PORT VARNISH_PORT REDIS_PORT CGL1_PORT CGL1_ADMIN CGL2_PORT CGL2_ADMIN \
    CGC_PORT CGC_ADMIN MEM_NGINX_PORT MEM_VARNISH_PORT MEM_CG_PORT MEM_CG_ADMIN \
    BASEL1_PORT BASEL1_ADMIN BASEL2_PORT BASEL2_ADMIN

# has SECTION: true when SECTION is in SECTIONS.
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish redis-server:redis-server redis-cli:redis-tools \
    wrk:wrk curl:curl jq:jq
require_tools cargo awk sort pgrep timeout find du getconf
require_free_ports "${BENCH_PORTS[@]}"
raise_fd_limit

build_cacheguard

build_bench_tools

bench_results fleet-cost- a b c d e

TCK=$(getconf CLK_TCK)
PROBLEMS=() # runs that were not clean, for the summary

write_env nginx varnishd redis wrk <<EOF
sections: $SECTIONS
reps: $REPS
throughput: wrk -t2 -c64 -d$DURATION --latency, one warmed 1 KiB key
cpu_load: $RATE req/s open loop over $RATE_CONNECTIONS connections, ${RATE_DURATION_S}s after a ${RATE_WARMUP_S}s warm-up run
redis_batch: $REDIS_N requests, $LIST_CONNECTIONS connections
memory: $MEM_KEYS keys; cacheguard l1_max_bytes $MEM_L1_MAX_BYTES; nginx keys_zone $MEM_KEYS_ZONE, max_size $MEM_NGINX_MAX_SIZE; varnish malloc $MEM_VARNISH_MALLOC
stampede: C=$STAMPEDE_C, origin delay ${STAMPEDE_DELAY_MS} ms, bench/stampede.sh BASE_PORT=$STAMPEDE_BASE_PORT
EOF

# --- the origin (static nginx) ------------------------------------------------------------

BODY=$(static_body "$BODY_BYTES")
if has a || has b || has c || has d; then
    start_nginx origin bench/origin.conf.tmpl WORKERS=2 PORT="$ORIGIN_PORT" STATIC_BODY="$BODY"
    PID_OF[static]=$LAST_PID
    wait_http "http://127.0.0.1:$ORIGIN_PORT$KEY" "$LAST_PID" "origin nginx"
    cp "$BENCH_TMP/nginx-origin/nginx.conf" "$OUT/nginx-origin.conf"
    check_origin_body "http://127.0.0.1:$ORIGIN_PORT$KEY" "$BODY_BYTES"
    # what a cache stores at least per entry: the body and the origin's response head
    HEAD_BYTES=$(curl -s -o /dev/null -w '%{size_header}' "http://127.0.0.1:$ORIGIN_PORT$KEY")
    ENTRY_BYTES=$((BODY_BYTES + HEAD_BYTES))
fi

# start_cg NAME PORT ADMIN_PORT embedded|shared SECTION.KEY=VALUE...: one cacheguard instance
# (cg_config: upstream max_concurrency 256, ttl 600s, the settings given; shared: the
# redis-server started here, a journal of its own) with its config, log and /metrics in OUT.
start_cg() {
    local name=$1 port=$2 admin=$3 mode=$4 shared=()
    shift 4
    [[ $mode == embedded ]] ||
        shared=(redis.url="redis://127.0.0.1:$REDIS_PORT" journal.path="$BENCH_TMP/journal-$name")
    cg_config "$port" "$admin" "$ORIGIN_PORT" upstream.max_concurrency=256 cache.ttl=600s \
        "${shared[@]}" "$@" >"$OUT/$name.toml"
    launch_cacheguard "$name" "$OUT/$name.toml" "$port" "$admin" "$OUT/$name.log"
}

REDIS_CLI=(redis-cli -h 127.0.0.1 -p "$REDIS_PORT")
if has a || has b || has c; then
    start_redis fleet "$REDIS_PORT"
    PID_OF[redis]=$LAST_PID
fi

# --- a and b: one warmed key through every target ---------------------------------------

declare -A URL=(
    [static]="http://127.0.0.1:$ORIGIN_PORT$KEY"
    [nginx]="http://127.0.0.1:$NGINX_PORT$KEY"
    [varnish]="http://127.0.0.1:$VARNISH_PORT$KEY"
    [cg-l1]="http://127.0.0.1:$CGL1_PORT$KEY"
    [cg-l2]="http://127.0.0.1:$CGL2_PORT$KEY"
    [base-l1]="http://127.0.0.1:$BASEL1_PORT$KEY"
    [base-l2]="http://127.0.0.1:$BASEL2_PORT$KEY"
)
declare -A HIT=([static]="" [nginx]=HIT [varnish]=HIT [cg-l1]=HIT-L1 [cg-l2]=HIT-L2 [base-l1]=HIT-L1
    [base-l2]=HIT-L2)

# run_throughput TARGET REP: one section-a wrk run, into throughput.tsv.
run_throughput() {
    local t=$1 rep=$2 file="$OUT/a/wrk-$1-rep$2.txt" before after origin=- xc=- parsed problems=()
    local rps p50 p99 max reqs errs non2xx
    before=$(stub_requests "$ORIGIN_PORT")
    log "a. rep $rep/$REPS: $t: wrk -t2 -c64 -d$DURATION --latency ${URL[$t]}"
    wrk_once "$file" "$t" -t2 -c64 -d"$DURATION" --timeout 10s --latency "${URL[$t]}"
    after=$(stub_requests "$ORIGIN_PORT")
    parsed=$(wrk_parse "$file") || die "cannot parse wrk output $file"
    read -r rps p50 p99 max reqs errs non2xx <<<"$parsed"
    ((errs == 0 && non2xx == 0)) || problems+=("$errs socket errors, $non2xx non-2xx")
    if [[ -n ${HIT[$t]} ]]; then
        # the stub_status read after the run counts itself
        origin=$((after - before - 1))
        xc=$(x_cache "${URL[$t]}")
        ((origin == 0)) || problems+=("$origin requests reached the origin: not every answer was a hit")
        [[ $xc == "${HIT[$t]}" ]] || problems+=("X-Cache after the run was '$xc', not ${HIT[$t]}")
    fi
    note_problems PROBLEMS "a. $t rep $rep" " (see $file)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "$rps" "$p50" "$p99" "$max" \
        "$reqs" "$errs" "$non2xx" "$origin" "$xc" >>"$OUT/throughput.tsv"
    printf '  %-8s %12s req/s  p50 %7.3f ms  p99 %7.3f ms\n' "$t" "$rps" "$p50" "$p99" >&2
}

RATE_BOUND_S=$((RATE_WARMUP_S + RATE_DURATION_S + RATE_DRAIN_S + 30))
# rate_args SECONDS: the `loadgen rate` arguments of a section-b run of SECONDS.
rate_args() {
    echo --rate "$RATE" --connections "$RATE_CONNECTIONS" --duration-s "$1" --drain-s "$RATE_DRAIN_S" \
        --timeout-s 10 --threads 1
}

# run_cpu TARGET REP: one section-b run (a warm-up run, then the measured one with the CPU of the
# target's processes, and of redis-server, read around it), into cpu.tsv.
run_cpu() {
    local t=$1 rep=$2 json="$OUT/b/loadgen-$1-rep$2.json" pids c0 c1 r0 r1 ok achieved us redis_us=- problems
    log "b. rep $rep/$REPS: $t: loadgen rate $(rate_args "$RATE_DURATION_S") --url ${URL[$t]}"
    # shellcheck disable=SC2046 # rate_args: words on purpose
    loadgen_rate "$OUT/b/warmup-$t-rep$rep.json" "$t (warm-up)" "$RATE_BOUND_S" --url "${URL[$t]}" \
        $(rate_args "$RATE_WARMUP_S")
    mapfile -t pids < <(proc_tree "${PID_OF[$t]}")
    c0=$(cpu_ticks "${pids[@]}")
    r0=$(cpu_ticks "${PID_OF[redis]}")
    # shellcheck disable=SC2046
    loadgen_rate "$json" "$t" "$RATE_BOUND_S" --url "${URL[$t]}" $(rate_args "$RATE_DURATION_S")
    c1=$(cpu_ticks "${pids[@]}")
    r1=$(cpu_ticks "${PID_OF[redis]}")
    read -r ok achieved < <(jq -r '[.ok, .achieved_rate_rps] | @tsv' "$json")
    ((ok > 0)) || die "b. $t: no request answered; see $json"
    us=$(awk -v d=$((c1 - c0)) -v tck="$TCK" -v n="$ok" 'BEGIN { printf "%.3f", d * 1e6 / tck / n }')
    if [[ $t == *-l2 ]]; then
        redis_us=$(awk -v d=$((r1 - r0)) -v tck="$TCK" -v n="$ok" 'BEGIN { printf "%.3f", d * 1e6 / tck / n }')
    fi
    mapfile -t problems < <(rate_problems "$json" "$RATE" "${HIT[$t]}")
    note_problems PROBLEMS "b. $t rep $rep" " (see $json)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "${#pids[@]}" "$ok" "$achieved" "$us" "$redis_us" \
        "$(awk -v a="$us" -v b="$redis_us" 'BEGIN { printf "%.3f", a + b }')" >>"$OUT/cpu.tsv"
    printf '  %-8s %9s req/s  %8s µs/req  (redis-server %s µs/req; %s processes)\n' "$t" "$achieved" "$us" \
        "$redis_us" "${#pids[@]}" >&2
}

if has a || has b; then
    start_nginx_cache nginx "$NGINX_PORT" "nginx proxy_cache" "$OUT/nginx-proxy.conf" WORKERS=2 TTL=600s
    start_varnish_cache varnish "$VARNISH_PORT" varnishd "$OUT/varnish.vcl" TTL=600s GRACE=10s
    start_cg cg-l1 "$CGL1_PORT" "$CGL1_ADMIN" embedded cache.l1=all
    start_cg cg-l2 "$CGL2_PORT" "$CGL2_ADMIN" shared cache.l1=off
    if [[ -n $BASE_BIN ]]; then
        CG_BIN=$BASE_BIN start_cg base-l1 "$BASEL1_PORT" "$BASEL1_ADMIN" embedded cache.l1=all
        CG_BIN=$BASE_BIN start_cg base-l2 "$BASEL2_PORT" "$BASEL2_ADMIN" shared cache.l1=off
    fi
    log "warming $KEY"
    for t in $TARGETS; do
        [[ -z ${HIT[$t]} ]] || warm "${URL[$t]}" "${HIT[$t]}"
        check_answer "$t" "${URL[$t]}" "$OUT/headers-$t.txt" "$BODY_BYTES"
    done

    if has a; then
        printf 'target\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\torigin_requests\tx_cache_after\n' \
            >"$OUT/throughput.tsv"
        each_rep "$TARGETS" run_throughput
    fi
    if has b; then
        printf 'target\trep\tprocesses\tanswered\tachieved_rps\tcpu_us_per_req\tredis_us_per_req\ttotal_us_per_req\n' \
            >"$OUT/cpu.tsv"
        each_rep "$TARGETS" run_cpu
    fi
    for t in cg-l1 cg-l2; do save_metrics "${ADMIN_OF[$t]}" "$OUT/metrics-$t-end.txt"; done
    for t in nginx varnish cg-l1 cg-l2 ${BASE_BIN:+base-l1 base-l2}; do stop_pid "${PID_OF[$t]}"; done
fi

# --- c. Redis commands per cold miss and per L2 hit ------------------------------------------

# redis_window PREFIX CMD...: one measured window: CONFIG RESETSTAT, MONITOR into
# PREFIX.monitor, CMD..., SETTLE_S for what is still on its way, then INFO commandstats into
# PREFIX.cmdstats. Sets CMD_S (how long CMD took, in seconds).
redis_window() {
    local prefix=$1 t0 mon deadline
    shift
    "${REDIS_CLI[@]}" config resetstat >/dev/null
    start_bg "$prefix.monitor" "${REDIS_CLI[@]}" monitor
    mon=$LAST_PID
    deadline=$((SECONDS + 5))
    until [[ -s $prefix.monitor ]]; do
        ((SECONDS < deadline)) || die "redis-cli monitor did not start (see $prefix.monitor)"
        sleep 0.05
    done
    t0=$EPOCHREALTIME
    "$@"
    CMD_S=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    sleep "$SETTLE_S"
    stop_pid "$mon"
    "${REDIS_CLI[@]}" info commandstats | tr -d '\r' >"$prefix.cmdstats"
}

# window_counts PREFIX: "source command count" lines of one redis_window: source "client" for
# what the clients sent and "lua" for the calls made inside Lua scripts (from MONITOR), and
# "commandstats" (INFO commandstats, which counts both; this script's own CONFIG, INFO and
# MONITOR left out).
window_counts() {
    awk '$2 ~ /^\[/ {
            c = tolower($4); gsub(/"/, "", c)
            n[($3 == "lua]" ? "lua" : "client") " " c]++
        }
        END { for (k in n) print k, n[k] }' "$1.monitor"
    awk -F: '/^cmdstat_/ {
            name = substr($1, 9); split($2, kv, ","); sub(/^calls=/, "", kv[1])
            if (name != "config|resetstat" && name != "info" && name != "monitor") print "commandstats", name, kv[1] + 0
        }' "$1.cmdstats"
}

# redis_cpu_s: redis-server's CPU so far (INFO cpu: used_cpu_sys + used_cpu_user), seconds.
redis_cpu_s() {
    "${REDIS_CLI[@]}" info cpu | tr -d '\r' |
        awk -F: '$1 == "used_cpu_sys" || $1 == "used_cpu_user" { t += $2 } END { printf "%.6f", t }'
}

# redis_cpu_batch MODE PHASE IDS: every id of IDS once, without MONITOR, then an idle window
# as long; redis-server's CPU of each into redis-cpu.tsv.
redis_cpu_batch() {
    local mode=$1 phase=$2 ids=$3 p="$OUT/c/$1-$2-cpu" c0 c1 c2 t0 cmd_s n
    n=$(wc -l <"$ids")
    log "c. l1 = $mode: $phase, Redis CPU: $n requests, then an idle window as long"
    c0=$(redis_cpu_s)
    t0=$EPOCHREALTIME
    run_list "$p.json" "$ids"
    cmd_s=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    sleep "$SETTLE_S"
    c1=$(redis_cpu_s)
    sleep "$(awk -v a="$cmd_s" -v b="$SETTLE_S" 'BEGIN { printf "%.3f", a + b }')"
    c2=$(redis_cpu_s)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$phase" "$n" "$(json_counts "$p.json")" \
        "$(awk -v a="$c1" -v b="$c0" 'BEGIN { printf "%.6f", a - b }')" \
        "$(awk -v a="$c2" -v b="$c1" 'BEGIN { printf "%.6f", a - b }')" >>"$OUT/redis-cpu.tsv"
}

# run_list JSON IDS: every id of IDS once through the section-c instance (loadgen list).
run_list() {
    run_bg "$1" timeout --signal=TERM 120 "$LOADGEN_BIN" list --url "http://127.0.0.1:$CGC_PORT/items/{id}" \
        --ids-file "$2" --connections "$LIST_CONNECTIONS" --max-duration-s 60 ||
        die "loadgen list failed ($?); see $1"
}

# redis_batch MODE PHASE IDS EXPECT: one batch (every id of IDS once) and an idle window of the
# same length, into redis.tsv (counts) and redis-batches.tsv (requests, X-Cache, cacheguard's
# metric); a batch with an answer other than X-Cache EXPECT is listed as not clean.
redis_batch() {
    local mode=$1 phase=$2 ids=$3 expect=$4 p="$OUT/c/$1-$2" cmd_s ok xc m_cmds m_reqs n
    n=$(wc -l <"$ids")
    log "c. l1 = $mode: $phase: $n requests, then an idle window as long"
    save_metrics "$CGC_ADMIN_URL" "$p-metrics-before.txt"
    redis_window "$p-batch" run_list "$p.json" "$ids"
    cmd_s=$CMD_S
    save_metrics "$CGC_ADMIN_URL" "$p-metrics-after.txt"
    redis_window "$p-idle" sleep "$cmd_s"
    local w
    for w in batch idle; do
        window_counts "$p-$w" | awk -v m="$mode" -v ph="$phase" -v w="$w" -v OFS='\t' \
            '{ print m, ph, w, $1, $2, $3 }' >>"$OUT/redis.tsv"
    done
    ok=$(jq '.ok' "$p.json")
    xc=$(json_counts "$p.json")
    m_cmds=$(($(metric_sum "$p-metrics-after.txt" cacheguard_request_redis_commands_total) -
        $(metric_sum "$p-metrics-before.txt" cacheguard_request_redis_commands_total)))
    m_reqs=$(($(metric_sum "$p-metrics-after.txt" cacheguard_requests_total) -
        $(metric_sum "$p-metrics-before.txt" cacheguard_requests_total)))
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$phase" "$n" "$ok" "$xc" "$cmd_s" "$m_cmds" "$m_reqs" \
        >>"$OUT/c/batches.tmp"
    local problems=()
    [[ $xc == "$expect=$n" ]] || problems+=("X-Cache $xc, expected $expect for all $n")
    ((ok == n)) || problems+=("$ok of $n answered 2xx")
    note_problems PROBLEMS "c. l1 = $mode, $phase" " (see $p.json)" "${problems[@]}"
}

if has c; then
    printf 'mode\tphase\twindow\tsource\tcommand\tcount\n' >"$OUT/redis.tsv"
    printf 'mode\tphase\trequests\tx_cache\tbatch_cpu_s\tidle_cpu_s\n' >"$OUT/redis-cpu.tsv"
    : >"$OUT/c/batches.tmp"
    first=1000001
    for mode in $L1_MODES; do
        "${REDIS_CLI[@]}" flushall >/dev/null
        start_cg "cg-c-$mode" "$CGC_PORT" "$CGC_ADMIN" shared cache.l1="$mode"
        CGC_ADMIN_URL=${ADMIN_OF[cg-c-$mode]}
        wait_bus "cg-c-$mode" "$CGC_ADMIN_URL" "$OUT/c/$mode-metrics-start.txt"
        sleep 1 # past start-up's own commands
        seq "$first" $((first + REDIS_N - 1)) >"$OUT/c/$mode-ids.txt"
        first=$((first + REDIS_N))
        redis_batch "$mode" miss "$OUT/c/$mode-ids.txt" MISS
        redis_batch "$mode" hit "$OUT/c/$mode-ids.txt" HIT-L2
        seq "$first" $((first + REDIS_N - 1)) >"$OUT/c/$mode-cpu-ids.txt"
        first=$((first + REDIS_N))
        redis_cpu_batch "$mode" miss "$OUT/c/$mode-cpu-ids.txt"
        redis_cpu_batch "$mode" hit "$OUT/c/$mode-cpu-ids.txt"
        stop_pid "${PID_OF[cg-c-$mode]}"
    done
    {
        printf 'mode\tphase\trequests\tok\tx_cache\twindow_s\tmetric_redis_commands\tmetric_requests\n'
        cat "$OUT/c/batches.tmp"
    } >"$OUT/redis-batches.tsv"
    rm -f "$OUT/c/batches.tmp"
fi
if has a || has b || has c; then stop_pid "${PID_OF[redis]}"; fi

# --- d. memory per cached entry --------------------------------------------------------------

# mem_entries TARGET: the entries the section-d instance of TARGET holds.
mem_entries() {
    case $1 in
    nginx) find "$BENCH_TMP/nginx-mem-nginx/cache" -type f | wc -l ;;
    varnish) varnishstat -n "$BENCH_TMP/varnish-mem-varnish/n" -1 -f MAIN.n_object | awk '{ print $2 + 0 }' ;;
    cg-l1)
        save_metrics "${ADMIN_OF[mem-cg-l1]}" "$OUT/d/metrics-cg-l1.txt"
        metric "$OUT/d/metrics-cg-l1.txt" cacheguard_l1_entries
        ;;
    esac
}

# per_entry_kib BYTES ENTRIES: BYTES / ENTRIES in KiB, 3 decimals ("-" when BYTES is "-").
per_entry_kib() {
    if [[ $1 == - ]]; then echo -; else awk -v b="$1" -v n="$2" 'BEGIN { printf "%.3f", b / n / 1024 }'; fi
}

# run_memory TARGET: a fresh instance of TARGET, filled with MEM_KEYS keys, into memory.tsv;
# stopped afterwards.
run_memory() {
    local t=$1 name=mem-$1 pid url pss0 pss1 e0 e1 stored t0 secs received non200 disk=- alloc=-
    case $t in
    nginx)
        start_nginx_cache "$name" "$MEM_NGINX_PORT" "nginx proxy_cache (memory)" "$OUT/d/nginx.conf" \
            WORKERS=2 TTL=600s KEYS_ZONE="$MEM_KEYS_ZONE" MAX_SIZE="$MEM_NGINX_MAX_SIZE"
        ;;
    varnish)
        VARNISH_MALLOC=$MEM_VARNISH_MALLOC start_varnish_cache "$name" "$MEM_VARNISH_PORT" \
            "varnishd (memory)" "$OUT/d/varnish.vcl" TTL=600s GRACE=10s
        ;;
    cg-l1)
        start_cg "$name" "$MEM_CG_PORT" "$MEM_CG_ADMIN" embedded cache.l1=all \
            cache.l1_max_bytes="$MEM_L1_MAX_BYTES"
        ;;
    esac
    pid=${PID_OF[$name]}
    url=${URL_OF[$name]}
    # one entry outside the fill (id 0), so pools and buffers exist before the first reading
    curl -s -o /dev/null "$url/items/0"
    sleep 1
    # shellcheck disable=SC2046 # one PID per line
    pss0=$(pss_kb $(proc_tree "$pid"))
    e0=$(mem_entries "$t")
    log "d. $t: $MEM_KEYS distinct keys, at most $MEM_MAX_DURATION (Pss before: $(mib "$pss0"))"
    t0=$SECONDS
    wrk_distinct "$OUT/d/wrk-$t.txt" "$url" "$MEM_KEYS" "$MEM_MAX_DURATION" "$BENCH_TMP/distinct-done-$t"
    secs=$((SECONDS - t0))
    sleep 3 # writes and cache maintenance still under way
    # shellcheck disable=SC2046
    pss1=$(pss_kb $(proc_tree "$pid"))
    e1=$(mem_entries "$t")
    stored=$((e1 - e0))
    if [[ $t == nginx ]]; then
        # apparent size (du -sb) and the blocks allocated (du -s -B1), directories included
        disk=$(du -sb "$BENCH_TMP/nginx-$name/cache" | awk '{ print $1 }')
        alloc=$(du -s -B1 "$BENCH_TMP/nginx-$name/cache" | awk '{ print $1 }')
    fi
    received=$(distinct_field "$OUT/d/wrk-$t.txt" received)
    non200=$(distinct_field "$OUT/d/wrk-$t.txt" non200)
    local problems=()
    [[ -n $received ]] || die "d. $t: no 'distinct:' line in $OUT/d/wrk-$t.txt"
    ((received >= MEM_KEYS)) || problems+=("only $received of $MEM_KEYS requests answered within $MEM_MAX_DURATION")
    ((non200 == 0)) || problems+=("$non200 non-200 answers")
    ((stored * 100 >= MEM_KEYS * 98)) || problems+=("$stored entries stored for $MEM_KEYS keys")
    ((stored > 0)) || die "d. $t stored no entry"
    note_problems PROBLEMS "d. $t" " (see $OUT/d/wrk-$t.txt)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$MEM_KEYS" "$received" "$e1" "$stored" \
        "$pss0" "$pss1" "$(per_entry_kib $(((pss1 - pss0) * 1024)) "$stored")" "$disk" "$(per_entry_kib "$disk" "$e1")" \
        "$(per_entry_kib "$alloc" "$e1")" "$secs" >>"$OUT/memory.tsv"
    log "d. $t: $stored entries in $secs s, Pss $(mib "$pss0") -> $(mib "$pss1")"
    stop_pid "$pid"
}

if has d; then
    printf 'target\tkeys\tanswered\tentries\tfilled\tpss_before_kb\tpss_after_kb\tkib_per_entry\tdisk_bytes\tdisk_kib_per_entry\talloc_kib_per_entry\tfill_s\n' \
        >"$OUT/memory.tsv"
    for t in cg-l1 nginx varnish; do run_memory "$t"; done
fi
if has a || has b || has c || has d; then stop_pid "${PID_OF[static]}"; fi

# --- e. stampede (bench/stampede.sh) --------------------------------------------------------

STAMPEDE_DIR=$OUT/e/stampede
if has e; then
    log "e. bash bench/stampede.sh (CONCURRENCIES=$STAMPEDE_C TARGETS=\"direct nginx2 varnish2 cg2\" REPS=$REPS; log in $OUT/e/stampede.log)"
    rc=0
    run_bg "$OUT/e/stampede.log" env CONCURRENCIES="$STAMPEDE_C" TARGETS="direct nginx2 varnish2 cg2" REPS="$REPS" \
        DELAY_MS="$STAMPEDE_DELAY_MS" CACHEGUARD_BIN="$CG_BIN" BASE_PORT="$STAMPEDE_BASE_PORT" \
        RESULTS_DIR="$STAMPEDE_DIR" TOOLS_TARGET="$TOOLS_TARGET" bash bench/stampede.sh || rc=$?
    if ((rc != 0)) || [[ ! -f $STAMPEDE_DIR/raw.tsv ]]; then
        note_problems PROBLEMS "e. bench/stampede.sh" " (see $OUT/e/stampede.log)" "exited with $rc"
    else
        cp "$STAMPEDE_DIR/raw.tsv" "$OUT/stampede.tsv"
        while IFS=$'\t' read -r c t rep ready ok non2xx errors setup_f; do
            problems=()
            ((ready == c)) || problems+=("$ready of $c connections ready")
            ((ok == c && non2xx == 0 && errors == 0 && setup_f == 0)) ||
                problems+=("$ok ok, $non2xx non-2xx, $errors errors, $setup_f setup failures")
            note_problems PROBLEMS "e. $t rep $rep" "" "${problems[@]}"
        done < <(awk -F'\t' -v OFS='\t' 'NR > 1 { print $1, $2, $3, $8, $10, $11, $12, $13 }' "$OUT/stampede.tsv")
    fi
fi

end_env

# --- summary -----------------------------------------------------------------------------

# values FILE COLUMN TARGET [NAME=VALUE...]: tsv_col of one target's rows.
values() { tsv_col "$1" "$2" target="$3" "${@:4}"; }
# med FILE COLUMN TARGET [NAME=VALUE...]: their median ("" without any).
med() {
    local v
    mapfile -t v < <(values "$@")
    ((${#v[@]} == 0)) || median "${v[@]}"
}
# vals_cell KIND V...: "median (min–max)" of V... (KIND int, or a number of decimals); "–"
# without any.
vals_cell() {
    local kind=$1
    shift
    if (($# == 0)); then
        printf '–'
    elif [[ $kind == int ]]; then
        cell int "$@"
    else
        cell_dec "$kind" "$@"
    fi
}
# vcell KIND FILE COLUMN TARGET: vals_cell of one target's values.
vcell() {
    local v
    mapfile -t v < <(values "${@:2}")
    vals_cell "$1" "${v[@]}"
}
# q A B: A / B with 4 decimals; "" unless both are positive.
q() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.4f", a / b }'; }
# r2 X [SUFFIX]: X with 2 decimals and SUFFIX; "–" when X is empty.
r2() { if [[ -n $1 ]]; then LC_ALL=C printf '%.2f%s' "$1" "${2:-}"; else printf '–'; fi; }
# judge VALUE OP LIMIT: the verdict of VALUE OP LIMIT (<= or >=); "not measured" without VALUE.
judge() {
    if [[ -z $1 ]]; then
        echo "not measured"
        return
    fi
    verdict "$(awk -v v="$1" -v l="$3" -v op="$2" 'BEGIN { print ((op == "<=") ? (v <= l) : (v >= l)) ? 1 : 0 }')"
}
# row LABEL CELL...: one markdown table row.
row() {
    local out="| $1 |" c
    shift
    for c in "$@"; do out+=" $c |"; done
    echo "$out"
}
# ratio_row FILE COLUMN WHICH: "↳ ratio to nginx proxy_cache" cells of the medians, for the
# targets in WHICH (the other cells empty).
ratio_row() {
    local file=$1 col=$2 which=$3 t base cells=()
    base=$(med "$file" "$col" nginx)
    for t in $MAIN_TARGETS; do
        if [[ " $which " == *" $t "* ]]; then cells+=("$(r2 "$(q "$(med "$file" "$col" "$t")" "$base")")"); else cells+=(""); fi
    done
    row "↳ ratio to nginx proxy_cache" "${cells[@]}"
}

# section c: per request, net of the idle window (SOURCE client, lua or commandstats)
# c_total MODE PHASE SOURCE: (batch − idle) commands / requests.
c_total() {
    [[ -f $OUT/redis-batches.tsv ]] || return 0
    local n
    n=$(tsv_col "$OUT/redis-batches.tsv" requests mode="$1" phase="$2")
    [[ -n $n ]] || return 0
    awk -F'\t' -v m="$1" -v p="$2" -v s="$3" -v n="$n" '
        NR > 1 && $1 == m && $2 == p && $4 == s { t += ($3 == "batch") ? $6 : -$6 }
        END { printf "%.3f", t / n }' "$OUT/redis.tsv"
}
# c_breakdown MODE PHASE SOURCE: "cmd x.xx, cmd y.yy" per request, net of the idle window (the
# commands that round to 0.00 left out).
c_breakdown() {
    local n
    n=$(tsv_col "$OUT/redis-batches.tsv" requests mode="$1" phase="$2")
    awk -F'\t' -v m="$1" -v p="$2" -v s="$3" -v n="$n" '
        NR > 1 && $1 == m && $2 == p && $4 == s { t[$5] += ($3 == "batch") ? $6 : -$6 }
        END { for (c in t) if (t[c] / n >= 0.005 || t[c] / n <= -0.005) printf "%s %.2f\n", c, t[c] / n }' "$OUT/redis.tsv" |
        sort -k2,2gr -k1,1 | awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2 }'
}
# c_cpu MODE PHASE: redis-server's CPU µs per request (batch − idle, without MONITOR).
c_cpu() {
    [[ -f $OUT/redis-cpu.tsv ]] || return 0
    awk -F'\t' -v m="$1" -v p="$2" 'NR > 1 && $1 == m && $2 == p && $3 > 0 {
            printf "%.1f", ($5 - $6) * 1e6 / $3 }' "$OUT/redis-cpu.tsv"
}
# c_metric MODE PHASE: cacheguard_request_redis_commands_total / cacheguard_requests_total over
# the batch.
c_metric() {
    local c n
    c=$(tsv_col "$OUT/redis-batches.tsv" metric_redis_commands mode="$1" phase="$2")
    n=$(tsv_col "$OUT/redis-batches.tsv" metric_requests mode="$1" phase="$2")
    [[ -n $c ]] || return 0
    awk -v c="$c" -v n="$n" 'BEGIN { if (n > 0) printf "%.3f", c / n }'
}

# section e (stampede.tsv: c, target, rep, ..., origin_cold, p99_ms)
e_values() { values "$OUT/stampede.tsv" "$1" "$2" c="$STAMPEDE_C"; }
# e_cell COLUMN TARGET DECIMALS: vals_cell of one stampede.tsv column.
e_cell() {
    local v
    mapfile -t v < <(e_values "$1" "$2")
    vals_cell "$3" "${v[@]}"
}
# e_ratio_cell TARGET: vals_cell of the runs' p99 / origin delay.
e_ratio_cell() {
    local v
    mapfile -t v < <(e_values p99_ms "$1" | awk -v d="$STAMPEDE_DELAY_MS" '{ printf "%.4f\n", $1 / d }')
    vals_cell 2 "${v[@]}"
}
declare -A E_OF=([static]=direct [nginx]=nginx2 [varnish]=varnish2 [cg-l2]=cg2)

# the targets' figures
RPS_NGINX=$(med "$OUT/throughput.tsv" rps nginx)
CPU_NGINX=$(med "$OUT/cpu.tsv" total_us_per_req nginx)
R_L1_RPS=$(q "$(med "$OUT/throughput.tsv" rps cg-l1)" "$RPS_NGINX")
R_L2_RPS=$(q "$(med "$OUT/throughput.tsv" rps cg-l2)" "$RPS_NGINX")
R_L1_CPU=$(q "$(med "$OUT/cpu.tsv" total_us_per_req cg-l1)" "$CPU_NGINX")
R_L2_CPU=$(q "$(med "$OUT/cpu.tsv" total_us_per_req cg-l2)" "$CPU_NGINX")
MISS_CMDS=""
for mode in $L1_MODES; do
    miss=$(c_total "$mode" miss client)
    [[ -z $miss ]] || MISS_CMDS=$(awk -v a="$miss" -v b="${MISS_CMDS:-0}" 'BEGIN { print (a > b) ? a : b }')
done
MEM_CG=$(med "$OUT/memory.tsv" kib_per_entry cg-l1)
P99_CG2=$(q "$(med "$OUT/stampede.tsv" p99_ms cg2 c="$STAMPEDE_C")" "$STAMPEDE_DELAY_MS")

{
    echo "# cacheguard fleet cost: $STAMP"
    echo
    echo "cacheguard next to nginx proxy_cache and Varnish on one 1 KiB JSON key (origin: nginx \`return 200\`, the"
    echo "\"static nginx\" column). Cells are **median (min–max)** over $REPS reps, targets rotating within each rep (section d:"
    echo "one run). cacheguard L1 = embedded, \`l1 = \"all\"\`, L1 hits; cacheguard L2 = shared mode with one redis-server,"
    echo "\`l1 = \"off\"\`, L2 hits. Everything runs on 127.0.0.1 on the same $(nproc) cores: load generator, targets, origin, Redis."
    echo
    row measure "static nginx" "nginx proxy_cache" Varnish "cacheguard L1" "cacheguard L2"
    echo "|---|---|---|---|---|---|"
    cells=()
    for t in $MAIN_TARGETS; do cells+=("$(vcell int "$OUT/throughput.tsv" rps "$t")"); done
    row "a. hit req/s (\`wrk -t2 -c64 -d$DURATION\`)" "${cells[@]}"
    ratio_row "$OUT/throughput.tsv" rps "$TARGETS"
    cells=()
    for t in $MAIN_TARGETS; do cells+=("$(vcell 3 "$OUT/throughput.tsv" p99_ms "$t")"); done
    row "a. hit p99 ms under that load" "${cells[@]}"
    cells=()
    for t in $MAIN_TARGETS; do cells+=("$(vcell 2 "$OUT/cpu.tsv" cpu_us_per_req "$t")"); done
    row "b. CPU µs per hit at $(fmt_int "$RATE") req/s, the target's processes" "${cells[@]}"
    row "b. redis-server CPU µs per hit" "" "" "" "" "$(vcell 2 "$OUT/cpu.tsv" redis_us_per_req cg-l2)"
    cells=()
    for t in $MAIN_TARGETS; do cells+=("$(vcell 2 "$OUT/cpu.tsv" total_us_per_req "$t")"); done
    row "**b. CPU µs per hit, all processes** (cacheguard L2: + redis-server)" "${cells[@]}"
    ratio_row "$OUT/cpu.tsv" total_us_per_req "$TARGETS"
    for mode in $L1_MODES; do
        row "c. Redis commands per cold miss, \`l1 = \"$mode\"\` (sent by cacheguard; its metric; executed by Redis; Redis CPU µs)" "n/a" "n/a" "n/a" "0 (no Redis)" \
            "$(r2 "$(c_total "$mode" miss client)") ($(r2 "$(c_metric "$mode" miss)")); $(r2 "$(c_total "$mode" miss commandstats)"); $(c_cpu "$mode" miss) µs"
    done
    row "c. Redis commands per L2 hit, \`l1 = \"off\"\` (sent by cacheguard; its metric; executed by Redis; Redis CPU µs)" "n/a" "n/a" "n/a" "0 (no Redis)" \
        "$(r2 "$(c_total off hit client)") ($(r2 "$(c_metric off hit)")); $(r2 "$(c_total off hit commandstats)"); $(c_cpu off hit) µs"
    cells=("")
    for t in nginx varnish cg-l1; do cells+=("$(vcell 3 "$OUT/memory.tsv" kib_per_entry "$t")"); done
    row "d. KiB of memory (Pss) per cached 1 KiB entry, $(fmt_int "$MEM_KEYS") keys" "${cells[@]}" ""
    ratio_row "$OUT/memory.tsv" kib_per_entry "nginx varnish cg-l1"
    row "d. nginx: KiB of disk per entry (du -sb)" "" "$(vcell 3 "$OUT/memory.tsv" disk_kib_per_entry nginx)" "" "" ""
    cells=()
    for t in static nginx varnish cg-l1 cg-l2; do
        if [[ -n ${E_OF[$t]:-} ]]; then cells+=("$(e_cell origin_cold "${E_OF[$t]}" 0)"); else cells+=(""); fi
    done
    row "e. stampede, 2 instances, C = $(fmt_int "$STAMPEDE_C"): origin requests" "${cells[@]}"
    cells=()
    for t in static nginx varnish cg-l1 cg-l2; do
        if [[ -n ${E_OF[$t]:-} ]]; then cells+=("$(e_cell p99_ms "${E_OF[$t]}" 1)"); else cells+=(""); fi
    done
    row "e. waiter p99 ms (origin delay $STAMPEDE_DELAY_MS ms)" "${cells[@]}"
    cells=()
    for t in static nginx varnish cg-l1 cg-l2; do
        if [[ -n ${E_OF[$t]:-} ]]; then cells+=("$(e_ratio_cell "${E_OF[$t]}")"); else cells+=(""); fi
    done
    row "e. waiter p99 / origin delay" "${cells[@]}"
    echo
    echo "- ↳ rows: the target's median over nginx proxy_cache's median. Section e's cacheguard is two shared-mode"
    echo "  instances on one Redis (bench/stampede.sh \`cg2\`), shown in the L2 column; in the static column, the"
    echo "  origin answering the same C requests itself, with no proxy (\`direct\`): the floor of this machine."
    echo "- c: commands per request net of an idle window as long as the batch; \"its metric\" ="
    echo "  \`cacheguard_request_redis_commands_total\` / \`cacheguard_requests_total\` over the batch. Details below."
    echo
    echo "## Targets"
    echo
    echo "| target | measured | verdict |"
    echo "|---|---|---|"
    echo "| L2-hit CPU (cacheguard + redis-server) ≤ 1.2× nginx proxy_cache's | $(r2 "$R_L2_CPU" ×) | $(judge "$R_L2_CPU" "<=" 1.2) |"
    echo "| L1-hit CPU ≤ 0.65× nginx proxy_cache's | $(r2 "$R_L1_CPU" ×) | $(judge "$R_L1_CPU" "<=" 0.65) |"
    echo "| L1 hit req/s ≥ 1.4× nginx proxy_cache's | $(r2 "$R_L1_RPS" ×) | $(judge "$R_L1_RPS" ">=" 1.4) |"
    echo "| L2 hit req/s ≥ 1.0× nginx proxy_cache's | $(r2 "$R_L2_RPS" ×) | $(judge "$R_L2_RPS" ">=" 1.0) |"
    echo "| Redis commands per cold miss ≤ 4 (the larger of \`l1 = \"off\"\` and \`\"hot\"\`) | $(r2 "$MISS_CMDS") | $(judge "$MISS_CMDS" "<=" 4) |"
    echo "| memory per cached 1 KiB entry ≤ 1.25 KiB (cacheguard L1) | $(r2 "$MEM_CG" " KiB") | $(judge "$MEM_CG" "<=" 1.25) |"
    echo "| waiter p99 ≤ 1.10× the origin delay (cacheguard, 2 instances, C = $(fmt_int "$STAMPEDE_C")) | $(r2 "$P99_CG2" ×) | $(judge "$P99_CG2" "<=" 1.10) |"
    echo
    env_summary
    echo
    problem_items "- Every run was clean: no errors or non-2xx, every answer a hit where one was expected, the fixed rate reached, every key stored." \
        "" "${PROBLEMS[@]}"

    if has a; then
        echo
        echo "## a. Hit throughput"
        echo
        echo "\`wrk -t2 -c64 -d$DURATION --timeout 10s --latency\` on $KEY, warmed first. origin requests = requests that"
        echo "reached the origin during the run (its stub_status counter): 0 means every answer was a hit."
        echo
        echo "| target | req/s | p50 ms | p99 ms | max ms | origin requests per rep | X-Cache after |"
        echo "|---|---|---|---|---|---|---|"
        for t in $TARGETS; do
            echo "| $t | $(vcell int "$OUT/throughput.tsv" rps "$t") | $(vcell 3 "$OUT/throughput.tsv" p50_ms "$t") | $(vcell 3 "$OUT/throughput.tsv" p99_ms "$t") | $(vcell 3 "$OUT/throughput.tsv" max_ms "$t") | $(values "$OUT/throughput.tsv" origin_requests "$t" | paste -sd/) | $(values "$OUT/throughput.tsv" x_cache_after "$t" | sort -u | paste -sd,) |"
        done
    fi
    if has b; then
        echo
        echo "## b. CPU per hit at $(fmt_int "$RATE") req/s"
        echo
        echo "\`loadgen rate --rate $RATE --connections $RATE_CONNECTIONS --duration-s $RATE_DURATION_S\` after a ${RATE_WARMUP_S} s warm-up run."
        echo "CPU = utime + stime of /proc/PID/stat (clock ticks of 1/$TCK s) of every process of the target, read just"
        echo "before and after the measured run, divided by the answers. Processes: static and nginx = master + workers"
        echo "(and the cache manager / loader), Varnish = manager + cache child, cacheguard = one process (every thread)."
        echo
        echo "| target | processes | achieved req/s | CPU µs/req | redis-server µs/req | total µs/req |"
        echo "|---|---|---|---|---|---|"
        for t in $TARGETS; do
            echo "| $t | $(values "$OUT/cpu.tsv" processes "$t" | sort -u | paste -sd/) | $(vcell int "$OUT/cpu.tsv" achieved_rps "$t") | $(vcell 2 "$OUT/cpu.tsv" cpu_us_per_req "$t") | $([[ $t == *-l2 ]] && vcell 2 "$OUT/cpu.tsv" redis_us_per_req "$t" || printf '–') | $(vcell 2 "$OUT/cpu.tsv" total_us_per_req "$t") |"
        done
    fi
    if has c; then
        echo
        echo "## c. Redis commands per request (cacheguard shared mode)"
        echo
        echo "$REDIS_N requests per batch (\`loadgen list\`, $LIST_CONNECTIONS connections): never-seen ids (miss), then the same"
        echo "ids again (hit). Each batch and an idle window as long as it: \`CONFIG RESETSTAT\`, MONITOR, the batch,"
        echo "${SETTLE_S} s, \`INFO commandstats\`. Per request, net of the idle window:"
        echo "**sent** = the commands cacheguard sent (MONITOR, without the calls made inside Lua scripts);"
        echo "**commandstats** = INFO commandstats calls, which count the calls made inside scripts as well;"
        echo "**metric** = cacheguard's \`cacheguard_request_redis_commands_total\` / \`cacheguard_requests_total\` over the batch;"
        echo "**Redis CPU** = redis-server's used_cpu_sys + used_cpu_user (\`INFO cpu\`) per request, from a second batch of"
        echo "$REDIS_N other ids (and the same again for hits) run without MONITOR, net of an idle window as long."
        echo
        echo "| l1 | batch | X-Cache | window s | sent | sent, per command | commandstats | commandstats, per command | metric | Redis CPU µs | idle window: sent |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|"
        for mode in $L1_MODES; do
            for phase in miss hit; do
                idle=$(awk -F'\t' -v m="$mode" -v p="$phase" 'NR > 1 && $1 == m && $2 == p && $3 == "idle" && $4 == "client" { printf "%s%s %s", (n++ ? ", " : ""), $5, $6 }' "$OUT/redis.tsv")
                echo "| $mode | $phase | $(tsv_col "$OUT/redis-batches.tsv" x_cache mode="$mode" phase="$phase") | $(tsv_col "$OUT/redis-batches.tsv" window_s mode="$mode" phase="$phase") | **$(r2 "$(c_total "$mode" "$phase" client)")** | $(c_breakdown "$mode" "$phase" client) | $(r2 "$(c_total "$mode" "$phase" commandstats)") | $(c_breakdown "$mode" "$phase" commandstats) | $(r2 "$(c_metric "$mode" "$phase")") | $(c_cpu "$mode" "$phase") | ${idle:-none} |"
            done
        done
    fi
    if has d; then
        echo
        echo "## d. Memory per cached entry, $(fmt_int "$MEM_KEYS") keys"
        echo
        echo "A fresh instance per target, filled by \`wrk -t2 -c64 -s bench/distinct.lua\` (every request a new key)."
        echo "Memory = Pss after − Pss before (summed over the target's processes, /proc/PID/smaps_rollup) / entries stored."
        echo "One entry is $BODY_BYTES body bytes + ${HEAD_BYTES:-?} bytes of origin response head = ${ENTRY_BYTES:-?} bytes."
        echo "nginx keeps its entries in files (page cache, not in its Pss): its disk use is the next column."
        echo
        echo "| target | entries after the fill | of them filled | Pss before | Pss after | KiB per entry | × (body + head) | disk KiB per entry: du -sb / allocated | fill s |"
        echo "|---|---|---|---|---|---|---|---|---|"
        for t in cg-l1 nginx varnish; do
            [[ -n $(values "$OUT/memory.tsv" entries "$t") ]] || continue
            k=$(values "$OUT/memory.tsv" kib_per_entry "$t")
            echo "| $t | $(fmt_int "$(values "$OUT/memory.tsv" entries "$t")") | $(fmt_int "$(values "$OUT/memory.tsv" filled "$t")") | $(mib "$(values "$OUT/memory.tsv" pss_before_kb "$t")") | $(mib "$(values "$OUT/memory.tsv" pss_after_kb "$t")") | $k | $(r2 "$(q "$k" "$(awk -v b="${ENTRY_BYTES:-0}" 'BEGIN { print b / 1024 }')")") | $(values "$OUT/memory.tsv" disk_kib_per_entry "$t") / $(values "$OUT/memory.tsv" alloc_kib_per_entry "$t") | $(values "$OUT/memory.tsv" fill_s "$t") |"
        done
        echo
        echo "- Each target answered one request (id 0) before the first reading, so its buffers and pools exist; \"of them"
        echo "  filled\" = the entries the fill added, the divisor. The wrk threads stop at their quota, so a few requests more"
        echo "  than $(fmt_int "$MEM_KEYS") may be stored."
        echo "- du -sb counts apparent sizes, the cache's 1:2-level directories included; allocated = du -s -B1 (whole blocks)." 
    fi
    if has e; then
        echo
        echo "## e. Stampede (bench/stampede.sh)"
        echo
        echo "C = $STAMPEDE_C GETs of one cold key released at once over two instances of each target, origin delay"
        echo "$STAMPEDE_DELAY_MS ms, $REPS reps (a fresh key per run). Its own summary: \`${STAMPEDE_DIR#"$ROOT"/}/summary.md\`."
        echo
        echo "| target | origin requests | waiter p99 ms | p99 / origin delay | X-Cache (all reps) |"
        echo "|---|---|---|---|---|"
        for t in nginx2 varnish2 cg2; do
            echo "| $t | $(e_cell origin_cold "$t" 0) | $(e_cell p99_ms "$t" 1) | $(e_ratio_cell "$t") | $(e_values x_cache "$t" | merge_counts) |"
        done
    fi
    echo
    echo "Raw data: \`${OUT#"$ROOT"/}/\` (throughput.tsv, cpu.tsv, redis.tsv, redis-batches.tsv, memory.tsv, stampede.tsv; wrk, loadgen, MONITOR, INFO and /metrics outputs under a/ .. e/; configs and logs)."
} >"$OUT/summary.md"

show_summary
