#!/usr/bin/env bash
# Stampede benchmark, in one run on this machine:
#
#   origin   bench/tools `bench-origin`: GET /items/{id} -> exactly 1024 bytes of JSON after
#            DELAY_MS (200 ms), per-path request counters at /stats, max in-flight
#   peers    nginx 1.22 proxy_cache (`proxy_cache_lock on`, bench/nginx.conf.tmpl) and
#            Varnish 7.1 (bench/varnish.vcl.tmpl), each as one instance and as two
#            independent instances (two caches)
#   cacheguard  release build; shared mode (a redis-server started here) with 1 and 2
#            instances, and embedded mode (no Redis) with 1 instance for reference
#   load     bench/tools `loadgen stampede`: C keep-alive connections (split round-robin
#            over the instances), each warmed with one GET of an already-cached key, then one
#            GET of a cold key released on all of them at the same moment
#
# Matrix: C in CONCURRENCIES (100 1000) x TARGETS x REPS (3); a fresh cold key (new id) per
# run; origin counters reset before each run; targets rotate within each rep.
#
# usage: bash bench/stampede.sh
# env:   REPS=3 CONCURRENCIES="100 1000" DELAY_MS=200 BASE_PORT=29080 (uses BASE_PORT+1 .. +12)
#        TARGETS="direct nginx1 nginx2 varnish1 varnish2 cg1 cg2 cgemb1" (direct = the origin
#        itself, no cache: the floor of what this box, loadgen included, can do for C answers)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx/varnish/redis dirs)
#        RESULTS_DIR=dir (write the results there instead; bench/fleet_cost.sh runs this
#        script as a sub-step and reads its raw.tsv)
#
# Writes bench/results/stampede-<UTC timestamp>/ (loadgen JSON per run, origin stats,
# cacheguard logs and /metrics before/after each run, raw.tsv, summary.md) and prints the
# markdown summary on stdout. Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults REPS=3 CONCURRENCIES="100 1000" DELAY_MS=200 BASE_PORT=29080 \
    TARGETS="direct nginx1 nginx2 varnish1 varnish2 cg1 cg2 cgemb1"
TIMEOUT_S=30
WARM_PATH=/items/1
MAX_ID=100000
FIRST_COLD_ID=20001

bench_ports ORIGIN_PORT NGINX_A_PORT NGINX_B_PORT VARNISH_A_PORT VARNISH_B_PORT REDIS_PORT \
    CG_A_PORT CG_A_ADMIN CG_B_PORT CG_B_ADMIN CG_E_PORT CG_E_ADMIN

require_positive REPS DELAY_MS
require_positive_list CONCURRENCIES
check_list TARGETS target direct nginx1 nginx2 varnish1 varnish2 cg1 cg2 cgemb1

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish redis-server:redis-server redis-cli:redis-tools \
    curl:curl jq:jq
require_tools cargo awk sort mktemp id ss timeout
require_free_ports "${BENCH_PORTS[@]}"

# File descriptors: C=1000 needs ~1000 client sockets in the loadgen and as many in the proxy
# (plus its upstream sockets). Ask for 65536; a container without CAP_SYS_RESOURCE cannot
# raise the hard limit, so fall back to the hard limit.
# shellcheck disable=SC2086 # one C per word
require_fds_for_concurrency $CONCURRENCIES

build_bench_tools

build_cacheguard

bench_results stampede- runs

# --- environment -----------------------------------------------------------------------

write_env nginx varnishd redis <<EOF
reps: $REPS
concurrencies: $CONCURRENCIES
origin_delay_ms: $DELAY_MS
EOF

# --- origin ----------------------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" --delay-ms "$DELAY_MS" --max-id "$MAX_ID" --threads 2
URL_OF[origin]=$ORIGIN
PID_OF[origin]=$LAST_PID
check_origin_body "$ORIGIN/items/1?delay_ms=0" 1024

# --- nginx: two independent instances (own prefix, own cache dir) ----------------------

for inst in A B; do
    port_var=NGINX_${inst}_PORT
    start_nginx_cache "nginx$inst" "${!port_var}" "nginx $inst" "$OUT/nginx-$inst.conf" WORKERS=2 TTL=600s
done

# --- Varnish: two independent varnishd --------------------------------------------------

for inst in A B; do
    port_var=VARNISH_${inst}_PORT
    start_varnish_cache "varnish$inst" "${!port_var}" "varnishd $inst" "$OUT/varnish-$inst.vcl" TTL=600s GRACE=10s
done

# --- Redis and cacheguard ---------------------------------------------------------------

start_redis shared "$REDIS_PORT"

# start_cacheguard NAME PORT ADMIN_PORT SHARED(1|0): one instance with the stampede
# benchmark's config (lock_config; SHARED: with the Redis started here).
start_cacheguard() {
    local shared=()
    [[ $4 == 0 ]] || shared=(redis.url="redis://127.0.0.1:$REDIS_PORT" redis.command_timeout=200ms journal.path="journal-$2")
    lock_config "$2" "$3" "$ORIGIN_PORT" "${shared[@]}" >"$OUT/$1.toml"
    launch_cacheguard "$1" "$OUT/$1.toml" "$2" "$3" "$OUT/$1.log"
}
start_cacheguard cgA "$CG_A_PORT" "$CG_A_ADMIN" 1
start_cacheguard cgB "$CG_B_PORT" "$CG_B_ADMIN" 1
start_cacheguard cgE "$CG_E_PORT" "$CG_E_ADMIN" 0
CG_STARTED=$SECONDS

# The event bus must be live in both shared instances before a stampede means anything.
for inst in cgA cgB; do
    wait_bus "$inst" "${ADMIN_OF[$inst]}" "$OUT/metrics-$inst-start.txt"
done

# --- warm the connection-warming key on every instance ------------------------------------

for inst in nginxA nginxB varnishA varnishB cgA cgB cgE; do
    case $inst in
    nginx* | varnish*) warm "${URL_OF[$inst]}$WARM_PATH" HIT ;;
    cg*) warm "${URL_OF[$inst]}$WARM_PATH" HIT-L1 HIT-L2 ;;
    esac
    curl -s -o /dev/null -D "$OUT/headers-warm-$inst.txt" "${URL_OF[$inst]}$WARM_PATH"
done

# --- the runs ----------------------------------------------------------------------------

declare -A INSTANCES=(
    [direct]="origin"
    [nginx1]="nginxA" [nginx2]="nginxA nginxB"
    [varnish1]="varnishA" [varnish2]="varnishA varnishB"
    [cg1]="cgA" [cg2]="cgA cgB" [cgemb1]="cgE"
)
declare -A LABEL=(
    [direct]="origin direct, no cache (reference)"
    [nginx1]="nginx 1.22, lock on, 1 instance"
    [nginx2]="nginx 1.22, lock on, 2 instances"
    [varnish1]="Varnish 7.1, 1 instance"
    [varnish2]="Varnish 7.1, 2 instances"
    [cg1]="cacheguard shared (Redis), 1 instance"
    [cg2]="cacheguard shared (Redis), 2 instances"
    [cgemb1]="cacheguard embedded, 1 instance"
)

RAW=$OUT/raw.tsv
{
    printf 'c\ttarget\trep\tid\torigin_cold\torigin_total\torigin_max_inflight\tready\tcount\tok\tnon2xx\terrors'
    printf '\tsetup_failures\tp50_ms\tp99_ms\tmax_ms\tsend_skew_ms\tx_cache\tafter_x_cache\tlock_events\tlog_warnings\tcg_outcomes\n'
} >"$RAW"

next_id=$FIRST_COLD_ID

# outcome_delta BEFORE AFTER OUTCOME: the change of cacheguard_requests_total{outcome}
# between two /metrics dumps, summed over the routes.
outcome_delta() {
    local sum='index($1, "cacheguard_requests_total{outcome=\"" o "\"") == 1 { v += $2 } END { printf "%.0f", v + 0 }'
    echo $(($(awk -v o="$3" "$sum" "$2") - $(awk -v o="$3" "$sum" "$1")))
}

# run_one C TARGET REP: one stampede, parsed into raw.tsv.
run_one() {
    local c=$1 target=$2 rep=$3 id=$next_id
    next_id=$((next_id + 1))
    local path=/items/$id tag="c$c-$target-rep$rep" inst urls=() args=()
    for inst in ${INSTANCES[$target]}; do
        urls+=("${URL_OF[$inst]}$path")
        args+=(--url "${URL_OF[$inst]}$path")
    done
    # warm-up GET on each connection: an already-cached key; /stats (not counted) for the origin
    local warm_path=$WARM_PATH
    [[ $target == direct ]] && warm_path=/stats
    local is_cg=0
    [[ $target == cg* ]] && is_cg=1
    # shellcheck disable=SC2086 # one instance per word
    ((is_cg == 0)) || instances_before "$OUT/runs/$tag" ${INSTANCES[$target]}
    origin_reset

    local json=$OUT/runs/$tag.json
    log "C=$c rep $rep/$REPS: $target ($path): loadgen stampede ${urls[*]}"
    loadgen_stampede "$json" "$tag" "${args[@]}" --concurrency "$c" --timeout-s "$TIMEOUT_S" \
        --warm-path "$warm_path" --dump-latencies
    sleep 0.2 # anything still on its way to the origin
    save_origin_stats "$OUT/runs/$tag-origin.json"

    local origin_cold origin_total origin_max
    origin_cold=$(origin_path_count "$OUT/runs/$tag-origin.json" "$path")
    origin_total=$(jq '.total' "$OUT/runs/$tag-origin.json")
    origin_max=$(jq '.max_in_flight' "$OUT/runs/$tag-origin.json")

    # X-Cache of one more GET per instance: the cold key should now be cached everywhere
    local after=()
    for inst in ${INSTANCES[$target]}; do after+=("$(x_cache "${URL_OF[$inst]}$path")"); done

    local lock_events="-" log_warn="-" cg_outcomes="-"
    if ((is_cg)); then
        local parts=() resub sum_warn=0 mb ma misses=0 coalesced=0
        for inst in ${INSTANCES[$target]}; do
            mb=$OUT/runs/$tag-metrics-$inst-before.txt
            ma=$OUT/runs/$tag-metrics-$inst-after.txt
            save_metrics "${ADMIN_OF[$inst]}" "$ma"
            # the stampede's answers as cacheguard counted them (the GET after it is a hit)
            misses=$((misses + $(outcome_delta "$mb" "$ma" miss)))
            coalesced=$((coalesced + $(outcome_delta "$mb" "$ma" coalesced)))
            # this run's log lines
            sum_warn=$((sum_warn + $(log_since "${LOG_OF[$inst]}" "${LOG_MARK[$inst]}" "$OUT/runs/$tag-$inst.log")))
            if [[ $target != cgemb1 ]]; then
                local p
                p=$(lock_events "$mb" "$ma")
                resub=$(mdelta "$mb" "$ma" cacheguard_event_bus_resubscriptions_total)
                ((resub == 0)) || p+="resub=$resub,"
                p+="bus=$(metric "$ma" cacheguard_event_bus_subscribed)"
                parts+=("$inst:$p")
            fi
        done
        ((${#parts[@]} == 0)) || lock_events=$(
            IFS=' '
            echo "${parts[*]}"
        )
        log_warn=$sum_warn
        cg_outcomes="miss=$misses coalesced=$coalesced"
    fi

    local fields=(.ready .count .ok .non_2xx .errors .setup_failures .latency_ms.p50 .latency_ms.p99 .latency_ms.max .send_skew_ms)
    local vals
    vals=$(jq -r "[$(
        IFS=,
        echo "${fields[*]}"
    )] | map(if . == null then \"nan\" else tostring end) | join(\"\t\")" "$json") || die "cannot parse $json"
    local xc
    xc=$(json_counts "$json")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$target" "$rep" "$id" "$origin_cold" \
        "$origin_total" "$origin_max" "$vals" "$xc" "$(
            IFS=,
            echo "${after[*]}"
        )" "$lock_events" "$log_warn" "$cg_outcomes" >>"$RAW"

    local ready ok non2xx errors setup_f p50 p99 max skew
    IFS=$'\t' read -r ready _ ok non2xx errors setup_f p50 p99 max skew <<<"$vals"
    printf '  %-9s origin %-4s  p50 %8.1f  p99 %8.1f  max %8.1f ms  ok %s/%s  skew %s ms  X-Cache %s  %s  %s\n' \
        "$target" "$origin_cold" "$p50" "$p99" "$max" "$ok" "$c" "$skew" "$xc" "$lock_events" "$cg_outcomes" >&2
    ((ready == c)) || log "WARNING: $tag: only $ready of $c connections were ready before the release"
    ((errors == 0 && non2xx == 0 && setup_f == 0)) ||
        log "WARNING: $tag: $errors errors, $non2xx non-2xx, $setup_f setup failures (see $json)"
    if [[ $target == cg2 && $origin_cold != 1 ]]; then
        log "WARNING: $tag: cacheguard with 2 instances sent $origin_cold requests to the origin (target 1)"
    fi
    sleep 0.3 # let the closed connections drain
}

for c in $CONCURRENCIES; do
    each_rep "$TARGETS" run_one "$c"
done

for inst in cgA cgB cgE; do
    save_metrics "${ADMIN_OF[$inst]}" "$OUT/metrics-$inst-end.txt"
done
vmhwm_lines nginxA nginxB varnishA varnishB cgA cgB cgE >"$OUT/memory.txt"

end_env

# --- summary ---------------------------------------------------------------------------

col() { # col C TARGET FIELD_NO: one raw.tsv column for one (C, target)
    awk -F'\t' -v c="$1" -v t="$2" -v f="$3" 'NR > 1 && $1 == c && $2 == t { print $f }' "$RAW"
}
sum_col() { col "$@" | sum_lines; }
# merge_hist C TARGET FIELD_NO: "K=V,K=V" cells summed over the reps
merge_hist() { col "$@" | merge_counts; }
ratio_cell() { # p99 / delay, median (min–max)
    local v=() x
    for x in $(col "$1" "$2" 15); do v+=("$(awk -v a="$x" -v d="$DELAY_MS" 'BEGIN { printf "%.4f", a / d }')"); done
    cell_dec 2 "${v[@]}"
}
P99_LIMIT=$(awk -v d="$DELAY_MS" 'BEGIN { printf "%.1f", d * 1.1 }')

{
    echo "# cacheguard stampede: $STAMP"
    echo
    echo "Cold key, origin delay $DELAY_MS ms, C concurrent GETs released at once (with 2 instances C is split half/half)."
    echo "Each cell is **median (min–max) over $REPS runs**; a fresh cold key per run; targets rotate within each rep."
    echo "All processes on 127.0.0.1 on the same $(nproc) cores."
    env_summary
    for c in $CONCURRENCIES; do
        echo
        echo "## C = $c"
        echo
        echo "| target | origin requests | p50 ms | p99 ms | max ms | errors / non-2xx | p99 / origin delay | send skew ms | X-Cache (all reps) |"
        echo "|---|---|---|---|---|---|---|---|---|"
        for t in $TARGETS; do
            # shellcheck disable=SC2046
            printf '| %s | %s | %s | %s | %s | %s / %s | %s | %s | %s |\n' "${LABEL[$t]}" \
                "$(cell_dec 0 $(col "$c" "$t" 5))" \
                "$(cell_dec 1 $(col "$c" "$t" 14))" "$(cell_dec 1 $(col "$c" "$t" 15))" \
                "$(cell_dec 1 $(col "$c" "$t" 16))" \
                "$(($(sum_col "$c" "$t" 12) + $(sum_col "$c" "$t" 13)))" "$(sum_col "$c" "$t" 11)" \
                "$(ratio_cell "$c" "$t")" "$(cell_dec 1 $(col "$c" "$t" 17))" "$(merge_hist "$c" "$t" 18)"
        done
    done
    echo
    echo "- origin requests: requests for the cold key that reached the origin in each run (bench-origin per-path counter, reset before the run)."
    echo "- errors: transport errors, timeouts and connections that failed to set up; non-2xx: answers with another status."
    echo "- send skew: first to last stampede request written to its socket (the loadgen waits until every connection has answered a GET of the warm key $WARM_PATH before it releases)."
    echo "- ready connections before the release: $(awk -F'\t' 'NR > 1 && $8 != $1 { n++ } END { print (n + 0 == 0) ? "all C in every run" : n " runs had fewer than C" }' "$RAW")."
    if [[ " $TARGETS " == *" cg"* ]]; then
        echo
        echo "### cacheguard lock events and answers per run (deltas of \`cacheguard_lock_events_total\` and of \`cacheguard_requests_total\` by outcome, summed over the instances; bus = \`cacheguard_event_bus_subscribed\` after the run)"
        echo
        echo "A stampede should be one \`miss\` (the request that fetched) and C - 1 \`coalesced\` (answered by that fetch, X-Cache \`HIT-COALESCED\`), save for requests that arrived after the copy was stored (hits)."
        echo
        echo "| C | target | rep | origin requests | answers | lock events | WARN/ERROR log lines |"
        echo "|---|---|---|---|---|---|---|"
        awk -F'\t' 'NR > 1 && $2 ~ /^cg/ { printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $5, $22, $20, $21 }' "$RAW"
        echo
        for inst in cgA cgB; do
            echo "- $inst: \`cacheguard_event_bus_resubscriptions_total\` = $(metric "$OUT/metrics-$inst-end.txt" cacheguard_event_bus_resubscriptions_total) at the end, after about $((SECONDS - CG_STARTED)) s up (resub=N above: re-subscriptions during that run)."
        done
        bypass=$(awk -F'\t' 'NR > 1 && ($2 == "cg1" || $2 == "cg2") {
            n = split($20, parts, " ")
            for (i = 1; i <= n; i++) if (parts[i] !~ /acquired|contended|takeover/) printf "%s C=%s rep %s (%s); ", $2, $1, $3, parts[i]
        }' "$RAW")
        bypass=${bypass%; }
        echo "- runs in which a shared instance took no part in the distributed lock (no acquired/contended/takeover event, i.e. it fetched on in-process single-flight only): ${bypass:-none}."
    fi
    echo
    echo "## Stampede targets"
    echo
    echo "| target | C | measured | verdict |"
    echo "|---|---|---|---|"
    for c in $CONCURRENCIES; do
        if [[ " $TARGETS " == *" cg2 "* ]]; then
            o=$(col "$c" cg2 5 | tr '\n' ' ')
            ok=1
            for x in $o; do [[ $x == 1 ]] || ok=0; done
            echo "| origin count 1, cacheguard with 2 instances | $c | per rep: $o | $(verdict $ok) |"
        fi
        for t in cg2 cg1 cgemb1; do
            [[ " $TARGETS " == *" $t "* ]] || continue
            # shellcheck disable=SC2046
            read -r med _ worst < <(stats $(col "$c" "$t" 15))
            ok=$(awk -v m="$med" -v l="$P99_LIMIT" 'BEGIN { print (m <= l) ? 1 : 0 }')
            echo "| p99 ≤ $P99_LIMIT ms (origin delay + 10%), ${LABEL[$t]} | $c | median p99 $(LC_ALL=C printf '%.1f' "$med") ms, worst rep $(LC_ALL=C printf '%.1f' "$worst") ms | $(verdict "$ok") |"
        done
    done
    echo
    echo "Raw data: \`${OUT#"$ROOT"/}/\` (raw.tsv, runs/*.json with every latency, origin stats, cacheguard logs and /metrics around each run, configs)."
} >"$OUT/summary.md"

show_summary
