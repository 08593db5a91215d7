#!/usr/bin/env bash
# Stale-window benchmark: how long after a write can a read still see the old value, with
# three cacheguard instances sharing one Redis in front of a database whose read replica lags.
#
#   origin   bench/tools `bench-origin --kv --replica-lag-ms REPLICA_LAG_MS` (50): a versioned
#            key-value store. `PUT /kv/{key}` bumps the key's version on the primary at once
#            and answers it; `GET /kv/{key}` answers the version the replica shows, the newest
#            one committed at least REPLICA_LAG_MS ago. So a read that misses the cache right
#            after a write fetches the old version, and plain cache-aside keeps it cached.
#   cacheguard  THREE instances (release build, server.worker_threads CG_WORKERS) sharing a
#            redis-server started here, each with its own config file and its own
#            `[journal] path = "<run dir>/journal-<n>"` (CG_JOURNAL=1, the default; set
#            CG_JOURNAL=0 for a binary that does not know the [journal] section). Routes:
#              [[routes]] name = "kv"        match = "/kv/{key}"  methods = ["GET"]  l1 = "all"
#              [[routes]] name = "kv-write"  match = "/kv/{key}"  methods = ["PUT"]
#                         invalidate = ["/kv/{key}"]  double_delete_delay = <scenario>
#            everything else at its documented default (cache ttl 60s, [hot_keys] on).
#   load     bench/tools `loadgen stale`: WRITERS (8) writer loops and READERS (32) reader
#            loops, closed loop, for DURATION_S (10) s over KEYS (100) keys, each request to a
#            random instance. Writers PUT a random key and record (key, version returned, when
#            the answer arrived); readers GET a random key and record (key, instance, when the
#            request was sent, version read). One monotonic clock for all of them.
#
# Measured, per write W (key k, version v, answer at t_w): its stale window, the largest
# (read start − t_w) over reads of k that started at or after t_w and returned a version < v
# (0 if none); reported as p50/p90/p99/p99.9/max over all writes. Also `stale_reads_after_delay`:
# reads that started more than double_delete_delay after some write to their key returned and
# still saw an older version — with a working delayed double delete this is 0 — and
# `stale_reads_total` (the same without the delay filter).
#
# The stress scenario runs twice in the same run, against the same origin and Redis, with
# fresh cacheguard instances, a fresh Redis key prefix and fresh keys each time:
#   dd-200ms  double_delete_delay = "200ms"  (delayed double delete)
#   dd-0s     double_delete_delay = "0s"     (no third delete: plain cache-aside)
# and reports both and the ratio of their p99 stale windows (0s / 200ms).
#
# usage: bash bench/stale_window.sh
# env:   DELAYS="200ms 0s" (the double_delete_delay values; whole ms or s) DURATION_S=10
#        WRITERS=8 READERS=32 KEYS=100 REPLICA_LAG_MS=50 KV_TAGS=0 (1: origin answers carry
#        Surrogate-Key: kv-<key> kv-all) CG_WORKERS=1 (server.worker_threads of each instance;
#        3 instances share the 2 cores with the origin, Redis and the load)
#        CG_JOURNAL=1 (0: leave the [journal] section out)
#        CACHEGUARD_BIN=path (default target/release/cacheguard of this repo, built with
#        `cargo build --release` when missing) BASE_PORT=29680 (uses BASE_PORT+1 .. +8)
#        SEED=N (loadgen's key/instance choices; default from the clock, recorded)
#        KEEP_TMP=1 (keep the scratch dir with the Redis dir)
#
# Writes bench/results/stale-window-<UTC timestamp>/ (env.txt, origin.log, per scenario
# dd-<delay>/: cg<n>.toml, cg<n>.log, journal-<n>, /metrics before and after, loadgen's
# stale.json, origin stats; summary.md) and prints the markdown summary on stdout. Every
# process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults DELAYS="200ms 0s" DURATION_S=10 WRITERS=8 READERS=32 KEYS=100 REPLICA_LAG_MS=50 KV_TAGS=0 \
    CG_WORKERS=1 CG_JOURNAL=1 SEED= BASE_PORT=29680
INSTANCES=3
# per-request bound of loadgen; the whole loadgen run is bounded by DURATION_S + LOAD_SLACK_S
REQUEST_TIMEOUT_S=5
LOAD_SLACK_S=60

bench_ports ORIGIN_PORT REDIS_PORT
cg_port() { echo $((BASE_PORT + 1 + 2 * $1)); }  # instance 1..3: +3, +5, +7
cg_admin() { echo $((BASE_PORT + 2 + 2 * $1)); } # instance 1..3: +4, +6, +8

require_positive DURATION_S WRITERS READERS KEYS
[[ $REPLICA_LAG_MS =~ ^[0-9]+$ ]] || die "REPLICA_LAG_MS must be a non-negative integer"
[[ $KV_TAGS =~ ^[01]$ ]] || die "KV_TAGS must be 0 or 1"
[[ $CG_JOURNAL =~ ^[01]$ ]] || die "CG_JOURNAL must be 0 or 1"
[[ $CG_WORKERS =~ ^[0-9]+$ ]] || die "CG_WORKERS must be a non-negative integer"
[[ -z $SEED || $SEED =~ ^[0-9]+$ ]] || die "SEED must be a non-negative integer"
[[ $BASE_PORT =~ ^[0-9]+$ ]] || die "BASE_PORT must be a port number"
# delay_ms DELAY: "200ms" -> 200, "1s" -> 1000 (whole numbers only: the same string goes into
# the TOML as a humantime duration)
delay_ms() {
    if [[ $1 =~ ^([0-9]+)ms$ ]]; then
        echo "${BASH_REMATCH[1]}"
    elif [[ $1 =~ ^([0-9]+)s$ ]]; then
        echo $((BASH_REMATCH[1] * 1000))
    else
        return 1
    fi
}
for d in $DELAYS; do
    delay_ms "$d" >/dev/null || die "DELAYS entries must be whole ms or s, e.g. 200ms or 0s (got '$d')"
done
[[ -n ${DELAYS// /} ]] || die "DELAYS is empty: nothing to run"

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools redis-server:redis-server redis-cli:redis-tools curl:curl jq:jq
require_tools cargo awk timeout
ports=("${BENCH_PORTS[@]}")
for ((n = 1; n <= INSTANCES; n++)); do ports+=("$(cg_port "$n")" "$(cg_admin "$n")"); done
require_free_ports "${ports[@]}"

build_bench_tools

build_cacheguard
log "cacheguard: $CG_BIN"

bench_results stale-window-

# --- environment -----------------------------------------------------------------------

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
{
    echo "date_utc: $STAMP"
    echo "nproc: $(nproc)"
    echo "uname: $(uname -srm)"
    echo "cpu: $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)"
    echo "redis: $(redis-server --version)"
    echo "rustc: $(rustc -V 2>/dev/null || echo unknown)"
    echo "cacheguard: $("$CG_BIN" --version 2>/dev/null || echo unknown) ($CG_BIN)"
    echo "cacheguard_mtime: $(date -u -r "$CG_BIN" +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$ROOT" diff --quiet HEAD -- src 2>/dev/null || echo ' (src/ has uncommitted changes)')"
    echo "load_start: $LOAD_START"
    echo "instances: $INSTANCES (shared Redis)"
    echo "cacheguard_worker_threads: $CG_WORKERS (per instance; 0 = one per CPU)"
    echo "journal_section: $(if ((CG_JOURNAL)); then echo 'yes ([journal] path per instance)'; else echo 'no (CG_JOURNAL=0)'; fi)"
    echo "replica_lag_ms: $REPLICA_LAG_MS"
    echo "origin_surrogate_keys: $(if ((KV_TAGS)); then echo yes; else echo no; fi)"
    echo "load: $WRITERS writers, $READERS readers, $KEYS keys, ${DURATION_S} s, closed loop"
    echo "double_delete_delays: $DELAYS"
} >"$OUT/env.txt"
cat "$OUT/env.txt" >&2

# --- origin and Redis --------------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
origin_args=(--threads 2 --kv --replica-lag-ms "$REPLICA_LAG_MS")
((KV_TAGS)) && origin_args+=(--kv-tags)
start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" "${origin_args[@]}"
[[ $(curl -s --max-time 2 "$ORIGIN/kv/preflight" | jq -r .version) == 0 ]] ||
    die "bench-origin does not answer GET /kv/{key} (KV mode)"

start_redis stale "$REDIS_PORT"

# --- cacheguard --------------------------------------------------------------------------

# cacheguard_config N DELAY RUN_DIR KEY_PREFIX
cacheguard_config() {
    cat <<EOF
[server]
listen = "127.0.0.1:$(cg_port "$1")"
worker_threads = $CG_WORKERS

[upstream]
url = "$ORIGIN"

[redis]
url = "redis://127.0.0.1:$REDIS_PORT"
key_prefix = "$4"

[admin]
listen = "127.0.0.1:$(cg_admin "$1")"
EOF
    if ((CG_JOURNAL)); then
        cat <<EOF

[journal]
path = "$3/journal-$1"
EOF
    fi
    cat <<EOF

[[routes]]
name = "kv"
match = "/kv/{key}"
methods = ["GET"]
l1 = "all"

[[routes]]
name = "kv-write"
match = "/kv/{key}"
methods = ["PUT"]
invalidate = ["/kv/{key}"]
double_delete_delay = "$2"
EOF
}

# --- one scenario --------------------------------------------------------------------------

declare -A RESULT_OF WARN_OF INV_OF ORIGIN_READS_OF ORIGIN_WRITES_OF
SCENARIOS=()

# run_scenario DELAY INDEX
run_scenario() {
    local delay=$1 idx=$2 d_ms name run n pids=() urls=() conf
    d_ms=$(delay_ms "$delay")
    name=dd-$delay
    run=$OUT/$name
    mkdir -p "$run"
    SCENARIOS+=("$name")
    log "scenario $name: double_delete_delay = \"$delay\""

    for ((n = 1; n <= INSTANCES; n++)); do
        conf=$run/cg$n.toml
        cacheguard_config "$n" "$delay" "$run" "cg-stale-$idx:" >"$conf"
        if ! "$CG_BIN" --check-config "$conf" >"$run/check-config-$n.txt" 2>&1; then
            cat "$run/check-config-$n.txt" >&2
            if ((CG_JOURNAL)) && grep -qi journal "$run/check-config-$n.txt"; then
                die "cacheguard rejects $conf; this binary does not know [journal]: rerun with CG_JOURNAL=0"
            fi
            die "cacheguard --check-config $conf failed"
        fi
        start_bg "$run/cg$n.log" "$CG_BIN" --config "$conf"
        pids+=("$LAST_PID")
        urls+=(--url "http://127.0.0.1:$(cg_port "$n")")
    done
    for ((n = 1; n <= INSTANCES; n++)); do
        wait_http "http://127.0.0.1:$(cg_admin "$n")/healthz" "${pids[n - 1]}" "cacheguard $n ($name)"
    done
    for ((n = 1; n <= INSTANCES; n++)); do
        wait_bus "http://127.0.0.1:$(cg_admin "$n")" "http://127.0.0.1:$(cg_admin "$n")" "$run/metrics-$n-before.txt"
    done
    origin_reset

    local seed_args=()
    [[ -z $SEED ]] || seed_args=(--seed "$SEED")
    log "loadgen stale: $WRITERS writers, $READERS readers, $KEYS keys, ${DURATION_S} s, delay $d_ms ms"
    local rc=0
    run_bg "$run/loadgen.log" timeout -k 5 $((DURATION_S + LOAD_SLACK_S)) \
        "$LOADGEN_BIN" stale "${urls[@]}" --path-template '/kv/{key}' \
        --writers "$WRITERS" --readers "$READERS" --keys "$KEYS" --key-prefix "s$idx-" \
        --duration-s "$DURATION_S" --delay-ms "$d_ms" --timeout-s "$REQUEST_TIMEOUT_S" \
        --threads 2 "${seed_args[@]}" || rc=$?
    # loadgen prints its JSON on stdout and errors on stderr; both went to loadgen.log
    grep '^{' "$run/loadgen.log" | tail -n1 >"$run/stale.json" || true
    if ((rc != 0)) || ! jq -e .mode "$run/stale.json" >/dev/null 2>&1; then
        die "loadgen stale failed (exit $rc); see $run/loadgen.log"
    fi

    curl -s --max-time 5 "$ORIGIN/stats" >"$run/origin-stats.json" || true
    local warn=0 inv_done=0 inv_failed=0
    for ((n = 1; n <= INSTANCES; n++)); do
        save_metrics "http://127.0.0.1:$(cg_admin "$n")" "$run/metrics-$n-after.txt"
        inv_done=$((inv_done + $(metric "$run/metrics-$n-after.txt" 'cacheguard_invalidations_total{result="done"}')))
        inv_failed=$((inv_failed + $(metric "$run/metrics-$n-after.txt" 'cacheguard_invalidations_total{result="failed"}')))
    done
    for pid in "${pids[@]}"; do stop_pid "$pid"; done
    for ((n = 1; n <= INSTANCES; n++)); do
        warn=$((warn + $(grep -c -E 'WARN|ERROR' "$run/cg$n.log" || true)))
    done
    RESULT_OF[$name]=$run/stale.json
    WARN_OF[$name]=$warn
    INV_OF[$name]="$inv_done / $inv_failed"
    ORIGIN_READS_OF[$name]=$(jq -r '.kv_reads // "-"' "$run/origin-stats.json" 2>/dev/null || echo -)
    ORIGIN_WRITES_OF[$name]=$(jq -r '.kv_writes // "-"' "$run/origin-stats.json" 2>/dev/null || echo -)
    log "$name: $(jq -c '{writes, reads, errors, p99_window_ms: .stale_window_ms.p99, max_window_ms: .stale_window_ms.max, stale_reads_total, stale_reads_after_delay}' "$run/stale.json")"
}

idx=0
for d in $DELAYS; do
    idx=$((idx + 1))
    run_scenario "$d" "$idx"
done

end_env

# --- summary -------------------------------------------------------------------------------

# j NAME FILTER: one value of a scenario's loadgen JSON
j() { jq -r "$2" "${RESULT_OF[$1]}"; }
ms3() { LC_ALL=C awk -v v="$1" 'BEGIN { if (v == "null" || v == "") print "–"; else printf "%.3f", v }'; }
ratio_or_inf() { LC_ALL=C awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else if (a + 0 > 0) print "∞ (denominator 0)"; else print "– (both 0)" }'; }

first=${SCENARIOS[0]}
last=${SCENARIOS[${#SCENARIOS[@]} - 1]}
{
    echo "# cacheguard stale window: $STAMP"
    echo
    echo "$INSTANCES cacheguard instances sharing one Redis in front of \`bench-origin --kv --replica-lag-ms $REPLICA_LAG_MS\`;"
    echo "\`loadgen stale\`: $WRITERS writers and $READERS readers, closed loop, $KEYS keys, ${DURATION_S} s per scenario, every request to a random instance."
    echo "All processes on 127.0.0.1 on the same $(nproc) cores. Load average (1/5/15 min) at start: $LOAD_START; at end: $LOAD_END. Wall time: ${WALL} s."
    echo
    env_table
    echo
    echo "## Stale windows (ms, over all writes)"
    echo
    echo "| double_delete_delay | writes | reads | errors | p50 | p90 | p99 | p99.9 | max | writes with a stale read | stale reads (total) | **stale reads > delay after a write** | origin GETs / PUTs | invalidations done / failed | WARN/ERROR lines |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for s in "${SCENARIOS[@]}"; do
        printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | **%s** | %s / %s | %s | %s |\n' "${s#dd-}" \
            "$(j "$s" .writes)" "$(j "$s" .reads)" "$(j "$s" .errors)" \
            "$(ms3 "$(j "$s" .stale_window_ms.p50)")" "$(ms3 "$(j "$s" .stale_window_ms.p90)")" \
            "$(ms3 "$(j "$s" .stale_window_ms.p99)")" "$(ms3 "$(j "$s" .stale_window_ms.p99_9)")" \
            "$(ms3 "$(j "$s" .stale_window_ms.max)")" "$(j "$s" .writes_with_stale_reads)" \
            "$(j "$s" .stale_reads_total)" "$(j "$s" .stale_reads_after_delay)" \
            "${ORIGIN_READS_OF[$s]}" "${ORIGIN_WRITES_OF[$s]}" "${INV_OF[$s]}" "${WARN_OF[$s]}"
    done
    echo
    if [[ $first != "$last" ]]; then
        echo "- **p99 stale window, ${last#dd-} / ${first#dd-}: $(ratio_or_inf "$(j "$last" .stale_window_ms.p99)" "$(j "$first" .stale_window_ms.p99)")×**" \
            "($(ms3 "$(j "$last" .stale_window_ms.p99)") ms vs $(ms3 "$(j "$first" .stale_window_ms.p99)") ms)."
    fi
    for s in "${SCENARIOS[@]}"; do
        echo "- ${s#dd-}: reads by X-Cache $(j "$s" '.read_x_cache | to_entries | map("\(.key)=\(.value)") | join(", ")');" \
            "stale reads > delay by instance $(j "$s" '.stale_after_delay_by_instance | map(tostring) | join("/")')," \
            "started $(j "$s" '.stale_after_delay_age_ms | if .n == 0 then "–" else "\(.min)–\(.max)" end') ms after the oldest write they missed," \
            "by X-Cache $(j "$s" '.stale_after_delay_by_x_cache | to_entries | map("\(.key)=\(.value)") | join(", ") | if . == "" then "–" else . end');" \
            "errors by kind $(j "$s" '.errors_by_kind | to_entries | map("\(.key)=\(.value)") | join(", ") | if . == "" then "none" else . end');" \
            "read p99 $(ms3 "$(j "$s" .read_latency_ms.p99)") ms, write p99 $(ms3 "$(j "$s" .write_latency_ms.p99)") ms."
    done
    echo "- stale window of a write: the largest (read start − the write's return) over reads of its key that started at or after the return and saw an older version; 0 when none. With a replica lag of $REPLICA_LAG_MS ms even a cache that is always right shows windows up to about $REPLICA_LAG_MS ms plus a request's time."
    echo "- stale reads > delay after a write: reads that started more than double_delete_delay after some write to their key returned and saw an older version. With a working delayed double delete this is 0 for any delay above the replica lag (for \"0s\" every read behind the replica counts)."
    echo
    echo "Raw data: \`bench/results/stale-window-$STAMP/\` (per scenario: loadgen's stale.json, configs, logs, /metrics before and after, origin stats)."
} >"$OUT/summary.md"

show_summary
