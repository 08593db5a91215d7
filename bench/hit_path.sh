#!/usr/bin/env bash
# Hit-path benchmark for issue #2, in one run on this machine:
#
#   origin   nginx `return 200` with 1024 bytes of JSON for /items/{id}; it is also the
#            "direct static response" reference
#   peers    nginx 1.22 proxy_cache (lock on, keep-alive upstream, 2 workers) and cacheguard
#            (release build, embedded mode), both in front of that origin
#   a. throughput  wrk -t2 -c64 -d10s --latency on one warmed 1 KiB key, REPS reps,
#                  targets alternating within each rep
#   b. latency     wrk -t1 -c8 -d10s --latency (a moderate load that leaves CPU idle; wrk
#                  has no fixed-rate mode), cacheguard HIT-L1 vs direct static
#   c. memory      cacheguard with l1_max_bytes = 64 MiB under 1,000,000 distinct keys
#                  (wrk + bench/distinct.lua), VmRSS/VmHWM sampled every second
#
# usage: bash bench/hit_path.sh
# env:   REPS=3 DURATION=10s LAT_DURATION=$DURATION DISTINCT_KEYS=1000000
#        DISTINCT_MAX_DURATION=180s MEM_L1_MAX_BYTES=67108864 BASE_PORT=28080 (uses BASE_PORT+1 .. +6)
#        LAT_TARGETS="static cacheguard" (add nginx for its moderate-load latency too; +REPS×LAT_DURATION)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx prefixes)
#
# Writes bench/results/<UTC timestamp>/ (raw wrk outputs, samples, summary.md) and prints
# the markdown summary on stdout. Every process it starts is stopped on exit, by PID.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=bench/lib.sh
source bench/lib.sh

REPS=${REPS:-3}
DURATION=${DURATION:-10s}
LAT_DURATION=${LAT_DURATION:-$DURATION}
DISTINCT_KEYS=${DISTINCT_KEYS:-1000000}
DISTINCT_MAX_DURATION=${DISTINCT_MAX_DURATION:-180s}
BASE_PORT=${BASE_PORT:-28080}
LAT_TARGETS=${LAT_TARGETS:-static cacheguard}
WRK_TIMEOUT=10s
BODY_BYTES=1024
HIT_L1_MAX_BYTES=268435456
MEM_L1_MAX_BYTES=${MEM_L1_MAX_BYTES:-67108864}
KEY=/items/1

ORIGIN_PORT=$((BASE_PORT + 1))
NGINX_PORT=$((BASE_PORT + 2))
CG_PORT=$((BASE_PORT + 3))
CG_ADMIN_PORT=$((BASE_PORT + 4))
CGM_PORT=$((BASE_PORT + 5))
CGM_ADMIN_PORT=$((BASE_PORT + 6))

[[ $REPS =~ ^[1-9][0-9]*$ ]] || die "REPS must be a positive integer (got '$REPS')"
for t in static cacheguard; do
    [[ " $LAT_TARGETS " == *" $t "* ]] || die "LAT_TARGETS must include $t (got '$LAT_TARGETS')"
done
[[ $DISTINCT_KEYS =~ ^[1-9][0-9]*$ ]] || die "DISTINCT_KEYS must be a positive integer"

started_at=$SECONDS
bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx wrk:wrk curl:curl
require_tools cargo awk sort mktemp id
require_free_ports "$ORIGIN_PORT" "$NGINX_PORT" "$CG_PORT" "$CG_ADMIN_PORT" "$CGM_PORT" "$CGM_ADMIN_PORT"

if [[ -n "${CACHEGUARD_BIN:-}" ]]; then
    CG_BIN=$CACHEGUARD_BIN
    log "using CACHEGUARD_BIN=$CG_BIN (no build)"
else
    log "cargo build --release"
    cargo build --release --bin cacheguard >&2 || die "cargo build --release failed"
    CG_BIN=$ROOT/target/release/cacheguard
fi
[[ -x $CG_BIN ]] || die "cacheguard binary not found at $CG_BIN"

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=$ROOT/bench/results/$STAMP
mkdir -p "$OUT"
log "results: $OUT"

# --- environment -----------------------------------------------------------------------

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
{
    echo "date_utc: $STAMP"
    echo "nproc: $(nproc)"
    echo "mem_total: $(awk '/^MemTotal:/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
    echo "uname: $(uname -srm)"
    echo "cpu: $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)"
    echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
    echo "nginx: $(nginx -v 2>&1)"
    echo "wrk: $(wrk -v 2>&1 | head -n1 | awk '{ print $1, $2, $3 }')"
    echo "rustc: $(rustc -V 2>/dev/null || echo unknown)"
    echo "cacheguard: $("$CG_BIN" --version 2>/dev/null || echo unknown) ($CG_BIN)"
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$ROOT" diff --quiet HEAD -- src 2>/dev/null || echo ' (src/ has uncommitted changes)')"
    echo "load_start: $LOAD_START"
    echo "reps: $REPS"
    echo "duration: $DURATION (throughput), $LAT_DURATION (latency)"
    echo "distinct_keys: $DISTINCT_KEYS"
} >"$OUT/env.txt"
cat "$OUT/env.txt" >&2

# --- start the origin, nginx proxy_cache and cacheguard --------------------------------

BODY=$(static_body "$BODY_BYTES")

start_nginx origin bench/origin.conf.tmpl \
    WORKERS=2 PORT="$ORIGIN_PORT" STATIC_BODY="$BODY"
ORIGIN_PID=$LAST_PID
wait_http "http://127.0.0.1:$ORIGIN_PORT$KEY" "$ORIGIN_PID" "origin nginx"

start_nginx proxy bench/nginx.conf.tmpl \
    WORKERS=2 PORT="$NGINX_PORT" ORIGIN_PORT="$ORIGIN_PORT" TTL=600s
NGINX_PID=$LAST_PID
wait_http "http://127.0.0.1:$NGINX_PORT/nginx-ready" "$NGINX_PID" "nginx proxy_cache"
cp "$BENCH_TMP/nginx-origin/nginx.conf" "$OUT/nginx-origin.conf"
cp "$BENCH_TMP/nginx-proxy/nginx.conf" "$OUT/nginx-proxy.conf"

# cacheguard_config PORT ADMIN_PORT L1_MAX_BYTES: the embedded-mode config from issue #2.
cacheguard_config() {
    cat <<EOF
[server]
listen = "127.0.0.1:$1"

[upstream]
url = "http://127.0.0.1:$ORIGIN_PORT"
max_concurrency = 256

[admin]
listen = "127.0.0.1:$2"   # /metrics, /healthz

[cache]
ttl = "600s"
l1_max_bytes = $3

[[routes]]
name = "item"
match = "/items/{id}"
EOF
}

# start_cacheguard NAME PORT ADMIN_PORT L1_MAX_BYTES: sets LAST_PID.
start_cacheguard() {
    local name=$1 conf="$OUT/$1.toml"
    cacheguard_config "$2" "$3" "$4" >"$conf"
    "$CG_BIN" --check-config "$conf" >&2 || die "cacheguard --check-config $conf failed"
    start_bg "$OUT/$name.log" "$CG_BIN" --config "$conf"
    wait_http "http://127.0.0.1:$3/healthz" "$LAST_PID" "cacheguard ($name)"
}

start_cacheguard cacheguard "$CG_PORT" "$CG_ADMIN_PORT" "$HIT_L1_MAX_BYTES"
CG_PID=$LAST_PID

size=$(curl -s -o /dev/null -w '%{size_download}' "http://127.0.0.1:$ORIGIN_PORT$KEY")
[[ $size == "$BODY_BYTES" ]] || die "origin body is $size bytes, expected $BODY_BYTES"

declare -A URL=(
    [static]="http://127.0.0.1:$ORIGIN_PORT$KEY"
    [nginx]="http://127.0.0.1:$NGINX_PORT$KEY"
    [cacheguard]="http://127.0.0.1:$CG_PORT$KEY"
)
declare -A LABEL=(
    [static]="nginx static \`return 200\` (direct, no proxy)"
    [nginx]="nginx proxy_cache HIT"
    [cacheguard]="cacheguard HIT-L1"
)
declare -A HIT=([static]="" [nginx]="HIT" [cacheguard]="HIT-L1")

log "warming $KEY"
warm "${URL[nginx]}" HIT
warm "${URL[cacheguard]}" HIT-L1
for t in static nginx cacheguard; do
    curl -s -o /dev/null -D "$OUT/headers-$t.txt" "${URL[$t]}"
    size=$(curl -s -o /dev/null -w '%{size_download}' "${URL[$t]}")
    [[ $size == "$BODY_BYTES" ]] || die "$t answered $size body bytes, expected $BODY_BYTES"
done

origin_requests() {
    curl -s --max-time 5 "http://127.0.0.1:$ORIGIN_PORT/nginx_status" |
        awk 'NR == 3 { print $3 }'
}

RAW=$OUT/raw.tsv
printf 'section\ttarget\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\torigin_requests\tx_cache_after\n' >"$RAW"

# run_wrk SECTION TARGET REP WRK_ARGS...: one wrk run, parsed into raw.tsv.
run_wrk() {
    local section=$1 target=$2 rep=$3
    shift 3
    local file="$OUT/wrk-$section-$target-rep$rep.txt" before after xc=""
    before=$(origin_requests)
    log "$section rep $rep/$REPS: $target: wrk $* ${URL[$target]}"
    echo "# wrk $* ${URL[$target]}" >"$file"
    # in the background + wait, so a signal reaches our EXIT trap at once (and wrk is stopped)
    start_bg "$file.part" wrk "$@" "${URL[$target]}"
    local wrk_pid=$LAST_PID wrk_rc=0
    wait "$wrk_pid" || wrk_rc=$?
    forget_pid "$wrk_pid"
    cat "$file.part" >>"$file" && rm -f "$file.part"
    ((wrk_rc == 0)) || die "wrk failed ($wrk_rc) for $target; see $file"
    after=$(origin_requests)
    if [[ -n ${HIT[$target]} ]]; then
        xc=$(x_cache "${URL[$target]}")
        [[ $xc == "${HIT[$target]}" ]] || log "WARNING: $target answered X-Cache '$xc' after the run"
    fi
    local parsed
    parsed=$(wrk_parse "$file") || die "cannot parse wrk output $file"
    read -r rps p50 p99 max reqs errs non2xx <<<"$parsed"
    ((errs == 0 && non2xx == 0)) || log "WARNING: $target: $errs socket errors, $non2xx non-2xx responses (see $file)"
    # the two stub_status reads themselves count as origin requests: subtract them;
    # for the static target the origin is the target
    local origin="-"
    if [[ $target != static ]]; then origin=$((after - before - 1)); fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$section" "$target" "$rep" \
        "$rps" "$p50" "$p99" "$max" "$reqs" "$errs" "$non2xx" "$origin" "${xc:--}" >>"$RAW"
    printf '  %-10s %12s req/s  p50 %7.3f ms  p99 %7.3f ms\n' "$target" "$rps" "$p50" "$p99" >&2
}

# rotate N WORD...: WORD list rotated left by N (so each rep starts with another target).
rotate() {
    local n=$1
    shift
    local a=("$@") k=${#a[@]} i
    for ((i = 0; i < k; i++)); do printf '%s ' "${a[(i + n) % k]}"; done
}

# --- a. throughput ---------------------------------------------------------------------

for ((rep = 1; rep <= REPS; rep++)); do
    for t in $(rotate $((rep - 1)) static nginx cacheguard); do
        run_wrk throughput "$t" "$rep" -t2 -c64 -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency
    done
done

# --- b. latency at moderate load -------------------------------------------------------

for ((rep = 1; rep <= REPS; rep++)); do
    # shellcheck disable=SC2086 # word splitting of LAT_TARGETS is intended
    for t in $(rotate $((rep - 1)) $LAT_TARGETS); do
        run_wrk latency "$t" "$rep" -t1 -c8 -d"$LAT_DURATION" --timeout "$WRK_TIMEOUT" --latency
    done
done

curl -s "http://127.0.0.1:$CG_ADMIN_PORT/metrics" >"$OUT/metrics-hit.txt" || true
CG_HIT_HWM_KB=$(proc_kb "$CG_PID" VmHWM)
CG_HIT_RSS_KB=$(proc_kb "$CG_PID" VmRSS)

# free the CPU for the memory run: only the origin keeps running
stop_pid "$NGINX_PID"
stop_pid "$CG_PID"

# --- c. memory under 1M distinct keys --------------------------------------------------

start_cacheguard cacheguard-mem "$CGM_PORT" "$CGM_ADMIN_PORT" "$MEM_L1_MAX_BYTES"
CGM_PID=$LAST_PID
URL[mem]="http://127.0.0.1:$CGM_PORT"
RSS_START_KB=$(proc_kb "$CGM_PID" VmRSS)

RSS_FILE=$OUT/rss.tsv
printf 'elapsed_s\tvmrss_kb\tvmhwm_kb\n' >"$RSS_FILE"
SAMPLER_STOP=$BENCH_TMP/sampler.stop
(
    t0=$(date +%s.%N)
    while [[ ! -e $SAMPLER_STOP ]] && kill -0 "$CGM_PID" 2>/dev/null; do
        now=$(date +%s.%N)
        printf '%.1f\t%s\t%s\n' "$(awk -v a="$now" -v b="$t0" 'BEGIN { print a - b }')" \
            "$(proc_kb "$CGM_PID" VmRSS)" "$(proc_kb "$CGM_PID" VmHWM)" >>"$RSS_FILE"
        sleep 1
    done
) &
SAMPLER_PID=$!
BENCH_PIDS+=("$SAMPLER_PID")

origin_before=$(origin_requests)
MEM_WRK=$OUT/wrk-memory-distinct.txt
log "memory: $DISTINCT_KEYS distinct keys through cacheguard (l1_max_bytes=$MEM_L1_MAX_BYTES), at most $DISTINCT_MAX_DURATION"
echo "# wrk -t2 -c64 -d$DISTINCT_MAX_DURATION --timeout $WRK_TIMEOUT --latency -s bench/distinct.lua ${URL[mem]} -- $DISTINCT_KEYS 2 <done_dir>" >"$MEM_WRK"
DONE_DIR=$BENCH_TMP/distinct-done
mkdir -p "$DONE_DIR"
mem_t0=$SECONDS
start_bg "$MEM_WRK.part" wrk -t2 -c64 -d"$DISTINCT_MAX_DURATION" --timeout "$WRK_TIMEOUT" --latency \
    -s bench/distinct.lua "${URL[mem]}" -- "$DISTINCT_KEYS" 2 "$DONE_DIR"
WRK_PID=$LAST_PID
# wait until both wrk threads have their quota (or wrk ends by itself at -d), then SIGINT
while kill -0 "$WRK_PID" 2>/dev/null; do
    if [[ -e $DONE_DIR/thread-0.done && -e $DONE_DIR/thread-1.done ]]; then
        kill -INT "$WRK_PID" 2>/dev/null || true
        break
    fi
    sleep 0.2
done
wrk_rc=0
wait "$WRK_PID" || wrk_rc=$?
forget_pid "$WRK_PID"
cat "$MEM_WRK.part" >>"$MEM_WRK" && rm -f "$MEM_WRK.part"
((wrk_rc == 0)) || die "wrk (distinct keys) exited with $wrk_rc; see $MEM_WRK"
mem_secs=$((SECONDS - mem_t0))
origin_after=$(origin_requests)
MEM_ORIGIN=$((origin_after - origin_before - 1))
sleep 2 # let the sampler take a settled sample

dline=$(grep '^distinct:' "$MEM_WRK") || die "no 'distinct:' line in $MEM_WRK"
kv() { sed -n "s/.* $1=\([0-9.]*\).*/\1/p" <<<"$dline"; }
MEM_SENT=$(kv sent)
MEM_RECEIVED=$(kv received)
MEM_NON200=$(kv non200)
MEM_RPS=$(awk '/^Requests\/sec:/ { printf "%.0f", $2 }' "$MEM_WRK")
MEM_OK=yes
((MEM_RECEIVED >= DISTINCT_KEYS)) || {
    MEM_OK=no
    log "WARNING: only $MEM_RECEIVED of $DISTINCT_KEYS distinct-key requests completed within $DISTINCT_MAX_DURATION"
}

curl -s "http://127.0.0.1:$CGM_ADMIN_PORT/metrics" >"$OUT/metrics-memory.txt" ||
    die "cannot read cacheguard /metrics after the memory run"
metric() { awk -v m="$1" '$1 == m { printf "%.0f", $2 }' "$OUT/metrics-memory.txt"; }
L1_BYTES=$(metric cacheguard_l1_bytes)
L1_ENTRIES=$(metric cacheguard_l1_entries)
MEM_FINAL_RSS_KB=$(proc_kb "$CGM_PID" VmRSS)
MEM_PEAK_HWM_KB=$(proc_kb "$CGM_PID" VmHWM)
MEM_MAX_SAMPLED_RSS_KB=$(awk 'NR > 1 && $2 > m { m = $2 } END { print m + 0 }' "$RSS_FILE")
touch "$SAMPLER_STOP"
wait "$SAMPLER_PID" 2>/dev/null || true
forget_pid "$SAMPLER_PID"
MEM_BOUND_KB=$(((MEM_L1_MAX_BYTES + 64 * 1048576) / 1024))

LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load_end: $LOAD_END" >>"$OUT/env.txt"
WALL=$((SECONDS - started_at))

# --- summary ---------------------------------------------------------------------------

col() { # col SECTION TARGET FIELD_NO: the values of one raw.tsv column
    awk -F'\t' -v s="$1" -v t="$2" -v f="$3" '$1 == s && $2 == t { print $f }' "$RAW"
}
mib() { awk -v k="$1" 'BEGIN { printf "%.1f MiB", k / 1024 }'; }
verdict() { if [[ $1 == 1 ]]; then echo "**met**"; else echo "**MISSED**"; fi; }

# throughput medians and ratios
declare -A RPS_MED P99_MED P50_MED
for s in throughput latency; do
    for t in static nginx cacheguard; do
        RPS_MED[$s.$t]=$(median $(col "$s" "$t" 4))
        P50_MED[$s.$t]=$(median $(col "$s" "$t" 5))
        P99_MED[$s.$t]=$(median $(col "$s" "$t" 6))
    done
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0 && a + 0 > 0) printf "%.2f", a / b; else printf "–" }'; }
# per-rep paired ratios cacheguard / nginx (same rep)
paired() { # paired SECTION FIELD OP(ratio|diff) A B
    paste <(col "$1" "$4" "$2") <(col "$1" "$5" "$2") |
        awk -v op="$3" '{ if (op == "ratio") print $1 / $2; else print $1 - $2 }'
}
R_CG_NGINX=$(ratio "${RPS_MED[throughput.cacheguard]}" "${RPS_MED[throughput.nginx]}")
read -r _ R_MIN R_MAX < <(stats $(paired throughput 4 ratio cacheguard nginx))
R_MIN=$(LC_ALL=C printf '%.2f' "$R_MIN")
R_MAX=$(LC_ALL=C printf '%.2f' "$R_MAX")
ADDED_P99=$(awk -v a="${P99_MED[latency.cacheguard]}" -v b="${P99_MED[latency.static]}" 'BEGIN { printf "%.3f", a - b }')
read -r _ D_MIN D_MAX < <(stats $(paired latency 6 diff cacheguard static))
D_MIN=$(LC_ALL=C printf '%.3f' "$D_MIN")
D_MAX=$(LC_ALL=C printf '%.3f' "$D_MAX")
ADDED_P50=$(awk -v a="${P50_MED[latency.cacheguard]}" -v b="${P50_MED[latency.static]}" 'BEGIN { printf "%.3f", a - b }')

T1=$(awk -v r="$R_CG_NGINX" 'BEGIN { print (r >= 1.0) ? 1 : 0 }')
T2=$(awk -v d="$ADDED_P99" 'BEGIN { print (d < 1.0) ? 1 : 0 }')
T3=$(awk -v h="$MEM_PEAK_HWM_KB" -v b="$MEM_BOUND_KB" -v ok="$MEM_OK" 'BEGIN { print (h <= b && ok == "yes") ? 1 : 0 }')

section_table() { # section_table SECTION TARGET...
    local s=$1 t
    shift
    echo "| target | req/s | p50 ms | p99 ms | max ms | ×nginx proxy_cache req/s | origin requests |"
    echo "|---|---|---|---|---|---|---|"
    for t in "$@"; do
        [[ -n $(col "$s" "$t" 4) ]] || continue
        printf '| %s | %s | %s | %s | %s | %s | %s |\n' "${LABEL[$t]}" \
            "$(cell int $(col "$s" "$t" 4))" "$(cell ms $(col "$s" "$t" 5))" \
            "$(cell ms $(col "$s" "$t" 6))" "$(LC_ALL=C printf '%.2f' "$(stats $(col "$s" "$t" 7) | awk '{ print $3 }')")" \
            "$(ratio "${RPS_MED[$s.$t]}" "${RPS_MED[$s.nginx]}")" \
            "$(col "$s" "$t" 11 | paste -sd/)"
    done
}

{
    echo "# cacheguard hit path (issue #2): $STAMP"
    echo
    echo "Each cell is **median (min–max) over $REPS runs**; targets alternate within each rep."
    echo "All processes on 127.0.0.1 on the same $(nproc) cores: wrk, the proxy and the origin compete for CPU."
    echo "Load average (1/5/15 min) at start: $LOAD_START; at end: $LOAD_END. Wall time: ${WALL} s."
    echo
    echo "| item | value |"
    echo "|---|---|"
    sed -n 's/^\([a-z_]*\): \(.*\)$/| \1 | \2 |/p' "$OUT/env.txt"
    echo
    echo "## a. Throughput: \`wrk -t2 -c64 -d$DURATION --timeout $WRK_TIMEOUT --latency\`, one warmed 1 KiB key ($KEY)"
    echo
    section_table throughput static nginx cacheguard
    echo
    echo "- cacheguard / nginx proxy_cache hit req/s: **$R_CG_NGINX** (median of each; per-rep paired ratios $R_MIN–$R_MAX). Target ≥ 1.0: $(verdict "$T1")."
    echo "- cacheguard / static nginx: $(ratio "${RPS_MED[throughput.cacheguard]}" "${RPS_MED[throughput.static]}"); nginx proxy_cache / static nginx: $(ratio "${RPS_MED[throughput.nginx]}" "${RPS_MED[throughput.static]}")."
    echo "- origin requests = requests that reached the origin during each run (per rep, from its stub_status counter); 0 means every request was a cache hit."
    echo
    echo "## b. Hit-path latency at moderate load: \`wrk -t1 -c8 -d$LAT_DURATION --timeout $WRK_TIMEOUT --latency\`"
    echo
    echo "wrk has no fixed-rate mode; 1 thread and 8 connections is the moderate load used instead (closed loop, so"
    echo "the request rate is whatever each target sustains with 8 requests in flight)."
    echo
    # shellcheck disable=SC2086
    section_table latency $LAT_TARGETS
    echo
    echo "- p99 added by cacheguard HIT-L1 over the direct static response: **$ADDED_P99 ms** (median p99 minus median p99; per-rep paired $D_MIN–$D_MAX ms). Target < 1 ms: $(verdict "$T2")."
    echo "- p50 added: $ADDED_P50 ms."
    echo
    echo "## c. Memory: cacheguard, \`l1_max_bytes = $MEM_L1_MAX_BYTES\` ($(mib $((MEM_L1_MAX_BYTES / 1024)))), $DISTINCT_KEYS distinct keys"
    echo
    echo "\`wrk -t2 -c64 -d$DISTINCT_MAX_DURATION -s bench/distinct.lua\`: every request is a new key (\`/items/<n>\`), so every request is a miss that goes to the origin and is stored in L1."
    echo
    echo "| item | value |"
    echo "|---|---|"
    echo "| requests completed / sent | $MEM_RECEIVED / $MEM_SENT (non-200: $MEM_NON200) in ${mem_secs} s, $(fmt_int "$MEM_RPS") req/s |"
    echo "| origin requests during the run | $MEM_ORIGIN |"
    echo "| VmRSS at start (idle) | $(mib "$RSS_START_KB") |"
    echo "| max sampled VmRSS (1 s samples, \`rss.tsv\`) | $(mib "$MEM_MAX_SAMPLED_RSS_KB") |"
    echo "| **peak VmHWM** | **$(mib "$MEM_PEAK_HWM_KB")** |"
    echo "| final VmRSS | $(mib "$MEM_FINAL_RSS_KB") |"
    echo "| bound: l1_max_bytes + 64 MiB | $(mib "$MEM_BOUND_KB") |"
    echo "| \`cacheguard_l1_bytes\` at the end | $L1_BYTES ($(mib $((L1_BYTES / 1024)))) |"
    echo "| \`cacheguard_l1_entries\` at the end | $L1_ENTRIES |"
    echo
    echo "- Peak VmHWM ≤ l1_max_bytes + 64 MiB at $DISTINCT_KEYS distinct keys: $(verdict "$T3")."
    echo "- For reference, the hit-path instance (l1_max_bytes = 256 MiB, one key) after sections a and b: VmHWM $(mib "$CG_HIT_HWM_KB"), VmRSS $(mib "$CG_HIT_RSS_KB")."
    echo
    echo "## Issue #2 targets"
    echo
    echo "| target | result | |"
    echo "|---|---|---|"
    echo "| cacheguard hit req/s ≥ 1.0× nginx proxy_cache hit | $R_CG_NGINX× | $(verdict "$T1") |"
    echo "| p99 added over direct static < 1 ms (wrk -t1 -c8) | $ADDED_P99 ms | $(verdict "$T2") |"
    echo "| RSS ≤ l1_max_bytes + 64 MiB at $DISTINCT_KEYS distinct keys | peak VmHWM $(mib "$MEM_PEAK_HWM_KB") vs $(mib "$MEM_BOUND_KB") | $(verdict "$T3") |"
    echo
    echo "Raw data: \`bench/results/$STAMP/\` (wrk outputs, raw.tsv, rss.tsv, metrics, configs, response headers)."
} >"$OUT/summary.md"

cat "$OUT/summary.md"
log "done in ${WALL} s; results in $OUT"
