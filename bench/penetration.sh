#!/usr/bin/env bash
# Penetration benchmark (Bloom filters), in one run on this machine:
#
#   origin   bench/tools `bench-origin`: ids 1..=100000 exist (GET /items/{id} -> 1024 bytes of
#            JSON after DELAY_MS, 404 after the same delay otherwise), request counters at
#            /stats, and GET /internal/ids (every existing id, one per line, streamed)
#   cacheguard  release build, embedded mode (no Redis): `[[bloom]] items` (expected_items
#            100000, fp_rate 0.01, refresh "0s" = loaded once, source url "/internal/ids")
#            and the read route /items/{id} with `bloom = { filter = "items", param = "id" }`
#   peers    nginx 1.22 proxy_cache (bench/nginx.conf.tmpl) and Varnish 7.1
#            (bench/varnish.vcl.tmpl) in front of the same origin
#
#   a. attack      N (100,000) distinct random non-existent ids (ATTACK_SEED, in
#                  1e9..2e9-1, so none exists), the same list in the same order for every
#                  target: bench/tools `loadgen list`, every id GET once at full speed over
#                  ATTACK_CONNECTIONS (64) keep-alive connections. Per target: answers,
#                  X-Cache, requests that reached the origin (bench-origin /stats, reset
#                  before each target), answers/s. For cacheguard the ids that were not
#                  rejected (the false positives) are written to passed-ids.txt.
#   b. throughput  `wrk -t2 -c64 -d10s --latency -s bench/id_list.lua`, REPS reps, targets
#                  rotating: cacheguard REJECT (the attack ids cacheguard rejected in a, cycled),
#                  cacheguard HIT-L1, nginx HIT and Varnish HIT (HIT_IDS existing ids, warmed,
#                  cycled). Same client, same script, same settings for every row.
#   c. memory      bits/bytes/hash functions from GET /admin/bloom vs the theoretical
#                  m = -n·ln(p)/(ln 2)² bits; VmRSS/VmHWM of an idle cacheguard with the
#                  filter loaded vs an idle one with the same config minus the filter
#                  (started first, then stopped).
#
# usage: bash bench/penetration.sh
# env:   N=100000 ATTACK_SEED=4 ATTACK_CONNECTIONS=64 DELAY_MS=50 REPS=3 DURATION=10s
#        HIT_IDS=8 ATTACK_MAX_S=300 (per target; the rest of the list counts as unsent)
#        BLOOM_READY_TIMEOUT_S=60 BASE_PORT=29280 (uses BASE_PORT+1 .. +7)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx/varnish dirs)
#
# Writes bench/results/penetration-<UTC timestamp>/ (the id lists, loadgen JSON per attack,
# wrk outputs, raw.tsv, origin stats, /admin/bloom, cacheguard configs, logs and /metrics,
# summary.md) and prints the markdown summary on stdout. Every process it starts is stopped
# on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults N=100000 ATTACK_SEED=4 ATTACK_CONNECTIONS=64 ATTACK_MAX_S=300 REPS=3 DURATION=10s HIT_IDS=8 \
    BLOOM_READY_TIMEOUT_S=60 BASE_PORT=29280
# 50 ms, the same delay for every target. Every request that reaches the origin
# holds a connection for this long, so a peer's pass takes about N × DELAY_MS /
# ATTACK_CONNECTIONS (≈ 78 s with the defaults); DELAY_MS=200 (bench/stampede.sh) ≈ 5 min.
bench_defaults DELAY_MS=50
MAX_ID=100000
FP_RATE=0.01
WRK_TIMEOUT=10s
LOADGEN_TIMEOUT_S=10

bench_ports ORIGIN_PORT NGINX_PORT VARNISH_PORT CG_PORT CG_ADMIN_PORT CG0_PORT CG0_ADMIN_PORT

require_positive N ATTACK_SEED ATTACK_CONNECTIONS ATTACK_MAX_S DELAY_MS REPS HIT_IDS BLOOM_READY_TIMEOUT_S
((N <= 100000000)) || die "N must be at most 100,000,000 (ids are drawn from 1e9..2e9-1)"
((HIT_IDS <= MAX_ID)) || die "HIT_IDS must be at most $MAX_ID"
[[ $DURATION =~ ^[1-9][0-9]*s$ ]] || die "DURATION must be whole seconds, e.g. 10s (got '$DURATION')"

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish wrk:wrk curl:curl jq:jq
require_tools cargo awk sort comm mktemp id timeout
require_free_ports "${BENCH_PORTS[@]}"

build_bench_tools

build_cacheguard

bench_results penetration-

# --- environment -----------------------------------------------------------------------

write_env nginx varnishd wrk <<EOF
attack: $N distinct random non-existent ids (seed $ATTACK_SEED), $ATTACK_CONNECTIONS connections, loadgen list
origin_delay_ms: $DELAY_MS
throughput: wrk -t2 -c64 -d$DURATION, $REPS reps
bloom: expected_items $MAX_ID, fp_rate $FP_RATE, refresh 0s (loaded once)
EOF

# --- the id lists ----------------------------------------------------------------------

ATTACK_IDS=$OUT/attack-ids.txt
log "generating $N distinct random ids in 1000000000..1999999999 (awk srand($ATTACK_SEED))"
awk -v seed="$ATTACK_SEED" -v n="$N" 'BEGIN {
    srand(seed)
    while (c < n) {
        id = 1000000000 + int(rand() * 1000000000)
        if (!(id in seen)) { seen[id] = 1; print id; c++ }
    }
}' >"$ATTACK_IDS"
[[ $(sort -u "$ATTACK_IDS" | wc -l) == "$N" ]] || die "$ATTACK_IDS does not hold $N distinct ids"
HIT_IDS_FILE=$OUT/hit-ids.txt
seq 1 "$HIT_IDS" >"$HIT_IDS_FILE"

# --- origin ----------------------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" --delay-ms "$DELAY_MS" --max-id "$MAX_ID" --threads 2
check_origin_body "$ORIGIN/items/1?delay_ms=0" 1024
lines=$(curl -s --max-time 30 "$ORIGIN/internal/ids" | wc -l)
[[ $lines == "$MAX_ID" ]] || die "origin /internal/ids listed $lines ids, expected $MAX_ID"

# origin_stats FILE: save /stats; prints "total items_404 items_ok"
origin_stats() {
    save_origin_stats "$1"
    jq -r '"\(.total) \(.items_404) \(.items_ok)"' "$1"
}

# --- cacheguard ------------------------------------------------------------------------

# start_cacheguard NAME PORT ADMIN_PORT BLOOM(1|0): one instance in embedded mode with the Bloom
# filter "items" on the route; with BLOOM=0 the same config without the filter (the memory
# baseline). Sets LAST_PID.
start_cacheguard() {
    local bloom=()
    [[ $4 == 0 ]] || bloom=(bloom.name=items bloom.expected_items="$MAX_ID" bloom.fp_rate="$FP_RATE"
        bloom.refresh=0s bloom.source='{ url = "/internal/ids" }' route.bloom='{ filter = "items", param = "id" }')
    cg_config "$2" "$3" "$ORIGIN_PORT" upstream.max_concurrency=1024 upstream.queue_timeout=5s cache.ttl=600s \
        "${bloom[@]}" >"$OUT/$1.toml"
    launch_cacheguard "$1" "$OUT/$1.toml" "$2" "$3" "$OUT/$1.log"
}

# The memory baseline: the same config without the filter, idle, then stopped.
start_cacheguard cacheguard-nobloom "$CG0_PORT" "$CG0_ADMIN_PORT" 0
CG0_PID=$LAST_PID
sleep 2
RSS0_KB=$(proc_kb "$CG0_PID" VmRSS)
HWM0_KB=$(proc_kb "$CG0_PID" VmHWM)
stop_pid "$CG0_PID"
log "cacheguard without a filter, idle: VmRSS $RSS0_KB kB, VmHWM $HWM0_KB kB"

ADMIN=http://127.0.0.1:$CG_ADMIN_PORT
origin_reset
start_cacheguard cacheguard "$CG_PORT" "$CG_ADMIN_PORT" 1
CG_PID=$LAST_PID
log "waiting (at most $BLOOM_READY_TIMEOUT_S s) for GET /admin/bloom to report filter \"items\" ready"
deadline=$((SECONDS + BLOOM_READY_TIMEOUT_S))
while :; do
    kill -0 "$CG_PID" 2>/dev/null || die "cacheguard exited while loading its filter; see $OUT/cacheguard.log"
    code=$(curl -s -o "$OUT/admin-bloom.json" -w '%{http_code}' --max-time 2 "$ADMIN/admin/bloom" || true)
    if [[ $code == 200 ]] &&
        jq -e '.filters[] | select(.name == "items") | .ready == true' "$OUT/admin-bloom.json" >/dev/null 2>&1; then
        break
    fi
    ((SECONDS < deadline)) ||
        die "filter \"items\" not ready after $BLOOM_READY_TIMEOUT_S s (GET /admin/bloom: HTTP $code; see $OUT/admin-bloom.json and $OUT/cacheguard.log)"
    sleep 0.2
done
sleep 2 # settle: the load's buffers are freed
RSS1_KB=$(proc_kb "$CG_PID" VmRSS)
HWM1_KB=$(proc_kb "$CG_PID" VmHWM)
curl -s --max-time 5 "$ADMIN/admin/bloom" >"$OUT/admin-bloom.json" || die "cannot read /admin/bloom"
curl -s --max-time 5 "$ADMIN/readyz" >"$OUT/readyz.txt" || true
origin_stats "$OUT/origin-after-load.json" >/dev/null
IDS_LISTS=$(jq '.ids_lists' "$OUT/origin-after-load.json")
FILTER=$(jq -c '.filters[] | select(.name == "items")' "$OUT/admin-bloom.json")
fget() { jq -r "$1 // \"null\"" <<<"$FILTER"; }
F_BITS=$(fget .bits)
F_BYTES=$(fget .bytes)
F_K=$(fget .hash_functions)
F_ITEMS=$(fget .items)
F_EST_FP=$(fget .estimated_fp_rate)
F_LOADED_FROM=$(fget .loaded_from)
F_SOURCE=$(fget .source)
F_LOAD_MS=$(fget .last_load.duration_ms)
F_LOAD_LINES=$(fget .last_load.lines)
F_LOAD_SKIPPED=$(fget .last_load.skipped)
log "filter ready: items=$F_ITEMS bits=$F_BITS bytes=$F_BYTES k=$F_K est_fp=$F_EST_FP (load $F_LOAD_MS ms, $F_LOAD_LINES lines); VmRSS $RSS1_KB kB"
[[ $F_ITEMS == "$MAX_ID" ]] ||
    log "NOTE: /admin/bloom reports items=$F_ITEMS after reading $F_LOAD_LINES lines ($MAX_ID distinct ids)"

# --- peers -----------------------------------------------------------------------------

start_nginx_cache nginx "$NGINX_PORT" "nginx proxy_cache" "$OUT/nginx.conf" WORKERS=2 TTL=600s
start_varnish_cache varnish "$VARNISH_PORT" varnishd "$OUT/varnish.vcl" TTL=600s GRACE=10s

declare -A LABEL=(
    [cacheguard]="cacheguard (Bloom filter)"
    [nginx]="nginx 1.22 proxy_cache"
    [varnish]="Varnish 7.1"
)
declare -A HIT=([cacheguard]="HIT-L1" [nginx]="HIT" [varnish]="HIT")

# 20 absent ids (below the attack range) through cacheguard: with the filter loaded, all but
# about 1% of them are rejected at once. A sanity check before the attack.
curl -s -o /dev/null -D "$OUT/headers-reject.txt" "${URL_OF[cacheguard]}/items/999999999"
REJECT_PROBE=$(for id in $(seq 999999980 999999999); do x_cache "${URL_OF[cacheguard]}/items/$id"; done |
    sort | uniq -c | awk '{ printf "%s%s %d", (NR > 1 ? ", " : ""), $2, $1 }')
log "probe of 20 absent ids through cacheguard: X-Cache $REJECT_PROBE"

log "warming ids 1..$HIT_IDS on every proxy"
for t in cacheguard nginx varnish; do
    for ((id = 1; id <= HIT_IDS; id++)); do
        warm "${URL_OF[$t]}/items/$id" "${HIT[$t]}"
    done
    curl -s -o /dev/null -D "$OUT/headers-hit-$t.txt" "${URL_OF[$t]}/items/1"
done

# --- a. the attack -----------------------------------------------------------------------

ATTACK_RAW=$OUT/attack.tsv
printf 'target\tids\tsent\tunsent\tresponses\terrors\tstatus\tx_cache\torigin_requests\torigin_404\telapsed_s\trps\tp50_ms\tp99_ms\tmax_ms\n' >"$ATTACK_RAW"
PASSED_IDS=$OUT/passed-ids.txt

# run_attack TARGET: the whole id list once through TARGET with loadgen list.
run_attack() {
    local t=$1 json="$OUT/attack-$1.json" extra=()
    if [[ $t == cacheguard ]]; then
        extra=(--passed-out "$PASSED_IDS" --reject-x-cache REJECT)
        curl -s --max-time 5 "$ADMIN/metrics" >"$OUT/metrics-before-attack.txt" || true
    fi
    origin_reset
    log "attack: $N ids through $t (${URL_OF[$t]}), $ATTACK_CONNECTIONS connections, at most $ATTACK_MAX_S s"
    run_bg "$json" timeout --signal=TERM $((ATTACK_MAX_S + 60)) "$LOADGEN_BIN" list \
        --url "${URL_OF[$t]}/items/{id}" --ids-file "$ATTACK_IDS" --connections "$ATTACK_CONNECTIONS" \
        --timeout-s "$LOADGEN_TIMEOUT_S" --max-duration-s "$ATTACK_MAX_S" --threads 2 "${extra[@]}" ||
        die "loadgen list failed ($?) for $t; see $json"
    sleep 0.5 # anything still on its way to the origin
    local counts total o404 _ok
    counts=$(origin_stats "$OUT/origin-attack-$t.json")
    read -r total o404 _ok <<<"$counts"
    if [[ $t == cacheguard ]]; then
        curl -s --max-time 5 "$ADMIN/metrics" >"$OUT/metrics-after-attack.txt" || true
    fi
    local fields
    fields=$(jq -r '[.ids, .sent, .unsent, .responses, .errors,
        (.status | to_entries | map("\(.key)=\(.value)") | join(",")),
        (.x_cache | to_entries | map("\(.key)=\(.value)") | join(",")),
        .elapsed_s, .rps, .latency_ms.p50, .latency_ms.p99, .latency_ms.max] | @tsv' "$json") ||
        die "cannot parse $json"
    local ids sent unsent resp errs status xc elapsed rps p50 p99 mx
    IFS=$'\t' read -r ids sent unsent resp errs status xc elapsed rps p50 p99 mx <<<"$fields"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$ids" "$sent" "$unsent" \
        "$resp" "$errs" "$status" "$xc" "$total" "$o404" "$elapsed" "$rps" "$p50" "$p99" "$mx" >>"$ATTACK_RAW"
    printf '  %-10s origin %6s of %s  %9s answers/s in %7s s  status %s  X-Cache %s\n' \
        "$t" "$total" "$sent" "$rps" "$elapsed" "$status" "$xc" >&2
    ((unsent == 0 && errs == 0)) || log "WARNING: attack through $t: $unsent unsent, $errs errors (see $json)"
}

for t in cacheguard nginx varnish; do
    run_attack "$t"
done

# the ids cacheguard rejected in the attack: the list for the rejection-throughput runs
REJECTED_IDS=$OUT/rejected-ids.txt
awk 'NR == FNR { passed[$1] = 1; next } !($1 in passed)' "$PASSED_IDS" "$ATTACK_IDS" >"$REJECTED_IDS"
N_REJECTED=$(wc -l <"$REJECTED_IDS")
((N_REJECTED > 0)) || die "cacheguard rejected none of the attack ids; see $OUT/attack-cacheguard.json"

# --- b. rejection vs hit throughput ------------------------------------------------------

RAW=$OUT/raw.tsv
printf 'target\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\torigin_requests\n' >"$RAW"
declare -A WRK_BASE=(
    [cg_reject]=${URL_OF[cacheguard]} [cg_hit]=${URL_OF[cacheguard]}
    [nginx_hit]=${URL_OF[nginx]} [varnish_hit]=${URL_OF[varnish]}
)
declare -A WRK_IDS=(
    [cg_reject]=$REJECTED_IDS [cg_hit]=$HIT_IDS_FILE [nginx_hit]=$HIT_IDS_FILE [varnish_hit]=$HIT_IDS_FILE
)
declare -A WRK_LABEL=(
    [cg_reject]="cacheguard REJECT ($(fmt_int "$N_REJECTED") absent ids the filter rejected in a)"
    [cg_hit]="cacheguard HIT-L1 (ids 1–$HIT_IDS)"
    [nginx_hit]="nginx proxy_cache HIT (ids 1–$HIT_IDS)"
    [varnish_hit]="Varnish HIT (ids 1–$HIT_IDS)"
)
WRK_TARGETS="cg_reject cg_hit nginx_hit varnish_hit"
WRK_WARNINGS=()

# run_wrk TARGET REP: one wrk run, parsed into raw.tsv.
run_wrk() {
    local t=$1 rep=$2 file="$OUT/wrk-$1-rep$2.txt"
    local args=(-t2 -c64 -d"$DURATION" --timeout "$WRK_TIMEOUT" --latency -s bench/id_list.lua
        "${WRK_BASE[$t]}" -- "${WRK_IDS[$t]}" 2)
    origin_reset
    log "throughput rep $rep/$REPS: $t: wrk ${args[*]}"
    wrk_once "$file" "$t" "${args[@]}"
    local counts origin
    counts=$(origin_stats "$OUT/origin-wrk-$t-rep$rep.json")
    read -r origin _ <<<"$counts"
    local parsed rps p50 p99 mx reqs errs non2xx
    parsed=$(wrk_parse "$file") || die "cannot parse wrk output $file"
    read -r rps p50 p99 mx reqs errs non2xx <<<"$parsed"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "$rps" "$p50" "$p99" "$mx" \
        "$reqs" "$errs" "$non2xx" "$origin" >>"$RAW"
    printf '  %-12s %12s req/s  p50 %7.3f ms  p99 %7.3f ms  origin %s\n' "$t" "$rps" "$p50" "$p99" "$origin" >&2
    # a rejection run must be all 404s, a hit run all 200s, and neither may reach the origin
    local problems=()
    ((errs == 0)) || problems+=("$errs socket errors")
    if [[ $t == cg_reject ]]; then
        ((non2xx == reqs)) || problems+=("$((reqs - non2xx)) of $reqs answers were 2xx/3xx")
    else
        ((non2xx == 0)) || problems+=("$non2xx non-2xx answers")
    fi
    ((origin == 0)) || problems+=("$origin requests reached the origin")
    note_problems WRK_WARNINGS "$t rep $rep" " (see $file)" "${problems[@]}"
}

each_rep "$WRK_TARGETS" run_wrk

curl -s --max-time 5 "$ADMIN/metrics" >"$OUT/metrics-end.txt" || true
curl -s --max-time 5 "$ADMIN/admin/bloom" >"$OUT/admin-bloom-end.json" || true
RSS_END_KB=$(proc_kb "$CG_PID" VmRSS)
HWM_END_KB=$(proc_kb "$CG_PID" VmHWM)
LOG_WARN=$(grep -c -E 'WARN|ERROR' "$OUT/cacheguard.log" || true)

end_env

# --- summary ---------------------------------------------------------------------------

acol() { awk -F'\t' -v t="$1" -v f="$2" 'NR > 1 && $1 == t { print $f }' "$ATTACK_RAW"; }
col() { awk -F'\t' -v t="$1" -v f="$2" 'NR > 1 && $1 == t { print $f }' "$RAW"; }
# paired TARGET_A TARGET_B: per-rep ratios of req/s, A / B (same rep)
paired() {
    LC_ALL=C join <(awk -F'\t' -v t="$1" 'NR > 1 && $1 == t { print $2, $3 }' "$RAW" | LC_ALL=C sort -k1,1) \
        <(awk -F'\t' -v t="$2" 'NR > 1 && $1 == t { print $2, $3 }' "$RAW" | LC_ALL=C sort -k1,1) |
        awk '{ printf "%.4f\n", $2 / $3 }'
}
paired_range() { # "min–max" of the per-rep ratios
    # shellcheck disable=SC2046
    stats $(paired "$1" "$2") | awk '{ printf "%.2f–%.2f", $2, $3 }'
}

declare -A RPS_MED
for t in $WRK_TARGETS; do
    # shellcheck disable=SC2046
    RPS_MED[$t]=$(median $(col "$t" 3))
done
R_REJ_HIT=$(ratio "${RPS_MED[cg_reject]}" "${RPS_MED[cg_hit]}")
R_REJ_NGINX=$(ratio "${RPS_MED[cg_reject]}" "${RPS_MED[nginx_hit]}")
R_REJ_VARNISH=$(ratio "${RPS_MED[cg_reject]}" "${RPS_MED[varnish_hit]}")
R_HIT_NGINX=$(ratio "${RPS_MED[cg_hit]}" "${RPS_MED[nginx_hit]}")

CG_ORIGIN=$(acol cacheguard 9)
CG_SENT=$(acol cacheguard 3)
ORIGIN_LIMIT=$(awk -v p="$FP_RATE" -v n="$N" 'BEGIN { printf "%d", p * n }')
N_PASSED=$(wc -l <"$PASSED_IDS")
OBS_FP=$(awk -v a="$N_PASSED" -v n="$CG_SENT" 'BEGIN { if (n > 0) printf "%.4f", a / n; else print "–" }')
M_BEFORE=$OUT/metrics-before-attack.txt
M_AFTER=$OUT/metrics-after-attack.txt
D_REJECTIONS=$(mdelta "$M_BEFORE" "$M_AFTER" 'cacheguard_bloom_rejections_total{filter="items"}')
D_FALSE_POS=$(mdelta "$M_BEFORE" "$M_AFTER" 'cacheguard_bloom_false_positives_total{filter="items"}')

# theoretical size: m = -n ln p / (ln 2)^2 bits, and k = (m/n) ln 2
read -r M_THEORY K_THEORY < <(awk -v n="$MAX_ID" -v p="$FP_RATE" 'BEGIN {
    m = -n * log(p) / (log(2) ^ 2); printf "%.1f %.2f\n", m, m / n * log(2) }')
M_THEORY_BITS=$(awk -v m="$M_THEORY" 'BEGIN { printf "%d", (m == int(m)) ? m : int(m) + 1 }')
M_THEORY_BYTES=$(awk -v m="$M_THEORY_BITS" 'BEGIN { printf "%d", int((m + 7) / 8) }')
# the false-positive rate this filter's actual m and k give for n ids, (1 - e^(-kn/m))^k, and
# the origin count it predicts for the attack: binomial, N × fp ± sqrt(N × fp × (1 - fp))
read -r FP_EXACT EXP_ORIGIN EXP_SD < <(awk -v m="$F_BITS" -v k="$F_K" -v n="$MAX_ID" -v a="$N" 'BEGIN {
    if (m + 0 <= 0 || k + 0 <= 0) { print "– – –"; exit }
    f = (1 - exp(-k * n / m)) ^ k
    printf "%.5f %.0f %.0f\n", f, a * f, sqrt(a * f * (1 - f)) }')
R_BITS=$(awk -v b="$F_BITS" -v m="$M_THEORY" 'BEGIN { if (b + 0 > 0) printf "%.4f", b / m; else print "–" }')
R_BYTES=$(awk -v b="$F_BYTES" -v m="$M_THEORY" 'BEGIN { if (b + 0 > 0) printf "%.4f", b * 8 / m; else print "–" }')

T1=$(awk -v o="$CG_ORIGIN" -v l="$ORIGIN_LIMIT" -v s="$CG_SENT" -v n="$N" 'BEGIN { print (o <= l && s == n) ? 1 : 0 }')
T2=$(awk -v r="$R_REJ_HIT" 'BEGIN { print (r != "–" && r >= 1.0) ? 1 : 0 }')
T3=$(awk -v a="$R_BITS" -v b="$R_BYTES" 'BEGIN { print (a != "–" && b != "–" && a >= 0.95 && a <= 1.05 && b >= 0.95 && b <= 1.05) ? 1 : 0 }')

attack_table() {
    echo "| target | requests sent | answers (status) | X-Cache | **requests reaching the origin** | origin / N | time s | answers/s | p50 ms | p99 ms | max ms |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    local t
    for t in cacheguard nginx varnish; do
        [[ -n $(acol "$t" 1) ]] || continue
        printf '| %s | %s | %s (%s) | %s | **%s** | %s | %s | %s | %s | %s | %s |\n' "${LABEL[$t]}" \
            "$(fmt_int "$(acol "$t" 3)")" "$(fmt_int "$(acol "$t" 5)")" "$(acol "$t" 7 | sed 's/,/, /g')" \
            "$(acol "$t" 8 | sed 's/,/, /g')" "$(fmt_int "$(acol "$t" 9)")" \
            "$(awk -v o="$(acol "$t" 9)" -v n="$(acol "$t" 3)" 'BEGIN { if (n > 0) printf "%.4f", o / n; else print "–" }')" \
            "$(acol "$t" 11)" "$(fmt_int "$(acol "$t" 12)")" "$(acol "$t" 13)" "$(acol "$t" 14)" "$(acol "$t" 15)"
    done
}

wrk_table() {
    echo "| target | req/s | p50 ms | p99 ms | max ms | ×cacheguard HIT-L1 req/s | non-2xx / requests (all reps) | origin requests (per rep) |"
    echo "|---|---|---|---|---|---|---|---|"
    local t
    for t in $WRK_TARGETS; do
        [[ -n $(col "$t" 3) ]] || continue
        # shellcheck disable=SC2046
        printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "${WRK_LABEL[$t]}" \
            "$(cell int $(col "$t" 3))" "$(cell ms $(col "$t" 4))" "$(cell ms $(col "$t" 5))" \
            "$(LC_ALL=C printf '%.2f' "$(stats $(col "$t" 6) | awk '{ print $3 }')")" \
            "$(ratio "${RPS_MED[$t]}" "${RPS_MED[cg_hit]}")" \
            "$(fmt_int "$(col "$t" 9 | sum_lines)") / $(fmt_int "$(col "$t" 7 | sum_lines)")" \
            "$(col "$t" 10 | paste -sd/)"
    done
}

{
    echo "# cacheguard penetration (Bloom filters): $STAMP"
    echo
    echo "All processes on 127.0.0.1 on the same $(nproc) cores: the load generator, the proxies and the origin compete for CPU."
    env_summary
    echo
    echo "## a. Attack: $(fmt_int "$N") distinct random non-existent ids, each GET once at full speed"
    echo
    echo "\`loadgen list --connections $ATTACK_CONNECTIONS\` (closed loop, keep-alive), the same list (\`attack-ids.txt\`, ids in 1e9..2e9−1, awk \`srand($ATTACK_SEED)\`) in the same order for each target;"
    echo "origin delay $DELAY_MS ms; origin counters reset before each target. Latency is send → end of body."
    echo
    attack_table
    echo
    echo "- cacheguard: $(fmt_int "$N_PASSED") of $(fmt_int "$CG_SENT") ids passed the filter (observed false-positive rate $OBS_FP; \`/admin/bloom\` estimated_fp_rate $(LC_ALL=C printf '%.4f' "$F_EST_FP")); the origin saw $(fmt_int "$CG_ORIGIN")."
    echo "  For this filter's m = $(fmt_int "$F_BITS") bits and k = $F_K with $(fmt_int "$MAX_ID") ids, (1 − e^(−kn/m))^k = $FP_EXACT: about $EXP_ORIGIN ± $EXP_SD ids of $(fmt_int "$N") are expected to pass (binomial mean ± 1 sd)."
    echo "  Metric deltas over the attack: \`cacheguard_bloom_rejections_total\` +$D_REJECTIONS, \`cacheguard_bloom_false_positives_total\` +$D_FALSE_POS."
    echo "- cacheguard's answers/s here mixes $(fmt_int "$((CG_SENT - N_PASSED))") immediate rejections with $(fmt_int "$N_PASSED") false positives that each hold a connection for one origin round trip ($DELAY_MS ms); section b measures the rejections alone."
    echo "- nginx (\`proxy_cache_valid 200\`) and Varnish have no existence check: every distinct absent id is a miss that goes to the origin, so their pass is bounded by $ATTACK_CONNECTIONS connections × $DELAY_MS ms of origin time."
    echo
    echo "## b. Rejection vs hit throughput: \`wrk -t2 -c64 -d$DURATION --timeout $WRK_TIMEOUT --latency -s bench/id_list.lua\`"
    echo
    echo "Each cell is **median (min–max) over $REPS runs**; targets rotate within each rep. Every row uses the same wrk script (prepared requests cycled"
    echo "per thread). REJECT cycles the $(fmt_int "$N_REJECTED") attack ids cacheguard rejected in a (the filter is loaded once, refresh \"0s\", so they stay rejected);"
    echo "the HIT rows cycle ids 1–$HIT_IDS, warmed before the attack."
    echo
    wrk_table
    echo
    echo "- **cacheguard rejection / cacheguard HIT-L1: ${R_REJ_HIT}×** (medians; per-rep paired $(paired_range cg_reject cg_hit))."
    echo "- cacheguard rejection / nginx proxy_cache HIT: ${R_REJ_NGINX}× (per rep $(paired_range cg_reject nginx_hit)); / Varnish HIT: ${R_REJ_VARNISH}× (per rep $(paired_range cg_reject varnish_hit))."
    echo "- cacheguard HIT-L1 / nginx proxy_cache HIT in this run: ${R_HIT_NGINX}×."
    problem_items "- Every run: no socket errors; every REJECT answer a 404 and every HIT answer a 200; 0 origin requests." "" \
        "${WRK_WARNINGS[@]}"
    echo
    echo "## c. Memory: filter \"items\", n = $MAX_ID, p = $FP_RATE"
    echo
    echo "| item | value |"
    echo "|---|---|"
    echo "| theoretical m = −n·ln(p)/(ln 2)² | $M_THEORY bits ($(fmt_int "$M_THEORY_BITS") bits, $(fmt_int "$M_THEORY_BYTES") bytes) |"
    echo "| \`/admin/bloom\` bits | $(fmt_int "$F_BITS") (**${R_BITS}× m**) |"
    echo "| \`/admin/bloom\` bytes | $(fmt_int "$F_BYTES") (${R_BYTES}× m/8) |"
    echo "| hash functions (theoretical k = (m/n)·ln 2) | $F_K ($K_THEORY) |"
    echo "| items / estimated_fp_rate | $(fmt_int "$F_ITEMS") / $(LC_ALL=C printf '%.5f' "$F_EST_FP") (from $(fmt_int "$MAX_ID") distinct ids) |"
    echo "| load | from $F_LOADED_FROM ($F_SOURCE): $F_LOAD_LINES lines, $F_LOAD_SKIPPED skipped, $F_LOAD_MS ms; origin \`/internal/ids\` downloads: $IDS_LISTS |"
    echo "| VmRSS idle, same config without the filter | $(mib "$RSS0_KB") (VmHWM $(mib "$HWM0_KB")) |"
    echo "| VmRSS idle, filter loaded | $(mib "$RSS1_KB") (VmHWM $(mib "$HWM1_KB")); difference $(awk -v a="$RSS1_KB" -v b="$RSS0_KB" 'BEGIN { printf "%+d kB", a - b }') vs the filter's $(awk -v b="$F_BYTES" 'BEGIN { printf "%.0f kB", b / 1024 }') |"
    echo "| VmRSS / VmHWM at the end of the run | $(mib "$RSS_END_KB") / $(mib "$HWM_END_KB") |"
    echo
    echo "## Penetration targets"
    echo
    echo "| target | result | |"
    echo "|---|---|---|"
    echo "| origin sees ≤ fp_rate × N = $(fmt_int "$ORIGIN_LIMIT") of $(fmt_int "$N") absent ids (peers: all of them) | cacheguard $(fmt_int "$CG_ORIGIN"); nginx $(fmt_int "$(acol nginx 9)"); Varnish $(fmt_int "$(acol varnish 9)") | $(verdict "$T1") |"
    echo "| rejection throughput ≥ L1 hit throughput (wrk, same settings, median of $REPS) | ${R_REJ_HIT}× ($(fmt_int "${RPS_MED[cg_reject]}") vs $(fmt_int "${RPS_MED[cg_hit]}") req/s) | $(verdict "$T2") |"
    echo "| filter bits within 5% of m | ${R_BITS}× (bytes ${R_BYTES}×) | $(verdict "$T3") |"
    echo
    echo "cacheguard log: $LOG_WARN WARN/ERROR lines. Probe of 20 absent ids (999999980–999999999) before the attack: X-Cache $REJECT_PROBE."
    echo
    echo "Raw data: \`bench/results/penetration-$STAMP/\` (id lists, attack-*.json, wrk outputs, raw.tsv, attack.tsv, origin stats, /admin/bloom, configs, logs, /metrics)."
} >"$OUT/summary.md"

show_summary
