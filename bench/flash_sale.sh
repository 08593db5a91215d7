#!/usr/bin/env bash
# Flash sale: what a stock gate (README "Flash sales: a stock gate") costs and keeps away
# from the origin, in one run on this machine:
#
#   origin   bench/tools `bench-origin --shop`: a shop that keeps stock per resource with a
#            conditional decrement (201 while a unit is left, 409 after), its count at
#            /internal/stock/{t}/{s} (the gate's source), per-resource counters at
#            /shop/stats; /items/{id} for the L1 hits (1024 bytes, no delay)
#   cacheguard  release build, shared mode against a redis-server started here; a read
#            route /items/{id} with `cache.l1 = "all"` and the buy route
#            POST /trains/{train}/seats/{type}/orders bound to a [[stock]] gate "seats"
#
#   a. throughput of one instance  `wrk -t$THREADS -c$CONNECTIONS -d$DURATION --latency`,
#            REPS reps, the three targets rotating within each rep, on the same instance:
#              l1       GET /items/1, an L1 hit
#              soldout  POST (bench/post.lua: an 11-byte JSON body) to a resource that sold
#                       out through this instance before the run: the gate's answer from memory
#              buy      the same POST to a resource with BUY_STOCK units (it lasts the run),
#                       the origin answering 201 at once: one buy each
#            Around each run: `CONFIG RESETSTAT` and `INFO commandstats` of redis-server (which
#            counts every command, those run inside scripts too), cacheguard's /metrics, the
#            shop's counters, and the CPU (utime + stime, /proc/PID/stat) of cacheguard and of
#            redis-server, read TAIL_S after wrk ended (the buys in flight settle). Per answer
#            cacheguard counted (its metrics; wrk leaves a few unread): commandstats calls (all of them: background commands
#            included), EVALSHA/EVAL calls (scripts), and the buy and settle scripts told apart
#            by the calls only each makes inside Redis (BUY: ZRANGEBYSCORE; SETTLE of a sale or
#            SETTLE_SALES of a batch: ZREMRANGEBYSCORE; a reconcile's APPLY makes one and two
#            of those, subtracted).
#   b. what one buy sends  redis-cli MONITOR during BUY_SAMPLE buys (`loadgen buyers`, one
#            client, no pause) on the buy resource and as many on the sold-out one: every
#            top-level command, each script by its key count and arguments (BUY 3 keys, SETTLE 4
#            keys, SETTLE_SALES 3 keys and 2 + 2 per sale args: src/protect/stock/shared.rs)
#            with the calls it made inside Redis.
#   c. the sold-out mark across a fleet  three instances A, B, C on one Redis (reconcile
#            5s), `loadgen soldout-probe`, MARK_REPS reps: per rep a fresh resource with 2
#            units at the shop, one bought through A, then the last one bought through A
#            while B and C are probed in a tight loop (MARK_GAP_US apart) with buy heads that
#            carry `Expect: 100-continue` and no body. A marked instance answers 409 SOLDOUT
#            before it reads a body; an unmarked one starts reading it (hyper answers 100
#            Continue) and the prober closes the connection: a probe never reaches Redis,
#            takes no unit and marks nothing, so a SOLDOUT can only come from the bus. A
#            subscriber on the bus's channel stamps the `stock soldout` message. All times are
#            on one clock, from the moment the last buy was sent to A.
#   d. flood factor  three instances on their own Redis, the shop taking
#            FLOOD_SHOP_DELAY_MS per buy (a database transaction), the tests' gate settings
#            (reconcile 500ms, reservation_ttl 3s, upstream.timeout 1s); `loadgen buyers`:
#            FLOOD_CLIENTS clients paced FLOOD_PACE_MS, round-robin over the instances and four
#            fresh resources with FLOOD_STOCK units, with Idempotency-Keys, for
#            FLOOD_DURATION_S (tests/it/flash_sale.rs runs 5 s + a tail over 600 units). Two
#            nemeses, FLOOD_REPS runs each, alternating: `none`, and `redis-kill` (kill -9 of
#            redis-server KILL_AT_S into the run, restarted empty KILL_DOWN_S later). Flood
#            factor = buy requests the shop received ÷ units it sold. Also checked: oversell
#            (sold > stock), phantom (client 2xx > units sold), undersell (a resource with
#            units left at the end that turned a buyer away after the last heal + 2 reconcile
#            intervals).
#
# usage: bash bench/flash_sale.sh
# env:   SECTIONS="a b c d" REPS=3 DURATION=10s THREADS=2 CONNECTIONS=64 (a)
#        BUY_STOCK=1000000000 (a, b) BUY_SAMPLE=1000 (b)
#        MARK_REPS=100 MARK_GAP_US=100 (c)
#        FLOOD_REPS=REPS FLOOD_DURATION_S=30 FLOOD_STOCK="250 500 1000 2000" FLOOD_CLIENTS=12
#        FLOOD_PACE_MS=15 FLOOD_SHOP_DELAY_MS=20 KILL_AT_S=8 KILL_DOWN_S=1 (d)
#        BASE_PORT=27180 (uses BASE_PORT+1 .. +20)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        TOOLS_TARGET=dir (cargo target dir of bench/tools; default bench/results/tools-target)
#        KEEP_TMP=1 (keep the scratch dir)
#
# The machine may be shared: `uptime` at the start and end of every section goes into
# load.tsv and beside every target in the summary, which says when the rates are not
# evidence of throughput (a 1-minute load average above 2).
#
# Writes bench/results/flash-sale-<UTC timestamp>/: throughput.tsv (a), monitor.tsv (b),
# mark.json (c), flood.tsv (d), load.tsv, the raw wrk / loadgen / MONITOR / INFO / /metrics / shop
# outputs under a/ .. d/, configs, logs, env.txt and summary.md, and prints the markdown
# summary on stdout. Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults SECTIONS="a b c d" REPS=3 DURATION=10s THREADS=2 CONNECTIONS=64 BUY_STOCK=1000000000 \
    BUY_SAMPLE=1000 MARK_REPS=100 MARK_GAP_US=100 FLOOD_DURATION_S=30 FLOOD_STOCK="250 500 1000 2000" \
    FLOOD_CLIENTS=12 FLOOD_PACE_MS=15 FLOOD_SHOP_DELAY_MS=20 KILL_AT_S=8 KILL_DOWN_S=1 BASE_PORT=27180
bench_defaults FLOOD_REPS="$REPS"
require_positive REPS THREADS CONNECTIONS BUY_STOCK BUY_SAMPLE MARK_REPS FLOOD_REPS FLOOD_DURATION_S \
    FLOOD_CLIENTS KILL_AT_S KILL_DOWN_S BASE_PORT
require_positive_list FLOOD_STOCK
[[ $MARK_GAP_US =~ ^[0-9]+$ && $FLOOD_PACE_MS =~ ^[0-9]+$ && $FLOOD_SHOP_DELAY_MS =~ ^[0-9]+$ ]] ||
    die "MARK_GAP_US, FLOOD_PACE_MS and FLOOD_SHOP_DELAY_MS must be non-negative integers"
# shellcheck disable=SC2153 # DURATION is set by bench_defaults
[[ $DURATION =~ ^[1-9][0-9]*s$ ]] || die "DURATION must be whole seconds, e.g. 10s (got '$DURATION')"
((KILL_AT_S + KILL_DOWN_S < FLOOD_DURATION_S)) || die "KILL_AT_S + KILL_DOWN_S must end before FLOOD_DURATION_S"
check_list SECTIONS section a b c d
((MARK_REPS >= 100)) || log "WARNING: MARK_REPS=$MARK_REPS: a p99 needs at least 100 reps"

TARGETS="l1 soldout buy forward"
ITEM=/items/1
SOLD_OUT=/trains/gone/seats/a # sold out through the instance before section a
BIG=/trains/big/seats/a       # BUY_STOCK units
FREE=/free/trains/big/seats/a # the same buy on a write route without a gate (BUY_STOCK units too)
FLOOD_KINDS="a b c d"         # the four resources of a flood run: seats a .. d of a fresh train
NEMESES="none redis-kill"
# the gate's reconcile interval in section d (the tests' value): the undersell window starts
# two of them after the last heal
FLOOD_RECONCILE_MS=500

bench_ports ORIGIN_PORT REDIS_PORT CG_PORT CG_ADMIN A_PORT A_ADMIN B_PORT B_ADMIN C_PORT C_ADMIN \
    FORIGIN_PORT FREDIS_PORT FA_PORT FA_ADMIN FB_PORT FB_ADMIN FC_PORT FC_ADMIN

has() { [[ " $SECTIONS " == *" $1 "* ]]; }

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools redis-server:redis-server redis-cli:redis-tools wrk:wrk curl:curl jq:jq
require_tools cargo awk sort getconf timeout
require_free_ports "${BENCH_PORTS[@]}"
require_fds_for_concurrency "$CONNECTIONS"

build_cacheguard
build_bench_tools

bench_results flash-sale- a b c d

TCK=$(getconf CLK_TCK)
PROBLEMS=() # runs that were not clean, for the summary

write_env redis wrk <<EOF
sections: $SECTIONS
reps: $REPS
throughput: wrk -t$THREADS -c$CONNECTIONS -d$DURATION --latency; targets $TARGETS rotating; buy stock $BUY_STOCK
buy_sample: $BUY_SAMPLE buys and as many sold-out answers under MONITOR
mark: $MARK_REPS reps, probes $MARK_GAP_US µs apart
flood: $FLOOD_REPS runs per nemesis ($NEMESES), ${FLOOD_DURATION_S}s, stock $FLOOD_STOCK, $FLOOD_CLIENTS clients paced ${FLOOD_PACE_MS}ms, shop ${FLOOD_SHOP_DELAY_MS}ms per buy, redis killed at ${KILL_AT_S}s for ${KILL_DOWN_S}s
EOF

# --- shared pieces ---------------------------------------------------------------------

# section_load SECTION start|end: `uptime` at a section's edge, into load.tsv and the log (the
# machine is shared: every figure is quoted beside the load it was taken under).
printf 'section\tedge\tload1\tuptime\n' >"$OUT/load.tsv"
section_load() {
    local up
    up=$(uptime)
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(cut -d' ' -f1 /proc/loadavg)" "${up#"${up%%[! ]*}"}" >>"$OUT/load.tsv"
    log "$1 $2: $up"
}

# stock_toml RECONCILE RESERVATION_TTL: the buy route and its gate, as README shows them.
stock_toml() {
    cat <<EOF

[[routes]]
name = "buy"
match = "/trains/{train}/seats/{type}/orders"
methods = ["POST"]
stock = { gate = "seats", units = 1 }

[[routes]]
name = "forward"
match = "/free/{*rest}"
methods = ["POST"]

[[stock]]
name = "seats"
key = "/trains/{train}/seats/{type}"
source = { path = "/internal/stock/{train}/{type}", json = "/remaining" }
reconcile = "$1"
reservation_ttl = "$2"
sold_out = { status = 409, body = '{"type":"sold-out"}', content_type = "application/problem+json" }
on_redis_error = "reject"
EOF
}

# start_cg NAME PORT ADMIN ORIGIN_PORT REDIS_PORT RECONCILE TTL [SECTION.KEY=VALUE...]: one
# shared-mode instance (cg_config: the item route, `l1 = "all"`, ttl 600s; the buy route and
# gate of stock_toml), waited for until its event bus is subscribed.
start_cg() {
    local name=$1 port=$2 admin=$3 origin=$4 redis=$5 reconcile=$6 ttl=$7
    shift 7
    {
        cg_config "$port" "$admin" "$origin" upstream.max_concurrency=1024 cache.ttl=600s cache.l1=all \
            redis.url="redis://127.0.0.1:$redis" journal.path="$BENCH_TMP/journal-$name" "$@"
        stock_toml "$reconcile" "$ttl"
    } >"$OUT/$name.toml"
    launch_cacheguard "$name" "$OUT/$name.toml" "$port" "$admin" "$OUT/$name.log"
    wait_bus "$name" "${ADMIN_OF[$name]}" "$OUT/$name-metrics-start.txt"
}

# shop_set ORIGIN_URL RESOURCE UNITS: the shop now has UNITS of RESOURCE (/trains/t/seats/s).
shop_set() {
    local rest=${2#/trains/}
    curl -sf -X PUT --max-time 5 --data "$3" "$1/shop/stock/${rest/\/seats\//\/}" >/dev/null ||
        die "cannot set the shop's stock of $2"
}

# shop_stats ORIGIN_URL FILE: the shop's counters into FILE.
shop_stats() { curl -sf --max-time 5 "$1/shop/stats" >"$2" || die "cannot read the shop's counters"; }

# shop_item FILE RESOURCE FIELD: one counter of one resource in a saved /shop/stats (0 when none).
shop_item() { jq --arg r "$2" --arg f "$3" '.items[$r][$f] // 0' "$1"; }

# buy URL: one POST of a buy; prints "status x-cache".
buy() {
    curl -s -o /dev/null -D - --max-time 5 -X POST -H 'content-type: application/json' --data '{}' "$1" |
        tr -d '\r' | awk 'NR == 1 { s = $2 } tolower($1) == "x-cache:" { x = $2 } END { print s, x }'
}

# cmdstat FILE NAME: the calls of one command in a saved INFO commandstats (0 when none).
cmdstat() { awk -F'[:,=]' -v c="cmdstat_$2" '$1 == c { n = $3 } END { print n + 0 }' "$1"; }

# cmdstat_total FILE: every call in a saved INFO commandstats but this script's own (CONFIG,
# INFO).
cmdstat_total() {
    awk -F'[:,=]' '/^cmdstat_/ && $1 !~ /^cmdstat_(config|info)/ { n += $3 } END { print n + 0 }' "$1"
}

# per X N [DECIMALS]: X / N ("" when N is 0).
per() { awk -v x="$1" -v n="$2" -v d="${3:-4}" 'BEGIN { if (n > 0) printf "%.*f", d, x / n }'; }

# --- a. throughput of one instance ---------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
REDIS_CLI=(redis-cli -h 127.0.0.1 -p "$REDIS_PORT")
if has a || has b || has c; then
    # every resource not set otherwise has BUY_STOCK units (the ungated route's buys too)
    start_origin "$OUT/origin.log" "bench-origin (shop)" "$ORIGIN_PORT" --delay-ms 0 --shop --shop-stock "$BUY_STOCK"
    PID_OF[origin]=$LAST_PID
    start_redis main "$REDIS_PORT"
    PID_OF[redis]=$LAST_PID
fi

declare -A URL=(
    [l1]="http://127.0.0.1:$CG_PORT$ITEM"
    [soldout]="http://127.0.0.1:$CG_PORT$SOLD_OUT/orders"
    [buy]="http://127.0.0.1:$CG_PORT$BIG/orders"
    [forward]="http://127.0.0.1:$CG_PORT$FREE/orders"
)
declare -A SCRIPT=([l1]="" [soldout]=bench/post.lua [buy]=bench/post.lua [forward]=bench/post.lua)

# metric_d BEFORE AFTER NAME{labels}: mdelta, for a sample whose labels this script spells.
metric_d() { mdelta "$1" "$2" "$3"; }

# run_target TARGET REP: one section-a wrk run with its Redis, CPU and counter readings,
# into throughput.tsv. Rates are wrk's; every cost per answer (CPU, Redis calls, scripts) is
# divided by the answers cacheguard counted (wrk does not count those it had not read when it
# stopped), read TAIL_S after wrk ended so that the buys still in flight are settled.
TAIL_S=0.5
run_target() {
    local t=$1 rep=$2 p="$OUT/a/$1-rep$2" args=() problems=() parsed
    local rps p50 p99 max reqs errs non2xx c0 c1 r0 r1 cg_us redis_us total evals zr zrr applies
    local buys settles outcome metric_cmds xc shop_buys=0 shop_sold=0 l1_hits=0
    [[ -z ${SCRIPT[$t]} ]] || args=(-s "${SCRIPT[$t]}")
    save_metrics "${ADMIN_OF[cg]}" "$p-metrics-before.txt"
    shop_stats "$ORIGIN" "$p-shop-before.json"
    log "a. rep $rep/$REPS: $t: wrk -t$THREADS -c$CONNECTIONS -d$DURATION ${args[*]} ${URL[$t]}"
    "${REDIS_CLI[@]}" config resetstat >/dev/null
    c0=$(cpu_ticks "${PID_OF[cg]}")
    r0=$(cpu_ticks "${PID_OF[redis]}")
    wrk_once "$p.wrk.txt" "$t" -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" --timeout 10s --latency \
        "${args[@]}" "${URL[$t]}"
    sleep "$TAIL_S"
    c1=$(cpu_ticks "${PID_OF[cg]}")
    r1=$(cpu_ticks "${PID_OF[redis]}")
    "${REDIS_CLI[@]}" info commandstats | tr -d '\r' >"$p.cmdstats"
    save_metrics "${ADMIN_OF[cg]}" "$p-metrics-after.txt"
    shop_stats "$ORIGIN" "$p-shop-after.json"
    if [[ $t == l1 ]]; then xc=$(x_cache "${URL[$t]}"); else read -r _ xc < <(buy "${URL[$t]}"); fi
    parsed=$(wrk_parse "$p.wrk.txt") || die "cannot parse wrk output $p.wrk.txt"
    read -r rps p50 p99 max reqs errs non2xx <<<"$parsed"
    ((errs == 0)) || problems+=("$errs socket errors")
    case $t in
    l1)
        # shared mode keeps an entry in L1 for hot_keys.l1_ttl (1 s), then reads it from L2
        # again: a few answers of each second are L2 hits
        l1_hits=$(metric_d "$p-metrics-before.txt" "$p-metrics-after.txt" \
            'cacheguard_requests_total{outcome="hit_l1",route="item"}')
        outcome=$((l1_hits + $(metric_d "$p-metrics-before.txt" "$p-metrics-after.txt" \
            'cacheguard_requests_total{outcome="hit_l2",route="item"}')))
        ((l1_hits * 100 >= outcome * 99)) || problems+=("only $l1_hits of $outcome answers were L1 hits")
        ((non2xx == 0)) || problems+=("$non2xx non-2xx")
        [[ $xc == HIT-L1 || $xc == HIT-L2 ]] || problems+=("X-Cache after the run was '$xc', not a hit")
        ;;
    soldout)
        outcome=$(metric_d "$p-metrics-before.txt" "$p-metrics-after.txt" \
            'cacheguard_stock_requests_total{gate="seats",outcome="sold_out_local"}')
        ((non2xx == reqs)) || problems+=("only $non2xx of $reqs answers were not 2xx")
        [[ $xc == SOLDOUT ]] || problems+=("X-Cache after the run was '$xc', not SOLDOUT")
        ;;
    buy)
        outcome=$(metric_d "$p-metrics-before.txt" "$p-metrics-after.txt" \
            'cacheguard_stock_requests_total{gate="seats",outcome="admitted"}')
        shop_buys=$(($(shop_item "$p-shop-after.json" "$BIG" buys) - $(shop_item "$p-shop-before.json" "$BIG" buys)))
        shop_sold=$(($(shop_item "$p-shop-after.json" "$BIG" sold) - $(shop_item "$p-shop-before.json" "$BIG" sold)))
        ((non2xx == 0)) || problems+=("$non2xx non-2xx")
        ((shop_sold == shop_buys)) || problems+=("the shop sold $shop_sold of $shop_buys buys")
        ;;
    forward)
        outcome=$(metric_d "$p-metrics-before.txt" "$p-metrics-after.txt" \
            'cacheguard_origin_requests_total{route="forward",status="2xx"}')
        ((non2xx == 0)) || problems+=("$non2xx non-2xx")
        ;;
    esac
    # the server counts the answers wrk had not read when it stopped too
    ((outcome >= reqs && outcome <= reqs + 2 * CONNECTIONS)) ||
        problems+=("cacheguard counted $outcome answers of this kind, wrk $reqs")
    ((outcome > 0)) || die "a. $t rep $rep: cacheguard counted no answer of this kind"
    cg_us=$(awk -v d=$((c1 - c0)) -v tck="$TCK" -v n="$outcome" 'BEGIN { printf "%.3f", d * 1e6 / tck / n }')
    redis_us=$(awk -v d=$((r1 - r0)) -v tck="$TCK" -v n="$outcome" 'BEGIN { printf "%.3f", d * 1e6 / tck / n }')
    total=$(cmdstat_total "$p.cmdstats")
    evals=$(($(cmdstat "$p.cmdstats" evalsha) + $(cmdstat "$p.cmdstats" eval)))
    zr=$(cmdstat "$p.cmdstats" zrangebyscore)
    zrr=$(cmdstat "$p.cmdstats" zremrangebyscore)
    # a reconcile's APPLY script makes one ZRANGEBYSCORE and two ZREMRANGEBYSCORE calls
    applies=$(($(metric_sum "$p-metrics-after.txt" cacheguard_stock_reconciles_total) -
        $(metric_sum "$p-metrics-before.txt" cacheguard_stock_reconciles_total)))
    buys=$((zr - applies))
    settles=$((zrr - 2 * applies))
    metric_cmds=$(($(metric_sum "$p-metrics-after.txt" cacheguard_request_redis_commands_total) -
        $(metric_sum "$p-metrics-before.txt" cacheguard_request_redis_commands_total)))
    note_problems PROBLEMS "a. $t rep $rep" " (see $p.wrk.txt)" "${problems[@]}"
    printf '%s\t' "$t" "$rep" "$rps" "$p50" "$p99" "$max" "$reqs" "$errs" "$non2xx" "$cg_us" "$redis_us" \
        "$total" "$(per "$total" "$outcome" 6)" "$(per "$evals" "$outcome")" "$(per "$buys" "$outcome")" \
        "$(per "$settles" "$outcome")" "$applies" "$(per "$metric_cmds" "$outcome" 6)" "$outcome" "$shop_buys" \
        "$shop_sold" "$evals" "$buys" "$settles" "$l1_hits" >>"$OUT/throughput.tsv"
    echo "${xc:--}" >>"$OUT/throughput.tsv"
    printf '  %-8s %12s req/s  p99 %7.3f ms  %8s µs/answer  Redis %s cmds/answer\n' "$t" "$rps" "$p99" \
        "$cg_us" "$(per "$total" "$outcome" 6)" >&2
}

if has a || has b; then
    start_cg cg "$CG_PORT" "$CG_ADMIN" "$ORIGIN_PORT" "$REDIS_PORT" 5s 30s
    log "preparing: $ITEM warmed, $SOLD_OUT sold out through the instance, $BIG with $BUY_STOCK units"
    warm "http://127.0.0.1:$CG_PORT$ITEM" HIT-L1
    shop_set "$ORIGIN" "$SOLD_OUT" 1
    shop_set "$ORIGIN" "$BIG" "$BUY_STOCK"
    read -r st _ < <(buy "${URL[soldout]}")
    [[ $st == 201 ]] || die "the one unit of $SOLD_OUT did not sell (status $st)"
    read -r st xc < <(buy "${URL[soldout]}")
    [[ $st == 409 && $xc == SOLDOUT ]] || die "$SOLD_OUT is not sold out here (status $st, X-Cache $xc)"
    read -r st _ < <(buy "${URL[buy]}")
    [[ $st == 201 ]] || die "a buy of $BIG did not sell (status $st)"
    read -r st _ < <(buy "${URL[forward]}")
    [[ $st == 201 ]] || die "a buy through the ungated route did not sell (status $st)"
fi

if has a; then
    printf 'target\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\tcg_us\tredis_us\tredis_calls\tredis_calls_per_answer\tscripts_per_answer\tbuy_scripts_per_answer\tsettle_scripts_per_answer\treconciles\tmetric_cmds_per_answer\tcounted\tshop_buys\tshop_sold\tscripts\tbuy_scripts\tsettle_scripts\tl1_hits\tx_cache_after\n' \
        >"$OUT/throughput.tsv"
    section_load a start
    each_rep "$TARGETS" run_target
    section_load a end
fi

# --- b. what one buy sends to Redis -----------------------------------------------------------

# monitor_sample NAME RESOURCE N: N buys of RESOURCE (one client, no pause) under MONITOR; the
# MONITOR output into b/NAME.monitor and the buyers' JSON into b/NAME.json.
monitor_sample() {
    local name=$1 resource=$2 n=$3 mon deadline
    start_bg "$OUT/b/$name.monitor" "${REDIS_CLI[@]}" monitor
    mon=$LAST_PID
    deadline=$((SECONDS + 5))
    until [[ -s $OUT/b/$name.monitor ]]; do
        ((SECONDS < deadline)) || die "redis-cli monitor did not start"
        sleep 0.05
    done
    run_bg "$OUT/b/$name.json" timeout 120 "$LOADGEN_BIN" buyers --url "http://127.0.0.1:$CG_PORT" \
        --resource "$resource" --clients 1 --pace-ms 0 --max-ops "$n" --duration-s 60 ||
        die "loadgen buyers failed for the $name sample"
    sleep 0.5
    stop_pid "$mon"
}

# monitor_rows NAME N: per kind of top-level command in b/NAME.monitor, "name kind calls
# per-answer inner-calls" lines (TSV): scripts by key count and arguments (BUY: 3 keys, a
# member second; SETTLE: 4 keys; SETTLE_SALES: 3 keys, a member third: a batch of sales;
# APPLY: 3 keys, numbers only), with the calls
# they made inside Redis (the `[0 lua]` lines after them: the first of each kind's).
monitor_rows() {
    awk -v name="$1" -v n="$2" '
        function flush() { if (cur != "" && !(cur in inner)) inner[cur] = sig }
        $2 ~ /^\[/ && $3 == "lua]" { c = $4; gsub(/"/, "", c); sig = sig (sig == "" ? "" : " ") c; next }
        $2 ~ /^\[/ {
            flush()
            c = toupper($4); gsub(/"/, "", c)
            if (c == "EVALSHA" || c == "EVAL") {
                k = $6; gsub(/"/, "", k)
                # BUY, SETTLE_SALES and APPLY all have 3 keys: the second argument of BUY is
                # a reservation member (<units>.<id>), the third of SETTLE_SALES is one, and
                # APPLY has numbers only.
                second = $(6 + k + 2); gsub(/"/, "", second)
                third = $(6 + k + 3); gsub(/"/, "", third)
                if (k == 3) {
                    kind = (second ~ /\./) ? "BUY script" : (third ~ /\./ ? "SETTLE_SALES script" : "APPLY script")
                } else {
                    kind = (k == 4) ? "SETTLE script" : "script, " k " keys"
                }
            } else {
                kind = c
            }
            cur = kind; count[kind]++; sig = ""
        }
        END {
            flush()
            for (k in count) printf "%s\t%s\t%d\t%.3f\t%s\n", name, k, count[k], count[k] / n, inner[k]
        }' "$OUT/b/$1.monitor" | sort
}

if has b; then
    log "b. $BUY_SAMPLE buys of $BIG and $BUY_SAMPLE POSTs to $SOLD_OUT under MONITOR"
    section_load b start
    monitor_sample buy "$BIG" "$BUY_SAMPLE"
    monitor_sample soldout "$SOLD_OUT" "$BUY_SAMPLE"
    section_load b end
    {
        printf 'sample\tcommand\tcalls\tper_answer\tinner_calls\n'
        for s in buy soldout; do
            ok=$(jq '.ops' "$OUT/b/$s.json")
            monitor_rows "$s" "$ok"
        done
    } >"$OUT/monitor.tsv"
    B_BUY_OK=$(jq '.status["201"] // 0' "$OUT/b/buy.json")
    B_SOLDOUT_N=$(jq '.x_cache.SOLDOUT // 0' "$OUT/b/soldout.json")
    ((B_BUY_OK == BUY_SAMPLE)) || note_problems PROBLEMS "b. buy sample" "" "only $B_BUY_OK of $BUY_SAMPLE buys answered 201"
    ((B_SOLDOUT_N == BUY_SAMPLE)) ||
        note_problems PROBLEMS "b. sold-out sample" "" "only $B_SOLDOUT_N of $BUY_SAMPLE answers were SOLDOUT"
fi
if has a || has b; then
    save_metrics "${ADMIN_OF[cg]}" "$OUT/metrics-cg-end.txt"
    stop_pid "${PID_OF[cg]}"
fi

# --- c. the sold-out mark across a fleet --------------------------------------------------

if has c; then
    "${REDIS_CLI[@]}" flushall >/dev/null
    start_cg mark-a "$A_PORT" "$A_ADMIN" "$ORIGIN_PORT" "$REDIS_PORT" 5s 30s
    start_cg mark-b "$B_PORT" "$B_ADMIN" "$ORIGIN_PORT" "$REDIS_PORT" 5s 30s
    start_cg mark-c "$C_PORT" "$C_ADMIN" "$ORIGIN_PORT" "$REDIS_PORT" 5s 30s
    instances_before "$OUT/c/c" mark-a mark-b mark-c
    log "c. $MARK_REPS reps: the last unit bought through A, B and C probed every $MARK_GAP_US µs"
    section_load c start
    run_bg "$OUT/mark.json" timeout 600 "$LOADGEN_BIN" soldout-probe --buy-url "http://127.0.0.1:$A_PORT" \
        --probe-url "http://127.0.0.1:$B_PORT" --probe-url "http://127.0.0.1:$C_PORT" --origin "$ORIGIN" \
        --redis "127.0.0.1:$REDIS_PORT" --channel cg:events --reps "$MARK_REPS" --gap-us "$MARK_GAP_US" \
        --max-duration-s 500 || die "loadgen soldout-probe failed; see $OUT/mark.json"
    section_load c end
    for name in mark-a mark-b mark-c; do
        save_metrics "${ADMIN_OF[$name]}" "$OUT/c/metrics-$name-after.txt"
    done
    problems=()
    done_reps=$(jq '.reps' "$OUT/mark.json")
    ((done_reps == MARK_REPS)) || problems+=("$done_reps of $MARK_REPS reps ran ($(jq -c '.failed_reps' "$OUT/mark.json"))")
    missed=$(jq '.reps_not_reached' "$OUT/mark.json")
    ((missed == 0)) || problems+=("$missed reps: the mark did not reach every instance within 1 s")
    bad=$(jq '[.records[] | select(.last_buy_status != 201)] | length' "$OUT/mark.json")
    ((bad == 0)) || problems+=("$bad reps: the last buy through A was not answered 201")
    # every SOLDOUT a probe got was the bus's: B and C never asked Redis about these resources
    for name in mark-b mark-c; do
        asked=$(mdelta "$OUT/c/c-metrics-$name-before.txt" "$OUT/c/metrics-$name-after.txt" \
            'cacheguard_stock_requests_total{gate="seats",outcome="sold_out_redis"}')
        admitted=$(mdelta "$OUT/c/c-metrics-$name-before.txt" "$OUT/c/metrics-$name-after.txt" \
            'cacheguard_stock_requests_total{gate="seats",outcome="admitted"}')
        ((asked == 0 && admitted == 0)) || problems+=("$name asked Redis: $asked sold out there, $admitted admitted")
    done
    note_problems PROBLEMS "c." " (see $OUT/mark.json)" "${problems[@]}"
    for name in mark-a mark-b mark-c; do stop_pid "${PID_OF[$name]}"; done
fi
if has a || has b || has c; then
    stop_pid "${PID_OF[redis]}"
    stop_pid "${PID_OF[origin]}"
fi

# --- d. flood factor -----------------------------------------------------------------------

FORIGIN=http://127.0.0.1:$FORIGIN_PORT
now_ms() { date +%s%3N; }

# flood_run NEMESIS REP: one run of `loadgen buyers` over the three instances and four fresh
# resources, with NEMESIS; its figures into flood.tsv.
flood_run() {
    local nemesis=$1 rep=$2 p="$OUT/d/$1-rep$2" train="f-$1-$2" res=() args=() i=0 k units pid
    local kill_ms=- heal_ms=- window_ms initial sold buys remaining client_ok undersold sold_after problems=()
    for k in $FLOOD_KINDS; do
        units=$(echo "$FLOOD_STOCK" | awk -v i=$((i + 1)) '{ print $i }')
        i=$((i + 1))
        res+=("/trains/$train/seats/$k")
        shop_set "$FORIGIN" "/trains/$train/seats/$k" "$units"
        args+=(--resource "/trains/$train/seats/$k")
    done
    log "d. $nemesis, run $rep/$FLOOD_REPS: $FLOOD_CLIENTS buyers for ${FLOOD_DURATION_S}s over ${res[*]}"
    start_bg "$p.json" timeout $((FLOOD_DURATION_S + 60)) "$LOADGEN_BIN" buyers \
        --url "http://127.0.0.1:$FA_PORT" --url "http://127.0.0.1:$FB_PORT" --url "http://127.0.0.1:$FC_PORT" \
        "${args[@]}" --clients "$FLOOD_CLIENTS" --pace-ms "$FLOOD_PACE_MS" --duration-s "$FLOOD_DURATION_S" \
        --idempotency-keys --key-tag "$train" --ops-out "$p.ops.tsv"
    pid=$LAST_PID
    if [[ $nemesis == redis-kill ]]; then
        sleep "$KILL_AT_S"
        kill_ms=$(now_ms)
        log "  kill -9 redis-server (PID ${PID_OF[fredis]})"
        kill -KILL "${PID_OF[fredis]}"
        reap "${PID_OF[fredis]}" || true
        sleep "$KILL_DOWN_S"
        start_redis flood "$FREDIS_PORT"
        PID_OF[fredis]=$LAST_PID
        heal_ms=$(now_ms)
        log "  redis-server restarted empty (PID ${PID_OF[fredis]})"
    fi
    reap "$pid" || die "loadgen buyers failed; see $p.json"
    # the buys still at the shop finish within its delay
    sleep 1
    shop_stats "$FORIGIN" "$p-shop.json"
    initial=0 sold=0 buys=0 remaining=0
    for r in "${res[@]}"; do
        initial=$((initial + $(shop_item "$p-shop.json" "$r" initial)))
        sold=$((sold + $(shop_item "$p-shop.json" "$r" sold)))
        buys=$((buys + $(shop_item "$p-shop.json" "$r" buys)))
        remaining=$((remaining + $(shop_item "$p-shop.json" "$r" remaining)))
    done
    client_ok=$(jq '.ok' "$p.json")
    # undersell: refusals, sent after the window opened, of a resource the shop still has
    # units of at the end
    if [[ $heal_ms == - ]]; then window_ms=$(jq '.start_unix_ms' "$p.json"); else window_ms=$((heal_ms + 2 * FLOOD_RECONCILE_MS)); fi
    undersold=$(awk -F'\t' -v w="$window_ms" -v left="$(for r in "${res[@]}"; do
        printf '%s=%s,' "$r" "$(shop_item "$p-shop.json" "$r" remaining)"; done)" '
        BEGIN { n = split(left, kv, ","); for (i = 1; i <= n; i++) if (split(kv[i], p, "=") == 2) units[p[1]] = p[2] }
        NR > 1 && $1 >= w && units[$5] > 0 && !($6 >= 200 && $6 < 300) { bad++ }
        END { print bad + 0 }' "$p.ops.tsv")
    # the kill fell in the sale when units were still bought after it
    sold_after=-
    [[ $kill_ms == - ]] || sold_after=$(awk -F'\t' -v k="$kill_ms" \
        'NR > 1 && $1 >= k && $6 >= 200 && $6 < 300 { n++ } END { print n + 0 }' "$p.ops.tsv")
    [[ $sold_after != 0 ]] || problems+=("every unit was sold before the kill: the run did not test it")
    ((sold <= initial)) || problems+=("oversold: $sold of $initial units")
    ((client_ok <= sold)) || problems+=("phantom: $client_ok client successes for $sold units sold")
    [[ $nemesis != none ]] || ((client_ok == sold)) || problems+=("$client_ok client successes for $sold units sold, no fault")
    ((undersold == 0)) || problems+=("undersold: $undersold buyers turned away while units were left")
    ((remaining == 0)) || problems+=("$remaining units left at the end")
    note_problems PROBLEMS "d. $nemesis rep $rep" " (see $p.json)" "${problems[@]}"
    printf '%s\t' "$nemesis" "$rep" "$initial" "$sold" "$buys" "$(per "$buys" "$sold" 4)" "$remaining" \
        "$client_ok" "$(jq '.ops' "$p.json")" "$(json_counts "$p.json" status)" "$(json_counts "$p.json" errors)" \
        "$kill_ms" "$heal_ms" "$window_ms" "$sold_after" >>"$OUT/flood.tsv"
    echo "$undersold" >>"$OUT/flood.tsv"
    log "  flood factor $(per "$buys" "$sold" 4): $buys buy requests at the shop for $sold units sold ($remaining left)"
}

if has d; then
    start_origin "$OUT/d/origin.log" "bench-origin (shop, slow)" "$FORIGIN_PORT" --delay-ms 0 --shop \
        --shop-delay-ms "$FLOOD_SHOP_DELAY_MS"
    PID_OF[forigin]=$LAST_PID
    start_redis flood "$FREDIS_PORT"
    PID_OF[fredis]=$LAST_PID
    for i in a b c; do
        port_var=F${i^^}_PORT admin_var=F${i^^}_ADMIN
        start_cg "flood-$i" "${!port_var}" "${!admin_var}" "$FORIGIN_PORT" "$FREDIS_PORT" "${FLOOD_RECONCILE_MS}ms" 3s \
            upstream.timeout=1s lock.wait_timeout=1s redis.command_timeout=200ms
    done
    printf 'nemesis\trep\tstock\tsold\tshop_buys\tflood_factor\tremaining\tclient_ok\tattempts\tstatuses\terrors\tkill_unix_ms\theal_unix_ms\twindow_unix_ms\tsold_after_kill\tundersold\n' \
        >"$OUT/flood.tsv"
    each_rep_n() {
        local rep n
        for ((rep = 1; rep <= FLOOD_REPS; rep++)); do
            # shellcheck disable=SC2046,SC2086 # the rotated list splits into words on purpose
            for n in $(rotate $((rep - 1)) $NEMESES); do flood_run "$n" "$rep"; done
        done
    }
    section_load d start
    each_rep_n
    section_load d end
    for i in a b c; do save_metrics "${ADMIN_OF[flood-$i]}" "$OUT/d/metrics-flood-$i-end.txt"; done
fi

end_env

# --- summary -----------------------------------------------------------------------------

# values FILE COLUMN KEY=VALUE...: tsv_col.
values() { tsv_col "$@"; }
# vcell KIND FILE COLUMN KEY=VALUE...: "median (min–max)" of those values ("–" without any).
vcell() {
    local kind=$1 v
    shift
    mapfile -t v < <(tsv_col "$@")
    if ((${#v[@]} == 0)); then printf '–'; elif [[ $kind == int ]]; then cell int "${v[@]}"; else cell_dec "$kind" "${v[@]}"; fi
}
med() {
    local v
    mapfile -t v < <(tsv_col "$@")
    ((${#v[@]} == 0)) || median "${v[@]}"
}
# paired A B: per rep, A's req/s ÷ B's (section a), one per line.
paired() {
    awk -F'\t' -v a="$1" -v b="$2" 'NR > 1 { r[$1 "," $2] = $3; reps[$2] = 1 }
        END { for (k in reps) if (r[a "," k] > 0 && r[b "," k] > 0) printf "%.4f\n", r[a "," k] / r[b "," k] }' \
        "$OUT/throughput.tsv"
}
# paired_col COL A B: per rep, A's COL ÷ B's (section a), one per line.
paired_col() {
    awk -F'\t' -v c="$1" -v a="$2" -v b="$3" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i; next }
        { r[$1 "," $2] = $k; reps[$2] = 1 }
        END { for (x in reps) if (r[a "," x] > 0 && r[b "," x] > 0) printf "%.4f\n", r[a "," x] / r[b "," x] }' \
        "$OUT/throughput.tsv"
}
r2() { if [[ -n $1 ]]; then LC_ALL=C printf '%.2f%s' "$1" "${2:-}"; else printf '–'; fi; }
judge() {
    if [[ -z $1 ]]; then
        echo "not measured"
        return
    fi
    verdict "$(awk -v v="$1" -v l="$3" -v op="$2" 'BEGIN { print ((op == "<=") ? (v <= l) : (v >= l)) ? 1 : 0 }')"
}
# largest V...: the largest value ("" without any).
largest() { printf '%s\n' "$@" | sort -g | tail -n 1; }

if has a; then
    mapfile -t SO_RATIO < <(paired soldout l1)
    mapfile -t BUY_RATIO < <(paired buy l1)
    mapfile -t FWD_RATIO < <(paired forward l1)
    mapfile -t BUY_FWD_RATE < <(paired buy forward)
    mapfile -t BUY_FWD_CPU < <(paired_col cg_us buy forward)
    R_BUY_FWD_RATE=$(median "${BUY_FWD_RATE[@]}")
    R_BUY_FWD_CPU=$(median "${BUY_FWD_CPU[@]}")
    BUY_CALLS=$(med "$OUT/throughput.tsv" redis_calls_per_answer target=buy)
    BUY_REDIS_US=$(med "$OUT/throughput.tsv" redis_us target=buy)
    FWD_CPU=$(med "$OUT/throughput.tsv" cg_us target=forward)
    R_SO=$(median "${SO_RATIO[@]}")
    mapfile -t SO_CMDS < <(values "$OUT/throughput.tsv" redis_calls_per_answer target=soldout)
    SO_CMDS_MAX=$(largest "${SO_CMDS[@]}")
    BUY_RPS=$(med "$OUT/throughput.tsv" rps target=buy)
    BUY_SCRIPTS=$(med "$OUT/throughput.tsv" buy_scripts_per_answer target=buy)
    ALL_SCRIPTS=$(med "$OUT/throughput.tsv" scripts_per_answer target=buy)
    BUY_CPU=$(med "$OUT/throughput.tsv" cg_us target=buy)
    # what cacheguard's own CPU time per attempt allows one core: not the target (a rate
    # measured by a client), the figure to read beside it on a shared machine
    BUY_PER_CORE=$(awk -v us="$BUY_CPU" 'BEGIN { if (us > 0) printf "%.0f", 1e6 / us }')
fi
# The scripts per buy attempt: from b (MONITOR, one client, every attempt answered) when it
# ran. a's commandstats count a few BUY scripts of attempts that got no gate decision: a
# client that hung up at wrk's end while its script ran, or a script that outlived
# redis.command_timeout (the attempt answered 503); its per-rep figures are in a's table.
SCRIPTS_FROM=a
if has b; then
    monitor_per() { awk -F'\t' -v k="$1" '$1 == "buy" && $2 == k { v = $4 } END { print v + 0 }' "$OUT/monitor.tsv"; }
    BUY_SCRIPTS=$(monitor_per "BUY script")
    ALL_SCRIPTS=$(awk -v a="$BUY_SCRIPTS" -v b="$(monitor_per "SETTLE script")" \
        -v c="$(monitor_per "SETTLE_SALES script")" 'BEGIN { printf "%.3f", a + b + c }')
    SCRIPTS_FROM="b, $BUY_SAMPLE attempts under MONITOR"
fi
if has c; then
    MARK_P50=$(jq '.reached_all_ms.p50' "$OUT/mark.json")
    MARK_P99=$(jq '.reached_all_ms.p99' "$OUT/mark.json")
fi
if has d; then
    UNDERSOLD=$(awk -F'\t' 'NR > 1 { n += $NF } END { print n + 0 }' "$OUT/flood.tsv")
    FLOOD_NONE=$(med "$OUT/flood.tsv" flood_factor nemesis=none)
    FLOOD_KILL=$(med "$OUT/flood.tsv" flood_factor nemesis=redis-kill)
    mapfile -t FN < <(values "$OUT/flood.tsv" flood_factor nemesis=none)
    mapfile -t FK < <(values "$OUT/flood.tsv" flood_factor nemesis=redis-kill)
    FLOOD_NONE_MAX=$(largest "${FN[@]}")
    FLOOD_KILL_MAX=$(largest "${FK[@]}")
fi

# load_cell SECTION: "start → end" 1-minute load averages of a section ("–" when it did not run).
load_cell() {
    awk -F'\t' -v s="$1" '$1 == s { v[$2] = $3 } END { if ("start" in v) printf "%s → %s", v["start"], v["end"]; else printf "–" }' \
        "$OUT/load.tsv"
}
# LOADED: 1 when a section started or ended with the 1-minute load average above 2 (2 cores).
LOADED=$(awk -F'\t' 'NR > 1 && $3 > 2 { l = 1 } END { print l + 0 }' "$OUT/load.tsv")

{
    echo "# cacheguard flash sale: $STAMP"
    echo
    echo "A stock gate in front of a shop that keeps stock with a conditional decrement (bench-origin \`--shop\`);"
    echo "cacheguard release build, shared mode, one redis-server; everything on 127.0.0.1 on the same $(nproc) cores."
    echo
    echo "## Targets"
    echo
    echo "| target | measured | verdict | load (1 min) at the section's start → end |"
    echo "|---|---|---|---|"
    if has a || has b; then
        scripts_rows=1
    fi
    if has a; then
        echo "| sold-out answers/s ≥ 0.8× the same instance's L1-hit rate (median of per-rep ratios) | $(r2 "$R_SO" ×) ($(cell_dec 2 "${SO_RATIO[@]}")) | $(judge "$R_SO" ">=" 0.8) | $(load_cell a) |"
        echo "| ≤ 0.001 Redis commands per sold-out answer (commandstats, every call in the window; largest rep) | $(LC_ALL=C printf '%.6f' "$SO_CMDS_MAX") | $(judge "$SO_CMDS_MAX" "<=" 0.001) | $(load_cell a) |"
        echo "| ≥ 25,000 buy attempts/s while stock lasts through one instance (median) | $(fmt_int "$BUY_RPS")/s; cacheguard CPU $(r2 "$BUY_CPU") µs per attempt (≈ $(fmt_int "$BUY_PER_CORE") attempts per CPU-second) | $(judge "$BUY_RPS" ">=" 25000) | $(load_cell a) |"
    fi
    if [[ -n ${scripts_rows:-} ]]; then
        echo "| … with one Redis script each: every script an attempt runs (BUY + SETTLE, per attempt; from $SCRIPTS_FROM) | $(LC_ALL=C printf '%.3f' "$ALL_SCRIPTS") | $(judge "$ALL_SCRIPTS" "<=" 1.0) | $(load_cell "${SCRIPTS_FROM%%,*}") |"
        echo "| … of which the buy decision (BUY scripts per attempt; from $SCRIPTS_FROM) | $(LC_ALL=C printf '%.3f' "$BUY_SCRIPTS") | $(judge "$BUY_SCRIPTS" "<=" 1.0) | $(load_cell "${SCRIPTS_FROM%%,*}") |"
        echo "| cacheguard CPU per gated buy ≤ 1.5× its CPU per ungated forward of the same POST (median of per-rep ratios) | $(r2 "$R_BUY_FWD_CPU" ×) ($(r2 "$BUY_CPU") against $(r2 "$FWD_CPU") µs; per rep $(cell_dec 2 "${BUY_FWD_CPU[@]}")) | $(judge "$R_BUY_FWD_CPU" "<=" 1.5) | $(load_cell a) |"
        echo "| ≤ 8 Redis commands executed per buy (commandstats, the scripts' own and the batched settlements included; median) | $(r2 "$BUY_CALLS") | $(judge "$BUY_CALLS" "<=" 8) | $(load_cell a) |"
        echo "| ≤ 15 µs of redis-server CPU per buy (median) | $(r2 "$BUY_REDIS_US" " µs") | $(judge "$BUY_REDIS_US" "<=" 15) | $(load_cell a) |"
        echo "| buy attempts/s ≥ 0.7× the ungated forward's, same instance (median of per-rep ratios) | $(r2 "$R_BUY_FWD_RATE" ×) (per rep $(cell_dec 2 "${BUY_FWD_RATE[@]}")) | $(judge "$R_BUY_FWD_RATE" ">=" 0.7) | $(load_cell a) |"
    fi
    if has c; then
        echo "| the sold-out mark reaches every instance within 50 ms p99 ($(jq '.reps' "$OUT/mark.json") reps; p50 $(r2 "$MARK_P50" " ms")) | $(r2 "$MARK_P99" " ms") | $(judge "$MARK_P99" "<=" 50) | $(load_cell c) |"
    fi
    if has d; then
        echo "| flood factor ≤ 1.02 with no fault (median; largest run) | $(LC_ALL=C printf '%.3f' "$FLOOD_NONE") ($(LC_ALL=C printf '%.3f' "$FLOOD_NONE_MAX")) | $(judge "$FLOOD_NONE_MAX" "<=" 1.02) | $(load_cell d) |"
        echo "| flood factor ≤ 1.2 through a Redis kill and restart (median; largest run) | $(LC_ALL=C printf '%.3f' "$FLOOD_KILL") ($(LC_ALL=C printf '%.3f' "$FLOOD_KILL_MAX")) | $(judge "$FLOOD_KILL_MAX" "<=" 1.2) | $(load_cell d) |"
        echo "| undersell 0 after ≤ 2 reconcile intervals (buyers turned away while units were left, every run) | $UNDERSOLD | $(judge "$UNDERSOLD" "<=" 0) | $(load_cell d) |"
    fi
    echo
    if ((LOADED)); then
        echo "**The machine was loaded** (a 1-minute load average above 2 on $(nproc) cores at a section's edge, table above;"
        echo "other jobs shared the cores): the rates here are not evidence of throughput. Read the counts (Redis"
        echo "commands and scripts per answer, sales, flood factors) and the CPU time per answer instead."
        echo
    fi
    env_summary
    echo
    problem_items "- Every run was clean: the answers were what each target expects, the counters agree." \
        "" "${PROBLEMS[@]}"

    if has a; then
        echo
        echo "## a. One instance: L1 hits, sold-out answers, buys"
        echo
        echo "Load (1 min) at the start → end of the section: $(load_cell a)."
        echo
        echo "\`wrk -t$THREADS -c$CONNECTIONS -d$DURATION --timeout 10s --latency\`, $REPS reps, targets rotating. req/s, p50, p99: wrk's."
        echo "Costs are per answer cacheguard counted (wrk leaves a few unread at its end), read ${TAIL_S} s after wrk"
        echo "ended: CPU = utime + stime (/proc/PID/stat) over the run ÷ answers. Redis calls = every call INFO"
        echo "commandstats counted over the run (scripts and the calls inside them, background commands included) ÷"
        echo "answers; scripts = EVALSHA + EVAL; BUY / SETTLE scripts told apart by ZRANGEBYSCORE /"
        echo "ZREMRANGEBYSCORE calls, net of reconciles. forward: the same POST on a write route without a gate."
        echo
        echo "| target | req/s | ÷ L1 hits (per rep) | p50 ms | p99 ms | cacheguard CPU µs/answer | redis-server CPU µs/answer | Redis calls/answer | scripts/answer | BUY scripts/answer | SETTLE scripts/answer | cacheguard's own count of Redis commands/answer | reconciles in the run |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        for t in $TARGETS; do
            case $t in
            l1) ratio="1" ;;
            soldout) ratio=$(cell_dec 2 "${SO_RATIO[@]}") ;;
            buy) ratio=$(cell_dec 2 "${BUY_RATIO[@]}") ;;
            forward) ratio=$(cell_dec 2 "${FWD_RATIO[@]}") ;;
            esac
            echo "| $t | $(vcell int "$OUT/throughput.tsv" rps target="$t") | $ratio | $(vcell 3 "$OUT/throughput.tsv" p50_ms target="$t") | $(vcell 3 "$OUT/throughput.tsv" p99_ms target="$t") | $(vcell 1 "$OUT/throughput.tsv" cg_us target="$t") | $(vcell 1 "$OUT/throughput.tsv" redis_us target="$t") | $(vcell 6 "$OUT/throughput.tsv" redis_calls_per_answer target="$t") | $(vcell 4 "$OUT/throughput.tsv" scripts_per_answer target="$t") | $(vcell 4 "$OUT/throughput.tsv" buy_scripts_per_answer target="$t") | $(vcell 4 "$OUT/throughput.tsv" settle_scripts_per_answer target="$t") | $(vcell 6 "$OUT/throughput.tsv" metric_cmds_per_answer target="$t") | $(values "$OUT/throughput.tsv" reconciles target="$t" | paste -sd/) |"
        done
        echo
        echo "- l1: $(values "$OUT/throughput.tsv" l1_hits target=l1 | paste -sd/) L1 hits of $(values "$OUT/throughput.tsv" counted target=l1 | paste -sd/) answers; the rest were L2 hits (shared mode keeps an entry in L1 for \`hot_keys.l1_ttl\`, 1 s, then reads it from Redis again)."
        echo "- buy: the shop received $(values "$OUT/throughput.tsv" shop_buys target=buy | paste -sd/) buys and sold as many ($(values "$OUT/throughput.tsv" shop_sold target=buy | paste -sd/)); wrk answers: $(values "$OUT/throughput.tsv" requests target=buy | paste -sd/)."
        echo "- buy: BUY scripts in Redis $(values "$OUT/throughput.tsv" buy_scripts target=buy | paste -sd/) for $(values "$OUT/throughput.tsv" counted target=buy | paste -sd/) attempts admitted; SETTLE scripts $(values "$OUT/throughput.tsv" settle_scripts target=buy | paste -sd/). A BUY script beyond the admitted ones belongs to an attempt that got no gate decision: its client hung up (wrk's end) while the script ran, or the script outlived \`redis.command_timeout\` and the attempt was answered 503. Non-2xx answers per rep: $(values "$OUT/throughput.tsv" non2xx target=buy | paste -sd/)."
        echo "- Redis calls per sold-out answer, per rep: $(values "$OUT/throughput.tsv" redis_calls target=soldout | paste -sd/) calls for $(values "$OUT/throughput.tsv" requests target=soldout | paste -sd/) answers."
    fi
    if has b; then
        echo
        echo "## b. What one buy and one sold-out answer send to Redis (MONITOR)"
        echo
        echo "Load (1 min) at the start → end of the section: $(load_cell b)."
        echo
        echo "$BUY_SAMPLE buys of a resource with units and $BUY_SAMPLE POSTs to a sold-out one, \`loadgen buyers\` with one"
        echo "client and no pause, under \`redis-cli MONITOR\`. Top-level commands as sent; scripts by their key count"
        echo "(BUY: 3 keys; SETTLE: 4 keys; SETTLE_SALES: 3 keys, a batch of sales), with the calls each made inside Redis."
        echo
        echo "| sample | command | calls | per request | calls inside the script |"
        echo "|---|---|---|---|---|"
        tail -n +2 "$OUT/monitor.tsv" | awk -F'\t' '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, ($5 == "" ? "–" : $5) }'
    fi
    if has c; then
        echo
        echo "## c. The sold-out mark across three instances"
        echo
        echo "Load (1 min) at the start → end of the section: $(load_cell c)."
        echo
        echo "$(jq '.reps' "$OUT/mark.json") reps, probes $MARK_GAP_US µs apart. Times from the send of the last unit's buy to A, ms."
        echo "reached = the answer to an instance's first SOLDOUT probe (the mark was there by then); lower bound ="
        echo "the send of the probe before it, which found none."
        echo
        echo "| measure | p50 | p90 | p99 | max |"
        echo "|---|---|---|---|---|"
        jq -r '
            def row(name; s): "| \(name) | \(s.p50) | \(s.p90) | \(s.p99) | \(s.max) |";
            def summ(xs): (xs | sort) as $v | ($v | length) as $n |
                if $n == 0 then {p50: "–", p90: "–", p99: "–", max: "–"} else
                { p50: $v[(($n * 0.5) | ceil) - 1], p90: $v[(($n * 0.9) | ceil) - 1],
                  p99: $v[(($n * 0.99) | ceil) - 1], max: $v[$n - 1] } end;
            row("**reached both B and C**"; .reached_all_ms),
            row("reached B"; .instances[0].marked_ms),
            row("reached C"; .instances[1].marked_ms),
            row("lower bound, B"; summ([.records[].instances[0].last_unmarked_sent_ms | select(. != null)])),
            row("lower bound, C"; summ([.records[].instances[1].last_unmarked_sent_ms | select(. != null)])),
            row("the bus message at a subscriber of its channel"; .bus_message_ms),
            row("A answered the last buy (201)"; summ([.records[].last_buy_answered_ms])),
            row("probes per instance before the mark"; summ([.records[].instances[].unmarked_probes]))
        ' "$OUT/mark.json"
    fi
    if has d; then
        echo
        echo "## d. Flood factor over ${FLOOD_DURATION_S} s runs"
        echo
        echo "Load (1 min) at the start → end of the section: $(load_cell d)."
        echo
        echo "Three instances, $FLOOD_CLIENTS buyers paced ${FLOOD_PACE_MS} ms round-robin over them and four fresh resources"
        echo "($FLOOD_STOCK units), Idempotency-Keys; the shop takes ${FLOOD_SHOP_DELAY_MS} ms per buy. redis-kill: kill -9 at"
        echo "${KILL_AT_S} s, restarted empty ${KILL_DOWN_S} s later. Flood factor = buy requests at the shop ÷ units sold."
        echo
        echo "| nemesis | run | units | sold | buys at the shop | flood factor | left at the end | client 2xx | attempts | statuses | errors | sold after the kill | undersold |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        tail -n +2 "$OUT/flood.tsv" | awk -F'\t' '{ printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, ($11 == "" ? "–" : $11), $15, $16 }'
    fi
    echo
    echo "Raw data: \`${OUT#"$ROOT"/}/\`."
} >"$OUT/summary.md"

show_summary
