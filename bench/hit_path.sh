#!/usr/bin/env bash
# Hit-path benchmark, in one run on this machine:
#
#   origin   nginx `return 200` with 1024 bytes of JSON for /items/{id}; it is also the
#            "direct static response" reference
#   peers    nginx 1.22 proxy_cache (lock on, keep-alive upstream, 2 workers) and cacheguard
#            (release build, embedded mode), both in front of that origin
#   a. throughput  wrk -t2 -c64 -d10s --latency on one warmed 1 KiB key, REPS reps,
#                  targets alternating within each rep
#   b. latency     bench/tools `loadgen rate`: open loop at a fixed LAT_RATE (5,000 req/s, well
#                  under what every target sustains: section a's closed-loop rates are 10x+
#                  that), request i scheduled at start + i/rate over LAT_CONNECTIONS (16)
#                  keep-alive connections, latency from the *scheduled* send time (no
#                  coordinated omission), exact percentiles; LAT_DURATION (10 s) measured after
#                  LAT_WARMUP (1 s); REPS reps, targets alternating; cacheguard HIT-L1 vs direct
#                  static, reported as the per-rep paired p99 difference (median, min–max)
#   c. memory      cacheguard with l1_max_bytes = 64 MiB under 1,000,000 distinct keys
#                  (wrk + bench/distinct.lua), VmRSS/VmHWM sampled every second
#
# usage: bash bench/hit_path.sh
# env:   REPS=3 DURATION=10s DISTINCT_KEYS=1000000
#        DISTINCT_MAX_DURATION=180s MEM_L1_MAX_BYTES=67108864 BASE_PORT=28080 (uses BASE_PORT+1 .. +6)
#        LAT_RATE=5000 (req/s) LAT_CONNECTIONS=16 LAT_DURATION=10s LAT_WARMUP=1s
#        NGINX_WORKERS=2 CG_WORKERS=0 (nginx worker_processes; cacheguard server.worker_threads)
#        LAT_TARGETS="static cacheguard" (add nginx for nginx proxy_cache at the same rate too;
#        +REPS×(LAT_WARMUP+LAT_DURATION))
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx prefixes)
#
# Writes bench/results/<UTC timestamp>/ (raw wrk outputs, loadgen JSON per latency run,
# raw.tsv for section a, latency.tsv for section b, samples, summary.md) and prints
# the markdown summary on stdout. Every process it starts is stopped on exit, by PID.

# shellcheck disable=SC2046 # $(col ...) and friends: one value per line, split on purpose
set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults REPS=3 DURATION=10s LAT_RATE=5000 LAT_CONNECTIONS=16 LAT_DURATION=10s LAT_WARMUP=1s \
    DISTINCT_KEYS=1000000 DISTINCT_MAX_DURATION=180s BASE_PORT=28080 LAT_TARGETS="static cacheguard" \
    MEM_L1_MAX_BYTES=67108864
# Worker counts of the two proxies: nginx worker_processes (the peers' reference is 2) and
# cacheguard's server.worker_threads (0 = one per CPU). Compare like for like.
bench_defaults NGINX_WORKERS=2 CG_WORKERS=0
LAT_DRAIN_S=5
WRK_TIMEOUT=10s
BODY_BYTES=1024
HIT_L1_MAX_BYTES=268435456
KEY=/items/1

bench_ports ORIGIN_PORT NGINX_PORT CG_PORT CG_ADMIN_PORT CGM_PORT CGM_ADMIN_PORT

require_positive REPS LAT_CONNECTIONS DISTINCT_KEYS
for t in static cacheguard; do
    [[ " $LAT_TARGETS " == *" $t "* ]] || die "LAT_TARGETS must include $t (got '$LAT_TARGETS')"
done
check_list LAT_TARGETS "LAT_TARGETS entry" static nginx cacheguard
# secs D: "10s" / "10" / "1.5s" -> seconds as a plain number
secs() {
    [[ $1 =~ ^([0-9]+(\.[0-9]+)?)s?$ ]] || die "not a duration in seconds: '$1' (e.g. 10s)"
    printf '%s' "${BASH_REMATCH[1]}"
}
# shellcheck disable=SC2153 # set by bench_defaults
LAT_DURATION_S=$(secs "$LAT_DURATION")
# shellcheck disable=SC2153 # set by bench_defaults
LAT_WARMUP_S=$(secs "$LAT_WARMUP")
awk -v d="$LAT_DURATION_S" 'BEGIN { exit !(d > 0) }' || die "LAT_DURATION must be > 0"
if ! [[ $LAT_RATE =~ ^[0-9]+(\.[0-9]+)?$ ]] || ! awk -v r="$LAT_RATE" 'BEGIN { exit !(r > 0) }'; then
    die "LAT_RATE must be a positive number of req/s (got '$LAT_RATE')"
fi

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx wrk:wrk curl:curl jq:jq
require_tools cargo awk sort mktemp id timeout
require_free_ports "${BENCH_PORTS[@]}"

build_cacheguard

build_bench_tools

bench_results "" # bench/results/<UTC timestamp>

# --- environment -----------------------------------------------------------------------

write_env nginx wrk <<EOF
reps: $REPS
nginx_workers: $NGINX_WORKERS
cacheguard_worker_threads: $CG_WORKERS (0 = one per CPU)
duration: $DURATION (throughput, wrk); ${LAT_DURATION_S}s + ${LAT_WARMUP_S}s warm-up (latency, loadgen rate)
latency_load: $LAT_RATE req/s fixed rate (open loop) over $LAT_CONNECTIONS connections
distinct_keys: $DISTINCT_KEYS
EOF

# --- start the origin, nginx proxy_cache and cacheguard --------------------------------

BODY=$(static_body "$BODY_BYTES")

start_nginx origin bench/origin.conf.tmpl \
    WORKERS=2 PORT="$ORIGIN_PORT" STATIC_BODY="$BODY"
wait_http "http://127.0.0.1:$ORIGIN_PORT$KEY" "$LAST_PID" "origin nginx"
cp "$BENCH_TMP/nginx-origin/nginx.conf" "$OUT/nginx-origin.conf"

start_nginx_cache nginx "$NGINX_PORT" "nginx proxy_cache" "$OUT/nginx-proxy.conf" WORKERS="$NGINX_WORKERS" TTL=600s
NGINX_PID=$LAST_PID

# start_cacheguard NAME PORT ADMIN_PORT L1_MAX_BYTES: one instance with the embedded-mode config
# of the hit-path benchmark (worker_threads CG_WORKERS, 0 = one per CPU). Sets LAST_PID.
start_cacheguard() {
    cg_config "$2" "$3" "$ORIGIN_PORT" server.worker_threads="$CG_WORKERS" upstream.max_concurrency=256 \
        cache.ttl=600s cache.l1_max_bytes="$4" >"$OUT/$1.toml"
    launch_cacheguard "$1" "$OUT/$1.toml" "$2" "$3" "$OUT/$1.log"
}

start_cacheguard cacheguard "$CG_PORT" "$CG_ADMIN_PORT" "$HIT_L1_MAX_BYTES"
CG_PID=$LAST_PID

check_origin_body "http://127.0.0.1:$ORIGIN_PORT$KEY" "$BODY_BYTES"

declare -A URL=(
    [static]="http://127.0.0.1:$ORIGIN_PORT$KEY"
    [nginx]="${URL_OF[nginx]}$KEY"
    [cacheguard]="${URL_OF[cacheguard]}$KEY"
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
    check_answer "$t" "${URL[$t]}" "$OUT/headers-$t.txt" "$BODY_BYTES"
done

origin_requests() { stub_requests "$ORIGIN_PORT"; }

RAW=$OUT/raw.tsv
printf 'section\ttarget\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\torigin_requests\tx_cache_after\n' >"$RAW"

# run_wrk SECTION TARGET REP WRK_ARGS...: one wrk run, parsed into raw.tsv.
run_wrk() {
    local section=$1 target=$2 rep=$3
    shift 3
    local file="$OUT/wrk-$section-$target-rep$rep.txt" before after xc=""
    before=$(origin_requests)
    log "$section rep $rep/$REPS: $target: wrk $* ${URL[$target]}"
    wrk_once "$file" "$target" "$@" "${URL[$target]}"
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

# --- a. throughput ---------------------------------------------------------------------

# run_throughput TARGET REP: one section-a wrk run.
run_throughput() { run_wrk throughput "$1" "$2" -t2 -c64 -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency; }
each_rep "static nginx cacheguard" run_throughput

# --- b. latency at a fixed rate --------------------------------------------------------

LAT_ARGS=(--rate "$LAT_RATE" --connections "$LAT_CONNECTIONS" --duration-s "$LAT_DURATION_S"
    --warmup-s "$LAT_WARMUP_S" --drain-s "$LAT_DRAIN_S" --timeout-s 10 --threads 1)
# bound on one loadgen run: warm-up + duration + drain + connection set-up slack
LAT_BOUND_S=$(awk -v w="$LAT_WARMUP_S" -v d="$LAT_DURATION_S" -v r="$LAT_DRAIN_S" \
    'BEGIN { printf "%d", w + d + r + 30 }')
LAT_RAW=$OUT/latency.tsv
printf 'target\trep\trate\tconnections\tscheduled\tsent\tok\tnon2xx\terrors\tunsent\tunfinished\tachieved_rps\tp50_ms\tp90_ms\tp99_ms\tp999_ms\tmax_ms\tmean_ms\tsend_lag_p99_ms\tservice_p99_ms\treconnects\torigin_requests\texpected_hits\tx_cache_after\n' >"$LAT_RAW"
LAT_WARNINGS=()

# run_rate TARGET REP: one `loadgen rate` run, parsed into latency.tsv.
run_rate() {
    local target=$1 rep=$2
    local json="$OUT/loadgen-latency-$target-rep$rep.json" before after xc="" hits="-"
    before=$(origin_requests)
    log "latency rep $rep/$REPS: $target: loadgen rate ${LAT_ARGS[*]} --url ${URL[$target]}"
    loadgen_rate "$json" "$target" "$LAT_BOUND_S" --url "${URL[$target]}" "${LAT_ARGS[@]}"
    after=$(origin_requests)
    if [[ -n ${HIT[$target]} ]]; then
        xc=$(x_cache "${URL[$target]}")
        [[ $xc == "${HIT[$target]}" ]] || log "WARNING: $target answered X-Cache '$xc' after the run"
        hits=$(jq --arg h "${HIT[$target]}" '.x_cache[$h] // 0' "$json")
    fi
    local origin="-"
    if [[ $target != static ]]; then origin=$((after - before - 1)); fi
    local fields
    fields=$(jq -r '[.scheduled, .sent, .ok, .non_2xx, .errors, .unsent, .unfinished,
        .achieved_rate_rps, .latency_ms.p50, .latency_ms.p90, .latency_ms.p99, .latency_ms.p99_9,
        .latency_ms.max, .latency_ms.mean, .send_lag_ms.p99, .service_time_ms.p99, .reconnects]
        | @tsv' "$json")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$target" "$rep" "$LAT_RATE" "$LAT_CONNECTIONS" \
        "$fields" "$origin" "$hits" "${xc:--}" >>"$LAT_RAW"
    local achieved p50 p99 p999 mx lag problems
    read -r _ _ _ _ _ _ _ achieved p50 _ p99 p999 mx _ lag _ <<<"$fields"
    mapfile -t problems < <(rate_problems "$json" "$LAT_RATE" "${HIT[$target]}")
    note_problems LAT_WARNINGS "$target rep $rep" " (see $json)" "${problems[@]}"
    printf '  %-10s %9s req/s  p50 %7.3f  p99 %7.3f  p99.9 %7.3f  max %8.3f ms  (send lag p99 %.3f ms)\n' \
        "$target" "$achieved" "$p50" "$p99" "$p999" "$mx" "$lag" >&2
}

each_rep "$LAT_TARGETS" run_rate

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
mem_t0=$SECONDS
wrk_distinct "$MEM_WRK" "${URL[mem]}" "$DISTINCT_KEYS" "$DISTINCT_MAX_DURATION" "$BENCH_TMP/distinct-done"
mem_secs=$((SECONDS - mem_t0))
origin_after=$(origin_requests)
MEM_ORIGIN=$((origin_after - origin_before - 1))
sleep 2 # let the sampler take a settled sample

grep -q '^distinct:' "$MEM_WRK" || die "no 'distinct:' line in $MEM_WRK"
MEM_SENT=$(distinct_field "$MEM_WRK" sent)
MEM_RECEIVED=$(distinct_field "$MEM_WRK" received)
MEM_NON200=$(distinct_field "$MEM_WRK" non200)
MEM_RPS=$(awk '/^Requests\/sec:/ { printf "%.0f", $2 }' "$MEM_WRK")
MEM_OK=yes
((MEM_RECEIVED >= DISTINCT_KEYS)) || {
    MEM_OK=no
    log "WARNING: only $MEM_RECEIVED of $DISTINCT_KEYS distinct-key requests completed within $DISTINCT_MAX_DURATION"
}

curl -s "http://127.0.0.1:$CGM_ADMIN_PORT/metrics" >"$OUT/metrics-memory.txt" ||
    die "cannot read cacheguard /metrics after the memory run"
mem_metric() { awk -v m="$1" '$1 == m { printf "%.0f", $2 }' "$OUT/metrics-memory.txt"; }
L1_BYTES=$(mem_metric cacheguard_l1_bytes)
L1_ENTRIES=$(mem_metric cacheguard_l1_entries)
MEM_FINAL_RSS_KB=$(proc_kb "$CGM_PID" VmRSS)
MEM_PEAK_HWM_KB=$(proc_kb "$CGM_PID" VmHWM)
MEM_MAX_SAMPLED_RSS_KB=$(awk 'NR > 1 && $2 > m { m = $2 } END { print m + 0 }' "$RSS_FILE")
touch "$SAMPLER_STOP"
wait "$SAMPLER_PID" 2>/dev/null || true
forget_pid "$SAMPLER_PID"
MEM_BOUND_KB=$(((MEM_L1_MAX_BYTES + 64 * 1048576) / 1024))

end_env

# --- summary ---------------------------------------------------------------------------

col() { # col SECTION TARGET FIELD_NO: the values of one raw.tsv column
    awk -F'\t' -v s="$1" -v t="$2" -v f="$3" '$1 == s && $2 == t { print $f }' "$RAW"
}

# throughput medians and ratios
declare -A RPS_MED
for t in static nginx cacheguard; do
    RPS_MED[throughput.$t]=$(median $(col throughput "$t" 4))
done
# per-rep paired ratios cacheguard / nginx (same rep)
paired() { # paired SECTION FIELD OP(ratio|diff) A B
    paste <(col "$1" "$4" "$2") <(col "$1" "$5" "$2") |
        awk -v op="$3" '{ if (op == "ratio") print $1 / $2; else print $1 - $2 }'
}
R_CG_NGINX=$(ratio "${RPS_MED[throughput.cacheguard]}" "${RPS_MED[throughput.nginx]}")
read -r _ R_MIN R_MAX < <(stats $(paired throughput 4 ratio cacheguard nginx))
R_MIN=$(LC_ALL=C printf '%.2f' "$R_MIN")
R_MAX=$(LC_ALL=C printf '%.2f' "$R_MAX")

# section b (latency.tsv), columns by header name
lcol_by_rep() { # lcol_by_rep TARGET COLUMN: "rep value" lines of TARGET, sorted by rep
    awk -F'\t' -v t="$1" -v f="$2" '
        NR == 1 { for (i = 1; i <= NF; i++) if ($i == f) c = i; next }
        $1 == t { print $2, $c }' "$LAT_RAW" | sort -n -k1,1
}
lcol() { lcol_by_rep "$1" "$2" | awk '{ print $2 }'; } # lcol TARGET COLUMN: values in rep order
lsum() { lcol "$1" "$2" | awk '{ s += $1 } END { printf "%d", s }'; }
# lpaired COLUMN A B: per-rep differences A - B (same rep)
lpaired() {
    LC_ALL=C join <(lcol_by_rep "$2" "$1" | LC_ALL=C sort -k1,1) <(lcol_by_rep "$3" "$1" | LC_ALL=C sort -k1,1) |
        awk '{ printf "%.3f\n", $2 - $3 }'
}
# paired_cell COLUMN A B: "median (min–max)" of the per-rep paired differences, ms
paired_cell() { cell_dec 3 $(lpaired "$@"); }
read -r ADDED_P99 D_MIN D_MAX < <(stats $(lpaired p99_ms cacheguard static))
ADDED_P99=$(LC_ALL=C printf '%.3f' "$ADDED_P99")
D_MIN=$(LC_ALL=C printf '%.3f' "$D_MIN")
D_MAX=$(LC_ALL=C printf '%.3f' "$D_MAX")
# the rate as a share of the slowest latency target's section-a (closed-loop wrk) throughput
SLOWEST_T=""
SLOWEST_RPS=""
for t in $LAT_TARGETS; do
    r=${RPS_MED[throughput.$t]}
    if [[ -z $SLOWEST_RPS ]] || awk -v a="$r" -v b="$SLOWEST_RPS" 'BEGIN { exit !(a < b) }'; then
        SLOWEST_T=$t
        SLOWEST_RPS=$r
    fi
done
RATE_SHARE=$(awk -v r="$LAT_RATE" -v m="$SLOWEST_RPS" 'BEGIN { if (m > 0) printf "%.0f%%", 100 * r / m; else printf "?" }')

T1=$(awk -v r="$R_CG_NGINX" 'BEGIN { print (r >= 1.0) ? 1 : 0 }')
T2=$(awk -v d="$ADDED_P99" 'BEGIN { print (d < 1.0) ? 1 : 0 }')
T2_NOTE=""
((${#LAT_WARNINGS[@]} == 0)) || T2_NOTE=" (suspect: some latency runs were not clean, see section b)"
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

latency_table() { # latency_table TARGET...
    local t
    echo "| target | achieved req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | loadgen send lag p99 ms | errors / non-2xx / unsent | origin requests | X-Cache (all reps) |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    for t in "$@"; do
        [[ -n $(lcol "$t" p99_ms) ]] || continue
        printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "${LABEL[$t]}" \
            "$(cell int $(lcol "$t" achieved_rps))" \
            "$(cell_dec 3 $(lcol "$t" p50_ms))" "$(cell_dec 3 $(lcol "$t" p90_ms))" \
            "$(cell_dec 3 $(lcol "$t" p99_ms))" "$(cell_dec 3 $(lcol "$t" p999_ms))" \
            "$(cell_dec 3 $(lcol "$t" max_ms))" "$(cell_dec 3 $(lcol "$t" send_lag_p99_ms))" \
            "$(lsum "$t" errors) / $(lsum "$t" non2xx) / $(lsum "$t" unsent)" \
            "$(lcol "$t" origin_requests | paste -sd/)" \
            "$(jq -rs 'reduce (.[].x_cache | to_entries[]) as $e ({}; .[$e.key] += $e.value)
                | to_entries | map("\(.key) \(.value)") | join(", ")' "$OUT"/loadgen-latency-"$t"-rep*.json)"
    done
}

{
    echo "# cacheguard hit path: $STAMP"
    echo
    echo "Each cell is **median (min–max) over $REPS runs**; targets alternate within each rep."
    echo "All processes on 127.0.0.1 on the same $(nproc) cores: wrk, the proxy and the origin compete for CPU."
    env_summary
    echo
    echo "## a. Throughput: \`wrk -t2 -c64 -d$DURATION --timeout $WRK_TIMEOUT --latency\`, one warmed 1 KiB key ($KEY)"
    echo
    section_table throughput static nginx cacheguard
    echo
    echo "- cacheguard / nginx proxy_cache hit req/s: **$R_CG_NGINX** (median of each; per-rep paired ratios $R_MIN–$R_MAX). Target ≥ 1.0: $(verdict "$T1")."
    echo "- cacheguard / static nginx: $(ratio "${RPS_MED[throughput.cacheguard]}" "${RPS_MED[throughput.static]}"); nginx proxy_cache / static nginx: $(ratio "${RPS_MED[throughput.nginx]}" "${RPS_MED[throughput.static]}")."
    echo "- origin requests = requests that reached the origin during each run (per rep, from its stub_status counter); 0 means every request was a cache hit."
    echo
    echo "## b. Hit-path latency at a fixed rate: \`loadgen rate --rate $LAT_RATE --connections $LAT_CONNECTIONS --duration-s $LAT_DURATION_S --warmup-s $LAT_WARMUP_S\`"
    echo
    echo "Open loop (bench/tools \`loadgen rate\`): request i is scheduled at start + i/$LAT_RATE s and sent on the first free one"
    echo "of $LAT_CONNECTIONS keep-alive connections (a due request waits for a free connection). Latency runs from the request's"
    echo "*scheduled* send time to the end of its body, so waiting for a connection and the load generator's own lag count"
    echo "(no coordinated omission). Percentiles are exact (full sorted sample) over the $(fmt_int "$(awk -v r="$LAT_RATE" -v d="$LAT_DURATION_S" 'BEGIN { printf "%.0f", r * d }')") requests of the"
    echo "${LAT_DURATION_S} s measured part of each run; the ${LAT_WARMUP_S} s warm-up before it is not counted."
    echo "$(fmt_int "$LAT_RATE") req/s is well under saturation: $RATE_SHARE of the slowest target's section-a closed-loop rate"
    echo "(${LABEL[$SLOWEST_T]}, $(fmt_int "$SLOWEST_RPS") req/s), so on an otherwise idle machine every target has spare CPU"
    echo "and the tail is not a queue. Check the load averages above: other work on the box shows up in the tail."
    echo
    # shellcheck disable=SC2086
    latency_table $LAT_TARGETS
    echo
    echo "- **p99 added by cacheguard HIT-L1 over the direct static response: $ADDED_P99 ms** (median of the per-rep paired differences, cacheguard p99 − static p99 in the same rep; min–max $D_MIN–$D_MAX ms). Target < 1 ms: $(verdict "$T2")$T2_NOTE."
    echo "- p99.9 added: $(paired_cell p999_ms cacheguard static) ms; p90 added: $(paired_cell p90_ms cacheguard static) ms; p50 added: $(paired_cell p50_ms cacheguard static) ms (median (min–max) of the per-rep paired differences)."
    if [[ " $LAT_TARGETS " == *" nginx "* ]]; then
        echo "- For reference, nginx proxy_cache HIT over the direct static response: p99 $(paired_cell p99_ms nginx static) ms, p50 $(paired_cell p50_ms nginx static) ms; cacheguard over nginx proxy_cache: p99 $(paired_cell p99_ms cacheguard nginx) ms."
    fi
    echo "- loadgen send lag = scheduled → actual send time, part of every latency above (the load generator shares the $(nproc) cores). When its p99 is close to a target's p99, that tail belongs to the machine, not to the target."
    problem_items "- Every run: no errors, no non-2xx, nothing unsent, achieved rate ≥ 98% of $LAT_RATE req/s, every cache answer a hit." \
        "- **Runs that were not clean** (errors, non-2xx, unsent or unfinished requests, achieved rate < 98% of $LAT_RATE req/s, or answers that were not cache hits):" \
        "${LAT_WARNINGS[@]}"
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
    echo "## Hit-path targets"
    echo
    echo "| target | result | |"
    echo "|---|---|---|"
    echo "| cacheguard hit req/s ≥ 1.0× nginx proxy_cache hit | $R_CG_NGINX× | $(verdict "$T1") |"
    echo "| p99 added over direct static < 1 ms (fixed $(fmt_int "$LAT_RATE") req/s, $LAT_CONNECTIONS connections; median per-rep paired difference) | $ADDED_P99 ms ($D_MIN–$D_MAX) | $(verdict "$T2")$T2_NOTE |"
    echo "| RSS ≤ l1_max_bytes + 64 MiB at $DISTINCT_KEYS distinct keys | peak VmHWM $(mib "$MEM_PEAK_HWM_KB") vs $(mib "$MEM_BOUND_KB") | $(verdict "$T3") |"
    echo
    echo "Raw data: \`bench/results/$STAMP/\` (wrk outputs, raw.tsv, loadgen JSON per latency run, latency.tsv, rss.tsv, metrics, configs, response headers)."
} >"$OUT/summary.md"

show_summary
