#!/usr/bin/env bash
# CPU per request of two cacheguard binaries, A and B, measured the same way in one run:
#
#   l1   embedded mode, `l1 = "all"`: every measured request is an L1 hit
#   l2   shared mode with one redis-server, `l1 = "off"`: every measured request is an L2
#        hit (one Redis GET)
#
# For each rep and each mode, A then B (the order alternates rep by rep): start the binary,
# fill KEYS keys and read them once (loadgen cycle), then an open-loop RATE req/s for
# DURATION_S seconds over 16 connections (loadgen cycle over the KEYS keys). Recorded per
# run: cacheguard's CPU time (utime + stime from /proc/PID/stat) and redis-server's
# (INFO cpu) divided by the requests sent, and Redis commands per request (INFO stats).
# A fixed rate, not a closed loop: on this noisy 2-core box CPU per request is steadier
# than requests per second.
#
# usage: A_BIN=path B_BIN=path bash bench/cpu_ab.sh
# env:   REPS=4 RATE=5000 DURATION_S=10 KEYS=1000 MODES="l1 l2" BASE_PORT=36379 (uses +1..+3)
#
# Prints a markdown table (median and range per binary and mode, and the B / A ratio) and
# writes bench/results/cpu-ab-<UTC timestamp>/ (configs, logs, raw.tsv). Every process it
# starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

A_BIN=${A_BIN:?set A_BIN to the first cacheguard binary}
B_BIN=${B_BIN:?set B_BIN to the second cacheguard binary}
bench_defaults REPS=4 RATE=5000 DURATION_S=10 KEYS=1000 MODES="l1 l2" BASE_PORT=36379
REDIS_PORT=$BASE_PORT
bench_ports ORIGIN_PORT CG_PORT ADMIN_PORT

require_tools redis-server redis-cli curl
require_free_ports "$REDIS_PORT" "${BENCH_PORTS[@]}"
bench_init
build_bench_tools
OUT=$ROOT/bench/results/cpu-ab-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
TCK=$(getconf CLK_TCK)
REQUESTS=$((RATE * DURATION_S))

start_redis ab "$REDIS_PORT"
start_origin "$OUT/origin.log" origin "$ORIGIN_PORT" --delay-ms 0 --threads 1

# config MODE: cacheguard's config for MODE: l1 (embedded, `l1 = "all"`) or l2 (the Redis
# started here, `l1 = "off"`).
config() {
    local mode=(cache.l1=all)
    [[ $1 == l1 ]] || mode=(redis.url="redis://127.0.0.1:$REDIS_PORT" redis.command_timeout=200ms
        journal.path="$BENCH_TMP/journal" cache.l1=off)
    cg_config "$CG_PORT" "$ADMIN_PORT" "$ORIGIN_PORT" upstream.max_concurrency=1024 upstream.queue_timeout=5s \
        cache.ttl=600s "${mode[@]}"
}

redis_cpu() { redis-cli -p "$REDIS_PORT" info cpu | awk -F: '/used_cpu_(sys|user):/ { s += $2 } END { printf "%.4f", s }'; }
redis_cmds() { redis-cli -p "$REDIS_PORT" info stats | awk -F: '/total_commands_processed/ { print $2 + 0 }'; }
cycle() {
    "$LOADGEN_BIN" cycle --url "http://127.0.0.1:$CG_PORT/items/{id}" --keys "$KEYS" \
        --rate "$1" --duration-s "$2" --connections 16
}

printf 'rep\tmode\tbinary\tcg_us_per_req\tredis_us_per_req\tredis_cmds_per_req\n' >"$OUT/raw.tsv"
for rep in $(seq "$REPS"); do
    order="A B"
    ((rep % 2 == 0)) && order="B A"
    for mode in $MODES; do
        config "$mode" >"$OUT/$mode.toml"
        for which in $order; do
            bin=$A_BIN
            [[ $which == B ]] && bin=$B_BIN
            redis-cli -p "$REDIS_PORT" flushall >/dev/null
            rm -f "$BENCH_TMP"/journal*
            start_bg "$OUT/cg-$rep-$mode-$which.log" "$bin" --config "$OUT/$mode.toml"
            cg=$LAST_PID
            wait_http "http://127.0.0.1:$ADMIN_PORT/healthz" "$cg" cacheguard
            # Fill every key, then read each once more: the measured part is hits only.
            cycle $((KEYS * 2)) 1 >/dev/null
            c0=$(cpu_ticks "$cg") r0=$(redis_cpu) k0=$(redis_cmds)
            cycle "$RATE" "$DURATION_S" >"$OUT/load-$rep-$mode-$which.json"
            c1=$(cpu_ticks "$cg") r1=$(redis_cpu) k1=$(redis_cmds)
            stop_pid "$cg"
            printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$mode" "$which" \
                "$(echo "($c1 - $c0) * 1000000 / $TCK / $REQUESTS" | bc -l)" \
                "$(echo "($r1 - $r0) * 1000000 / $REQUESTS" | bc -l)" \
                "$(echo "($k1 - $k0) / $REQUESTS" | bc -l)" >>"$OUT/raw.tsv"
            log "rep $rep $mode $which done"
        done
    done
done

# column MODE BINARY FIELD: the values of FIELD (4..6) for MODE and BINARY, one per line.
column() { awk -F'\t' -v m="$1" -v b="$2" -v f="$3" 'NR > 1 && $2 == m && $3 == b { print $f }' "$OUT/raw.tsv"; }
{
    echo "# cacheguard CPU per request, A vs B: $(basename "$OUT")"
    echo
    echo "A = $A_BIN, B = $B_BIN; $REPS reps, order alternating; $RATE req/s open loop for ${DURATION_S} s over $KEYS keys."
    echo
    echo "| mode | binary | cacheguard µs/req | redis-server µs/req | Redis commands/req |"
    echo "|---|---|---|---|---|"
    for mode in $MODES; do
        for which in A B; do
            # shellcheck disable=SC2046 # one value per line, split on purpose
            echo "| $mode | $which | $(cell_dec 1 $(column "$mode" "$which" 4)) | $(cell_dec 1 $(column "$mode" "$which" 5)) | $(cell_dec 2 $(column "$mode" "$which" 6)) |"
        done
        # shellcheck disable=SC2046
        a=$(median $(column "$mode" A 4)) b=$(median $(column "$mode" B 4))
        echo "| $mode | **B / A** | **$(echo "$b / $a" | bc -l | cut -c1-4)** | | |"
    done
} | tee "$OUT/summary.md"
