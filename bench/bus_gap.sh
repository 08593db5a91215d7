#!/usr/bin/env bash
# Reproduction for a cacheguard misbehaviour found by bench/stampede.sh: in shared mode the
# event-bus subscription drops and is re-made about once a second while idle, and during
# each ~30 ms gap the instance fills without the distributed lock, so two instances can both
# fetch one cold key.
#
# The drop comes from the idle check: a subscription with no message for 1 s is pinged, and
# the ping is taken as failed. Under steady traffic the fill messages keep it busy and it
# never drops; a cold key that arrives after a quiet second can land in the gap.
#
# Starts bench-origin (200 ms delay), a throwaway redis-server and two shared-mode
# cacheguard instances (the stampede benchmark's config). Then, for each pause P in PAUSES, it waits P
# seconds after the previous pair and fires one GET of a fresh key at each instance at the
# same moment (two curls). The previous pair's fill message arrives ~0.2 s after that pair,
# so a pause of ~1.2 s lands the next pair ~1 s after the last bus message. It reports how
# many times each key reached the origin; with the distributed lock working, every key
# reaches it exactly once.
#
# usage: bash bench/bus_gap.sh
# env:   PAUSES="1.170 1.175 ... 1.260" (seconds) BASE_PORT=29180 (uses BASE_PORT+1 .. +6)
#        CACHEGUARD_BIN=path (skip `cargo build --release`)

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PAUSES=${PAUSES:-$(LC_ALL=C awk 'BEGIN { for (p = 1.170; p < 1.2625; p += 0.005) printf "%.3f ", p }')}
BASE_PORT=${BASE_PORT:-29180}
bench_ports ORIGIN_PORT REDIS_PORT A_PORT A_ADMIN B_PORT B_ADMIN

bench_init
ensure_apt_tools redis-server:redis-server redis-cli:redis-tools curl:curl jq:jq
require_tools cargo
require_free_ports "${BENCH_PORTS[@]}"

build_bench_tools
build_cacheguard

OUT=$ROOT/bench/results/bus-gap-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"

start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" --delay-ms 200
start_redis bus-gap "$REDIS_PORT"

for inst in A B; do
    port_var=${inst}_PORT admin_var=${inst}_ADMIN
    lock_config "${!port_var}" "${!admin_var}" "$ORIGIN_PORT" redis.url="redis://127.0.0.1:$REDIS_PORT" \
        redis.command_timeout=200ms journal.path="journal-$inst" >"$OUT/cg$inst.toml"
    start_bg "$OUT/cg$inst.log" "$CG_BIN" --config "$OUT/cg$inst.toml"
    wait_http "http://127.0.0.1:${!admin_var}/healthz" "$LAST_PID" "cacheguard $inst"
done
sleep 2 # both subscribed, and a couple of idle pings behind us

curl -s -X POST "http://127.0.0.1:$ORIGIN_PORT/stats/reset" >/dev/null
log "pairs of simultaneous GETs (one per instance) of a fresh key, after pauses of: $PAUSES"
id=30001 pairs=0 curls=()
declare -A PAUSE_OF
for pause in $PAUSES; do
    sleep "$pause"
    PAUSE_OF[$id]=$pause
    for port in "$A_PORT" "$B_PORT"; do
        curl -s -o /dev/null --max-time 10 "http://127.0.0.1:$port/items/$id" &
        curls+=($!)
        BENCH_PIDS+=($!)
    done
    id=$((id + 1)) pairs=$((pairs + 1))
done
for pid in "${curls[@]}"; do
    wait "$pid" 2>/dev/null || true
    forget_pid "$pid"
done
sleep 0.5
curl -s "http://127.0.0.1:$ORIGIN_PORT/stats" >"$OUT/origin-stats.json"
for inst in A B; do
    admin_var=${inst}_ADMIN
    curl -s "http://127.0.0.1:${!admin_var}/metrics" >"$OUT/metrics-cg$inst.txt"
done

twice=$(jq '[.paths | to_entries[] | select(.value >= 2)] | length' "$OUT/origin-stats.json")
once=$(jq '[.paths | to_entries[] | select(.value == 1)] | length' "$OUT/origin-stats.json")
m() { awk -v k="$2" '$1 == k { print $2 }' "$OUT/metrics-cg$1.txt"; }
{
    echo "pairs: $pairs (keys 30001..$((id - 1)))"
    printf 'origin requests per key (pause before the pair): '
    for ((k = 30001; k < id; k++)); do
        printf '%s(%ss) ' "$(jq --arg p "/items/$k" '.paths[$p] // 0' "$OUT/origin-stats.json")" "${PAUSE_OF[$k]}"
    done
    echo
    echo "keys fetched from the origin once: $once"
    echo "keys fetched from the origin twice or more: $twice"
    for inst in A B; do
        echo "cg$inst: resubscriptions $(m "$inst" cacheguard_event_bus_resubscriptions_total)," \
            "lock acquired $(m "$inst" 'cacheguard_lock_events_total{outcome="acquired"}')," \
            "contended $(m "$inst" 'cacheguard_lock_events_total{outcome="contended"}')," \
            "origin requests $(m "$inst" 'cacheguard_origin_requests_total{route="item",status="2xx"}')," \
            "'subscription lost' log lines $(grep -c 'subscription lost' "$OUT/cg$inst.log" || true)"
    done
    echo "results: $OUT"
} | tee "$OUT/summary.txt"
