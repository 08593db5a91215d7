#!/usr/bin/env bash
# The hit path's cost with the access log on, against off: one cacheguard binary, embedded
# mode, `l1 = "all"`, every measured request an L1 hit; two configs:
#
#   off    [access_log] format = "off" (the default)
#   json   [access_log] format = "json", sample = 1.0 (every request), to a file
#
# For each rep, off then json (the order alternates rep by rep): start cacheguard, fill KEYS
# keys and read them once (loadgen cycle), then
#
#   a. CPU    an open-loop RATE req/s for DURATION_S seconds over 16 connections (loadgen
#             cycle over the KEYS keys); cacheguard's CPU time (utime + stime of every thread,
#             the log writer's included, from /proc/PID/stat) divided by the requests sent,
#             and the log writer thread's own (/proc/PID/task/TID/stat of `cg-access-log`)
#   b. req/s  wrk -t2 -c64 -dDURATION_S on one cached key (closed loop: the whole machine)
#
# and the access log lines written and dropped (/metrics). A fixed rate for CPU, not a
# closed loop: on this noisy 2-core box CPU per request is steadier than requests per
# second.
#
# usage: bash bench/access_log.sh
# env:   REPS=3 RATE=5000 DURATION_S=10 KEYS=1000 BASE_PORT=37379 (uses +1..+2)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#
# Prints a markdown table (median and range per config, and json / off) and writes
# bench/results/access-log-<UTC timestamp>/ (configs, logs, raw.tsv, wrk outputs). Every
# process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults REPS=3 RATE=5000 DURATION_S=10 KEYS=1000 BASE_PORT=37379
require_positive REPS RATE DURATION_S KEYS
bench_ports ORIGIN_PORT CG_PORT ADMIN_PORT

require_tools curl wrk bc
require_free_ports "${BENCH_PORTS[@]}"
bench_init
build_bench_tools
build_cacheguard
bench_results access-log-
TCK=$(getconf CLK_TCK)
REQUESTS=$((RATE * DURATION_S))
CONFIGS="off json"
ACCESS_LOG=$BENCH_TMP/access.log

write_env wrk <<EOF
rate: $RATE req/s for ${DURATION_S} s over $KEYS keys; wrk -t2 -c64 -d${DURATION_S}s
EOF

start_origin "$OUT/origin.log" origin "$ORIGIN_PORT" --delay-ms 0 --threads 1

# config NAME: cacheguard's config with the access log NAME (off, json).
config() {
    local log=(access_log.format=off)
    [[ $1 == off ]] || log=(access_log.format=json access_log.path="$ACCESS_LOG" access_log.sample=1.0)
    cg_config "$CG_PORT" "$ADMIN_PORT" "$ORIGIN_PORT" upstream.max_concurrency=1024 \
        upstream.queue_timeout=5s cache.ttl=600s cache.l1=all hot_keys.threshold_rps=0 "${log[@]}"
}

# writer_ticks PID: CPU time of PID's access-log writer thread, in clock ticks (0 without one).
writer_ticks() {
    local task
    for task in /proc/"$1"/task/*; do
        if [[ $(cat "$task/comm" 2>/dev/null) == cg-access-log ]]; then
            cat "$task/stat" 2>/dev/null || true
        fi
    done | awk '{ sub(/^.*\) /, ""); s += $12 + $13 } END { print s + 0 }'
}

cycle() {
    "$LOADGEN_BIN" cycle --url "http://127.0.0.1:$CG_PORT/items/{id}" --keys "$KEYS" \
        --rate "$1" --duration-s "$2" --connections 16
}

printf 'rep\tconfig\tcg_us_per_req\twriter_us_per_req\twrk_rps\tlines_written\tlines_dropped\tlog_bytes\n' >"$OUT/raw.tsv"
for rep in $(seq "$REPS"); do
    order="off json"
    ((rep % 2 == 0)) && order="json off"
    for name in $order; do
        config "$name" >"$OUT/$name.toml"
        rm -f "$ACCESS_LOG"
        start_bg "$OUT/cg-$rep-$name.log" "$CG_BIN" --config "$OUT/$name.toml"
        cg=$LAST_PID
        wait_http "http://127.0.0.1:$ADMIN_PORT/healthz" "$cg" cacheguard
        # Fill every key, then read each once more: the measured part is hits only.
        cycle $((KEYS * 2)) 1 >/dev/null
        c0=$(cpu_ticks "$cg") w0=$(writer_ticks "$cg")
        cycle "$RATE" "$DURATION_S" >"$OUT/load-$rep-$name.json"
        c1=$(cpu_ticks "$cg") w1=$(writer_ticks "$cg")
        wrk_once "$OUT/wrk-$rep-$name.txt" "$name" -t2 -c64 -d"${DURATION_S}s" --latency \
            "http://127.0.0.1:$CG_PORT/items/1"
        read -r rps _ < <(wrk_parse "$OUT/wrk-$rep-$name.txt")
        save_metrics "http://127.0.0.1:$ADMIN_PORT" "$OUT/metrics-$rep-$name.txt"
        written=$(metric "$OUT/metrics-$rep-$name.txt" 'cacheguard_access_log_lines_total{result="written"}')
        dropped=$(metric "$OUT/metrics-$rep-$name.txt" 'cacheguard_access_log_lines_total{result="dropped"}')
        bytes=$(stat -c %s "$ACCESS_LOG" 2>/dev/null || echo 0)
        stop_pid "$cg"
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$name" \
            "$(echo "($c1 - $c0) * 1000000 / $TCK / $REQUESTS" | bc -l)" \
            "$(echo "($w1 - $w0) * 1000000 / $TCK / $REQUESTS" | bc -l)" \
            "$rps" "$written" "$dropped" "$bytes" >>"$OUT/raw.tsv"
        log "rep $rep $name done: $rps req/s, $written lines written, $dropped dropped"
    done
done
rm -f "$ACCESS_LOG"
end_env

# column CONFIG FIELD: the values of FIELD (3..8) for CONFIG, one per line.
column() { awk -F'\t' -v c="$1" -v f="$2" 'NR > 1 && $2 == c { print $f }' "$OUT/raw.tsv"; }
# shellcheck disable=SC2046 # one value per line, split on purpose
{
    echo "# cacheguard hit path, access log off vs json: $(basename "$OUT")"
    echo
    echo "$REPS reps, order alternating. CPU: $RATE req/s open loop for ${DURATION_S} s over $KEYS keys (L1 hits). req/s: wrk -t2 -c64 -d${DURATION_S}s on one key."
    echo
    echo "| access log | cacheguard CPU µs/req | of which the log writer | wrk req/s | lines written | lines dropped |"
    echo "|---|---|---|---|---|---|"
    for name in $CONFIGS; do
        echo "| $name | $(cell_dec 2 $(column "$name" 3)) | $(cell_dec 2 $(column "$name" 4)) | $(cell int $(column "$name" 5)) | $(cell int $(column "$name" 6)) | $(cell int $(column "$name" 7)) |"
    done
    cpu_off=$(median $(column off 3)) cpu_json=$(median $(column json 3))
    rps_off=$(median $(column off 5)) rps_json=$(median $(column json 5))
    echo "| **json / off** | **$(ratio "$cpu_json" "$cpu_off")** | | **$(ratio "$rps_json" "$rps_off")** | | |"
    echo
    env_summary
} | tee "$OUT/summary.md" >/dev/null
show_summary
