#!/usr/bin/env bash
# Where does cacheguard spend its time? A flat `perf` profile of the cacheguard process
# while wrk loads it, on the HIT-L1 path (one warmed key) or the miss path (distinct keys).
# Same origin (nginx `return 200`, 1 KiB JSON) and config as bench/hit_path.sh.
#
# usage: bash bench/profile_hit.sh [hit|miss]
# env:   PROFILE_SECONDS=8 BASE_PORT=28180 CACHEGUARD_BIN=path (else cargo build --release)
#        WRK_ARGS="-t2 -c64" (hit mode)
#
# Writes bench/results/profile-<mode>-<UTC timestamp>/ (perf.data, report.txt, wrk.txt).
# Needs perf (Debian package linux-perf; installed when missing).

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODE=${1:-hit}
[[ $MODE == hit || $MODE == miss ]] || die "usage: bash bench/profile_hit.sh [hit|miss]"
bench_defaults PROFILE_SECONDS=8 BASE_PORT=28180 WRK_ARGS="-t2 -c64"
bench_ports ORIGIN_PORT - CG_PORT CG_ADMIN_PORT

bench_init
ensure_apt_tools nginx:nginx wrk:wrk curl:curl perf:linux-perf
require_tools cargo
require_free_ports "${BENCH_PORTS[@]}"

build_cacheguard

OUT=$ROOT/bench/results/profile-$MODE-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"

start_nginx origin bench/origin.conf.tmpl WORKERS=2 PORT="$ORIGIN_PORT" STATIC_BODY="$(static_body 1024)"
wait_http "http://127.0.0.1:$ORIGIN_PORT/items/1" "$LAST_PID" "origin nginx"

cg_config "$CG_PORT" "$CG_ADMIN_PORT" "$ORIGIN_PORT" upstream.max_concurrency=256 cache.ttl=600s \
    cache.l1_max_bytes=67108864 >"$OUT/cacheguard.toml"
start_bg "$OUT/cacheguard.log" "$CG_BIN" --config "$OUT/cacheguard.toml"
CG_PID=$LAST_PID
wait_http "http://127.0.0.1:$CG_ADMIN_PORT/healthz" "$CG_PID" cacheguard

secs=$((PROFILE_SECONDS + 4))
if [[ $MODE == hit ]]; then
    warm "http://127.0.0.1:$CG_PORT/items/1" HIT-L1
    # shellcheck disable=SC2086
    start_bg "$OUT/wrk.txt" wrk $WRK_ARGS -d"${secs}s" --latency "http://127.0.0.1:$CG_PORT/items/1"
else
    mkdir -p "$BENCH_TMP/done"
    start_bg "$OUT/wrk.txt" wrk -t2 -c64 -d"${secs}s" --latency -s bench/distinct.lua \
        "http://127.0.0.1:$CG_PORT" -- 100000000 2 "$BENCH_TMP/done"
fi
WRK_PID=$LAST_PID
sleep 2
log "perf record -p $CG_PID for ${PROFILE_SECONDS}s ($MODE path)"
perf record -q -F 999 -g -o "$OUT/perf.data" -p "$CG_PID" -- sleep "$PROFILE_SECONDS" 2>"$OUT/perf-record.log" ||
    die "perf record failed; see $OUT/perf-record.log"
wait "$WRK_PID" || true
forget_pid "$WRK_PID"

perf report -i "$OUT/perf.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null |
    grep -v '^#' | grep -v '^[[:space:]]*$' >"$OUT/symbols.txt" || true
{
    echo "## self time by component (perf, $MODE path, ${PROFILE_SECONDS}s, -F 999)"
    # group each symbol's self time by what it belongs to
    awk '
        {
            pct = $1; sub(/%/, "", pct)
            line = $0
            g = "other user space"
            if (line ~ /\[k\]/) g = "kernel (syscalls, TCP loopback, scheduler)"
            else if (line ~ /hyper(_util)?::/) g = "hyper / hyper-util (HTTP parse, encode, dispatch)"
            else if (line ~ /tokio::/) g = "tokio (runtime, I/O driver, timers)"
            else if (line ~ /moka::|crossbeam|quanta|tagptr/) g = "moka (L1 lookup and housekeeping)"
            else if (line ~ /prometheus::/) g = "prometheus (metrics)"
            else if (line ~ /cacheguard::/) g = "cacheguard code"
            else if (line ~ /matchit::/) g = "matchit (routing)"
            else if (line ~ /bytes::/) g = "bytes"
            else if (line ~ /http::/) g = "http (HeaderMap etc.)"
            else if (line ~ /xxh3|xxhash/) g = "xxhash (key hash)"
            else if (line ~ /malloc|free|realloc|_int_|cfree|memmove|memcpy|memset|clock_gettime|libc/) g = "libc (malloc/free, memcpy, clock_gettime)"
            sum[g] += pct
        }
        END { for (g in sum) printf "%6.2f%%  %s\n", sum[g], g }' "$OUT/symbols.txt" | sort -rn
    echo
    echo "## top symbols (self)"
    head -40 "$OUT/symbols.txt" | cut -c1-160
} >"$OUT/report.txt"
cat "$OUT/report.txt"
grep -E 'Requests/sec|99%' "$OUT/wrk.txt" >&2 || true
log "profile in $OUT"
