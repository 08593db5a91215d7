#!/usr/bin/env bash
# Scale-out benchmark (Redis Cluster and Sentinel): the same cacheguard on three Redis topologies, in one run
# on this machine, everything on 127.0.0.1:
#
#   topologies  started here with Debian's redis-server, no persistence, kept up for the whole
#               run (each mode has its own, so no mode sees another's keys):
#               standalone  one redis-server
#               cluster     6 nodes (`--cluster-enabled yes`), `redis-cli --cluster create
#                           --cluster-replicas 1`: 3 primaries + 3 replicas, all 16384 slots
#               sentinel    1 primary + 1 replica + 3 sentinels (`redis-server conf --sentinel`,
#                           quorum 2) monitoring it as `cgprimary`
#   origin      bench/tools `bench-origin`: GET /items/{id} -> 1024 bytes of JSON; one instance
#               with no delay (section a) and one with DELAY_MS (section b), per-path counters
#               at /stats
#   cacheguard  release build, `[redis]` per mode (mode / url(s) / master_name),
#               command_timeout 200ms, its own journal per instance; started for each run and
#               stopped after it; measured only once /admin/redis says "up":true
#
#   a. L2-hit throughput (L1 off): one cacheguard with `[cache] l1 = "off"`, so every hit is a
#      Redis read. KEYS distinct item paths are filled (bench/tools `loadgen list`, one GET per
#      path) and checked (a second pass must answer HIT-L2 for every path; on a cluster they
#      spread over the three primaries), then `wrk -t2 -c64 -d$DURATION --latency` with
#      bench/id_list.lua cycling over those paths. Recorded: req/s, p50, p99 (wrk), the share
#      of answers that were HIT-L2 (deltas of cacheguard_requests_total over the run), origin
#      requests during the run (must be 0), CPU seconds used by cacheguard and by the
#      topology's redis-servers during the run.
#   b. Stampede coalescing: two cacheguard instances (L1 default) sharing the topology, origin
#      delay DELAY_MS; bench/tools `loadgen stampede` opens C keep-alive connections split
#      over both instances, warms each with a GET of an already-cached key, then releases one
#      GET of a fresh cold key on all of them at once. Recorded: requests for that key that
#      reached the origin (target: 1 in every mode), answers 200, p50/p99/max latency, X-Cache
#      histogram, lock events.
#
# Each rep runs section a for every mode, then section b for every mode; the mode order
# rotates from rep to rep. C in CONCURRENCIES; a fresh cold key (new id) per stampede.
#
# usage: bash bench/scale_out.sh
# env:   MODES="standalone cluster sentinel" REPS=3 DURATION=10s KEYS=1000 CONCURRENCIES=1000
#        DELAY_MS=200 BASE_PORT=31080 (uses BASE_PORT+1 .. +21, and +10011 .. +10016 for the
#        cluster bus)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir with the redis/sentinel dirs and cacheguard configs)
#
# Writes bench/results/scale-out-<UTC timestamp>/ (env.txt, raw.tsv with one row per run of
# either section, wrk outputs, loadgen JSON, cacheguard configs, logs and /metrics around each
# run, topology dumps, summary.md) and prints the markdown summary on stdout. Every process
# it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults MODES="standalone cluster sentinel" REPS=3 DURATION=10s KEYS=1000 CONCURRENCIES=1000 \
    DELAY_MS=200 BASE_PORT=31080
TIMEOUT_S=30
WRK_TIMEOUT=10s
BODY_BYTES=1024
MAX_ID=1000000
WARM_PATH=/items/1
FIRST_COLD_ID=500001
MASTER_NAME=cgprimary
READY_WAIT_S=60 # deadline for a topology or a cacheguard instance to become ready

# ORIGIN0_PORT: the origin with no delay (section a); ORIGIN_PORT: with DELAY_MS (section b)
bench_ports ORIGIN0_PORT ORIGIN_PORT CGL_PORT CGL_ADMIN CGA_PORT CGA_ADMIN CGB_PORT CGB_ADMIN - STANDALONE_PORT
CLUSTER_PORTS=()
for i in 1 2 3 4 5 6; do CLUSTER_PORTS+=($((BASE_PORT + 10 + i))); done
PRIMARY_PORT=$((BASE_PORT + 17))
REPLICA_PORT=$((BASE_PORT + 18))
SENTINEL_PORTS=($((BASE_PORT + 19)) $((BASE_PORT + 20)) $((BASE_PORT + 21)))

require_positive REPS KEYS
((KEYS < FIRST_COLD_ID)) || die "KEYS must be below $FIRST_COLD_ID (the first cold id of section b)"
require_positive DELAY_MS
[[ $DURATION =~ ^[0-9]+[smh]?$ ]] || die "DURATION must be a wrk duration like 10s (got '$DURATION')"
((BASE_PORT >= 1024 && BASE_PORT + 10016 <= 65535)) || die "BASE_PORT must leave room for +10016 (got $BASE_PORT)"
require_positive_list CONCURRENCIES
[[ -n ${MODES// /} ]] || die "MODES is empty"
check_list MODES mode standalone cluster sentinel

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools redis-server:redis-server redis-cli:redis-tools wrk:wrk curl:curl jq:jq
require_tools cargo awk sort mktemp ss timeout getconf
ports=("${BENCH_PORTS[@]:0:8}") # the origins and cacheguard instances; Redis by mode:
for m in $MODES; do
    case $m in
    standalone) ports+=("$STANDALONE_PORT") ;;
    cluster) for p in "${CLUSTER_PORTS[@]}"; do ports+=("$p" $((p + 10000))); done ;;
    sentinel) ports+=("$PRIMARY_PORT" "$REPLICA_PORT" "${SENTINEL_PORTS[@]}") ;;
    esac
done
require_free_ports "${ports[@]}"

# File descriptors: C connections in the loadgen and as many in the proxies (see stampede.sh).
# shellcheck disable=SC2086 # one C per word
require_fds_for_concurrency $CONCURRENCIES

build_bench_tools

build_cacheguard

bench_results scale-out- runs configs topology
CLK_TCK=$(getconf CLK_TCK)

# --- environment -----------------------------------------------------------------------

write_env redis wrk <<EOF
modes: $MODES
reps: $REPS
throughput: wrk -t2 -c64 -d$DURATION --latency over $KEYS keys, L1 off
concurrencies: $CONCURRENCIES
origin_delay_ms: $DELAY_MS (section b; section a's origin has no delay)
EOF

# --- helpers ---------------------------------------------------------------------------

rcli() { timeout 5 redis-cli -h 127.0.0.1 -p "$@"; }
pong() { [[ $(rcli "$1" ping 2>/dev/null) == PONG ]]; }

declare -A REDIS_PIDS_OF # mode -> PIDs of its redis-servers (sentinels included)

# start_redis_node MODE NAME PORT EXTRA_ARGS...: a redis-server on 127.0.0.1:PORT in its own
# dir, no persistence, waited for until it answers PING. Sets LAST_PID.
start_redis_node() {
    local mode=$1 name=$2 port=$3 dir="$BENCH_TMP/redis-$2" deadline
    shift 3
    mkdir -p "$dir"
    start_bg "$dir/stdout.log" redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" \
        --save "" --appendonly no --daemonize no --logfile "$dir/redis.log" "$@"
    local pid=$LAST_PID
    REDIS_PIDS_OF[$mode]+="$pid "
    deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || die "redis-server ($name, PID $pid) exited; see $dir/redis.log"
        pong "$port" && return 0
        sleep 0.1
    done
    die "redis-server ($name) did not answer PING on port $port within 15 s"
}

# wait_for DESC SECONDS CMD...: run CMD every 0.2 s until it succeeds; die at the deadline.
wait_for() {
    local desc=$1 limit=$2 deadline
    shift 2
    deadline=$((SECONDS + limit))
    until "$@"; do
        ((SECONDS < deadline)) || die "timed out after $limit s waiting for $desc"
        sleep 0.2
    done
}

cluster_all_ok() {
    local p
    for p in "${CLUSTER_PORTS[@]}"; do
        rcli "$p" cluster info 2>/dev/null | tr -d '\r' | grep -qx 'cluster_state:ok' || return 1
    done
    # every node must know all 6 nodes and their roles (replicas attached)
    for p in "${CLUSTER_PORTS[@]}"; do
        [[ $(rcli "$p" cluster info 2>/dev/null | tr -d '\r' | awk -F: '$1 == "cluster_known_nodes" { print $2 }') == 6 ]] ||
            return 1
    done
    [[ $(rcli "${CLUSTER_PORTS[0]}" cluster nodes 2>/dev/null | grep -c 'slave') == 3 ]]
}

replica_link_up() {
    rcli "$REPLICA_PORT" info replication 2>/dev/null | tr -d '\r' | grep -qx 'master_link_status:up'
}

# sentinel_field PORT FIELD: one field of `SENTINEL MASTER cgprimary` from one sentinel.
sentinel_field() {
    rcli "$1" sentinel master "$MASTER_NAME" 2>/dev/null | tr -d '\r' |
        awk -v f="$2" 'prev == f { print; exit } { prev = $0 }'
}

sentinels_ready() {
    local s
    for s in "${SENTINEL_PORTS[@]}"; do
        [[ $(sentinel_field "$s" num-slaves) == 1 && $(sentinel_field "$s" num-other-sentinels) == 2 ]] ||
            return 1
    done
}

start_standalone() {
    log "standalone: redis-server on $STANDALONE_PORT"
    start_redis_node standalone standalone "$STANDALONE_PORT"
    rcli "$STANDALONE_PORT" info server | tr -d '\r' >"$OUT/topology/standalone-info.txt"
}

start_cluster() {
    local p addrs=()
    log "cluster: 6 nodes on ${CLUSTER_PORTS[*]}"
    for p in "${CLUSTER_PORTS[@]}"; do
        start_redis_node cluster "cluster-$p" "$p" --cluster-enabled yes \
            --cluster-config-file nodes.conf --cluster-node-timeout 2000
        addrs+=("127.0.0.1:$p")
    done
    timeout 60 redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
        >"$OUT/topology/cluster-create.txt" 2>&1 ||
        die "redis-cli --cluster create failed; see $OUT/topology/cluster-create.txt"
    wait_for "cluster_state:ok and 3 replicas on every cluster node" "$READY_WAIT_S" cluster_all_ok
    rcli "${CLUSTER_PORTS[0]}" cluster nodes | tr -d '\r' >"$OUT/topology/cluster-nodes.txt"
    log "cluster: state ok, 3 primaries + 3 replicas"
}

start_sentinel() {
    local s dir
    log "sentinel: primary $PRIMARY_PORT, replica $REPLICA_PORT, sentinels ${SENTINEL_PORTS[*]}"
    start_redis_node sentinel primary "$PRIMARY_PORT"
    start_redis_node sentinel replica "$REPLICA_PORT" --replicaof 127.0.0.1 "$PRIMARY_PORT"
    wait_for "master_link_status:up on the replica" "$READY_WAIT_S" replica_link_up
    for s in "${SENTINEL_PORTS[@]}"; do
        dir=$BENCH_TMP/sentinel-$s
        mkdir -p "$dir"
        # sentinel rewrites its config file: it lives in the scratch dir
        cat >"$dir/sentinel.conf" <<EOF
port $s
bind 127.0.0.1
daemonize no
dir $dir
logfile $dir/sentinel.log
sentinel monitor $MASTER_NAME 127.0.0.1 $PRIMARY_PORT 2
sentinel down-after-milliseconds $MASTER_NAME 1000
sentinel failover-timeout $MASTER_NAME 5000
EOF
        cp "$dir/sentinel.conf" "$OUT/topology/sentinel-$s.conf"
        start_bg "$dir/stdout.log" redis-server "$dir/sentinel.conf" --sentinel
        REDIS_PIDS_OF[sentinel]+="$LAST_PID "
        wait_for "sentinel $s to answer PING" 15 pong "$s"
    done
    wait_for "every sentinel to see 1 replica and 2 other sentinels" "$READY_WAIT_S" sentinels_ready
    rcli "${SENTINEL_PORTS[0]}" sentinel master "$MASTER_NAME" | tr -d '\r' | paste - - \
        >"$OUT/topology/sentinel-master.txt"
    log "sentinel: primary with 1 replica, 3 sentinels agree"
}

# redis_settings MODE: the [redis] settings (cg_config arguments) for MODE, one per line.
redis_settings() {
    local urls
    case $1 in
    standalone) echo "redis.url=redis://127.0.0.1:$STANDALONE_PORT" ;;
    cluster)
        urls=$(printf '"redis://127.0.0.1:%s", ' "${CLUSTER_PORTS[@]}")
        echo redis.mode=cluster
        echo "redis.urls=[${urls%, }]"
        ;;
    sentinel)
        urls=$(printf '"redis://127.0.0.1:%s", ' "${SENTINEL_PORTS[@]}")
        echo redis.mode=sentinel
        echo "redis.urls=[${urls%, }]"
        echo "redis.master_name=$MASTER_NAME"
        ;;
    esac
    echo redis.command_timeout=200ms
}

redis_up() { [[ $(curl -s --max-time 2 "$1/admin/redis" | jq -r '.up' 2>/dev/null) == true ]]; }

# start_cacheguard NAME MODE TAG PORT ADMIN_PORT ORIGIN_PORT L1: starts one instance with
# bench/stampede.sh's shared config (lock_config) on the Redis of MODE, `[cache] l1 = L1` ("" =
# the default); config in the scratch dir, a copy in $OUT/configs, log in
# $OUT/runs/TAG-NAME.log. Waits until /admin/redis says "up":true.
start_cacheguard() {
    local name=$1 mode=$2 tag=$3 port=$4 admin=$5 dir="$BENCH_TMP/cg-$1-$2" redis
    mkdir -p "$dir"
    mapfile -t redis < <(redis_settings "$mode")
    lock_config "$port" "$admin" "$6" "${redis[@]}" journal.path="journal-$port" ${7:+cache.l1="$7"} \
        >"$dir/cacheguard.toml"
    [[ -f $OUT/configs/$mode-$name.toml ]] || cp "$dir/cacheguard.toml" "$OUT/configs/$mode-$name.toml"
    launch_cacheguard "$name" "$dir/cacheguard.toml" "$port" "$admin" "$OUT/runs/$tag-$name.log" "cacheguard ($name, $mode)"
    local deadline=$((SECONDS + READY_WAIT_S))
    until redis_up "${ADMIN_OF[$name]}"; do
        kill -0 "${PID_OF[$name]}" 2>/dev/null || die "cacheguard ($name, $mode) exited; see ${LOG_OF[$name]}"
        ((SECONDS < deadline)) || die "cacheguard ($name, $mode): /admin/redis not up within $READY_WAIT_S s"
        sleep 0.2
    done
    curl -s --max-time 2 "${ADMIN_OF[$name]}/admin/redis" >"$OUT/runs/$tag-$name-admin-redis.json" || true
}

stop_cacheguard() {
    stop_pid "${PID_OF[$1]}"
    unset "PID_OF[$1]"
}

# metric_sum FILE NAME [LABEL=\"VALUE\"...]: the sum of every sample of NAME carrying all the
# given label pairs (0 when none).
metric_sum() {
    local file=$1 name=$2
    shift 2
    awk -v m="$name" -v want="$*" '
        BEGIN { n = split(want, w, " ") }
        index($1, m "{") == 1 || $1 == m {
            for (i = 1; i <= n; i++) if (index($1, w[i]) == 0) next
            s += $2
        }
        END { printf "%.0f", s + 0 }' "$file"
}

# cpu_ticks PID...: utime + stime of the given processes, in clock ticks (gone ones count 0).
cpu_ticks() {
    local pid total=0 t
    for pid in "$@"; do
        t=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$pid/stat" 2>/dev/null || echo 0)
        total=$((total + ${t:-0}))
    done
    echo "$total"
}
ticks_to_s() { awk -v t="$1" -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", t / hz }'; }

origin_total() { curl -s --max-time 5 "$1/stats" | jq '.total'; }

# --- origins and topologies ------------------------------------------------------------

ORIGIN0=http://127.0.0.1:$ORIGIN0_PORT
ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_origin "$OUT/origin0.log" "bench-origin (no delay)" "$ORIGIN0_PORT" --delay-ms 0 --max-id "$MAX_ID" --threads 2
start_origin "$OUT/origin.log" "bench-origin (delay $DELAY_MS ms)" "$ORIGIN_PORT" --delay-ms "$DELAY_MS" \
    --max-id "$MAX_ID" --threads 2
check_origin_body "$ORIGIN0/items/1" "$BODY_BYTES"

for m in $MODES; do "start_$m"; done

IDS_FILE=$OUT/keys.txt
seq 1 "$KEYS" >"$IDS_FILE"

# --- section a: L2-hit throughput ------------------------------------------------------

RAW=$OUT/raw.tsv
{
    printf 'section\tmode\trep\tc\tid\trps\tp50_ms\tp99_ms\tmax_ms\trequests\terrors\tnon2xx'
    printf '\thit_l2_share\torigin_requests\tok\tx_cache\tcg_cpu_s\tredis_cpu_s\tlock_events\tlog_warnings\n'
} >"$RAW"

# keys_per_primary: "port=DBSIZE ..." over the cluster's primaries.
keys_per_primary() {
    local p out=()
    for p in "${CLUSTER_PORTS[@]}"; do
        [[ $(rcli "$p" role 2>/dev/null | awk 'NR == 1') == master ]] || continue
        out+=("$p=$(rcli "$p" dbsize)")
    done
    echo "${out[*]}"
}

declare -A SPREAD # mode -> keys per primary after the first fill (cluster only)

run_l2() {
    local mode=$1 rep=$2 tag="a-$1-rep$2" admin=http://127.0.0.1:$CGL_ADMIN base=http://127.0.0.1:$CGL_PORT
    log "a. rep $rep/$REPS: $mode: L2-hit throughput over $KEYS keys (L1 off)"
    start_cacheguard cgL "$mode" "$tag" "$CGL_PORT" "$CGL_ADMIN" "$ORIGIN0_PORT" off
    local pid=${PID_OF[cgL]}
    # fill (whatever is not in this topology yet), then check: every key must be a HIT-L2
    timeout 300 "$LOADGEN_BIN" list --url "$base/items/{id}" --ids-file "$IDS_FILE" --connections 16 \
        >"$OUT/runs/$tag-fill.json" || die "loadgen list (fill) failed; see $OUT/runs/$tag-fill.json"
    timeout 300 "$LOADGEN_BIN" list --url "$base/items/{id}" --ids-file "$IDS_FILE" --connections 16 \
        >"$OUT/runs/$tag-check.json" || die "loadgen list (check) failed; see $OUT/runs/$tag-check.json"
    local hits ok
    hits=$(jq '.x_cache["HIT-L2"] // 0' "$OUT/runs/$tag-check.json")
    ok=$(jq '.ok' "$OUT/runs/$tag-check.json")
    ((hits == KEYS && ok == KEYS)) ||
        die "$tag: after the fill only $hits of $KEYS keys answered HIT-L2 ($ok ok); see $OUT/runs/$tag-check.json"
    local xc
    xc=$(x_cache "$base/items/1")
    [[ $xc == HIT-L2 ]] || die "$tag: GET /items/1 answered X-Cache '$xc', expected HIT-L2"
    if [[ $mode == cluster && -z ${SPREAD[$mode]:-} ]]; then
        SPREAD[$mode]=$(keys_per_primary)
        log "cluster keys per primary: ${SPREAD[$mode]}"
    fi

    local file=$OUT/runs/$tag-wrk.txt before_o after_o cg0 cg1 r0 r1
    # shellcheck disable=SC2086 # the PID list splits on purpose
    r0=$(cpu_ticks ${REDIS_PIDS_OF[$mode]})
    cg0=$(cpu_ticks "$pid")
    curl -s --max-time 2 "$admin/metrics" >"$OUT/runs/$tag-metrics-before.txt" || die "cannot read $admin/metrics"
    before_o=$(origin_total "$ORIGIN0")
    wrk_once "$file" "$tag" -t2 -c64 -d"$DURATION" --latency --timeout "$WRK_TIMEOUT" \
        -s bench/id_list.lua "$base" -- "$IDS_FILE" 2
    after_o=$(origin_total "$ORIGIN0")
    curl -s --max-time 2 "$admin/metrics" >"$OUT/runs/$tag-metrics-after.txt" || die "cannot read $admin/metrics"
    cg1=$(cpu_ticks "$pid")
    # shellcheck disable=SC2086
    r1=$(cpu_ticks ${REDIS_PIDS_OF[$mode]})

    local parsed rps p50 p99 max reqs errs non2xx
    parsed=$(wrk_parse "$file") || die "cannot parse wrk output $file"
    read -r rps p50 p99 max reqs errs non2xx <<<"$parsed"
    local l2_b l2_a all_b all_a share
    l2_b=$(metric_sum "$OUT/runs/$tag-metrics-before.txt" cacheguard_requests_total 'outcome="hit_l2"')
    l2_a=$(metric_sum "$OUT/runs/$tag-metrics-after.txt" cacheguard_requests_total 'outcome="hit_l2"')
    all_b=$(metric_sum "$OUT/runs/$tag-metrics-before.txt" cacheguard_requests_total)
    all_a=$(metric_sum "$OUT/runs/$tag-metrics-after.txt" cacheguard_requests_total)
    share=$(awk -v h=$((l2_a - l2_b)) -v n=$((all_a - all_b)) 'BEGIN { printf "%.4f", (n > 0) ? h / n : 0 }')
    # the outcomes other than hit_l2 during the run, for the record
    local other="" o d
    for o in hit_l1 miss stale bypass error negative reject; do
        d=$(($(metric_sum "$OUT/runs/$tag-metrics-after.txt" cacheguard_requests_total "outcome=\"$o\"") -
            $(metric_sum "$OUT/runs/$tag-metrics-before.txt" cacheguard_requests_total "outcome=\"$o\"")))
        ((d == 0)) || other+="$o=$d,"
    done
    other="hit_l2=$((l2_a - l2_b)),${other}"
    local warn
    warn=$(grep -c -E 'WARN|ERROR' "${LOG_OF[cgL]}" || true)
    stop_cacheguard cgL

    printf 'a\t%s\t%s\t-\t-\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t-\t%s\t%s\t%s\t-\t%s\n' "$mode" "$rep" \
        "$rps" "$p50" "$p99" "$max" "$reqs" "$errs" "$non2xx" "$share" $((after_o - before_o)) "${other%,}" \
        "$(ticks_to_s $((cg1 - cg0)))" "$(ticks_to_s $((r1 - r0)))" "$warn" >>"$RAW"
    printf '  %-10s %10s req/s  p50 %7.3f  p99 %7.3f ms  HIT-L2 %s  origin %s  cpu cg %ss redis %ss\n' "$mode" \
        "$(fmt_int "$rps")" "$p50" "$p99" "$share" $((after_o - before_o)) "$(ticks_to_s $((cg1 - cg0)))" \
        "$(ticks_to_s $((r1 - r0)))" >&2
    ((errs == 0 && non2xx == 0)) || log "WARNING: $tag: $errs socket errors, $non2xx non-2xx answers (see $file)"
    [[ $((after_o - before_o)) == 0 ]] || log "WARNING: $tag: $((after_o - before_o)) origin requests during the run"
    ((warn == 0)) || log "WARNING: $tag: $warn WARN/ERROR lines in ${LOG_OF[cgL]}"
}

# --- section b: stampede coalescing ------------------------------------------------------

next_id=$FIRST_COLD_ID

# run_stampede MODE REP C: one stampede on the instances cgA and cgB (already running).
run_stampede() {
    local mode=$1 rep=$2 c=$3 id=$next_id
    next_id=$((next_id + 1))
    local path=/items/$id tag="b-$1-rep$2-c$3" inst
    instances_before "$OUT/runs/$tag" cgA cgB
    origin_reset
    local json=$OUT/runs/$tag.json
    log "b. rep $rep/$REPS: $mode: stampede C=$c on $path over cgA + cgB"
    loadgen_stampede "$json" "$tag" --url "${URL_OF[cgA]}$path" --url "${URL_OF[cgB]}$path" \
        --concurrency "$c" --timeout-s "$TIMEOUT_S" --warm-path "$WARM_PATH"
    sleep 0.2 # anything still on its way to the origin
    save_origin_stats "$OUT/runs/$tag-origin.json"
    local origin_cold
    origin_cold=$(origin_path_count "$OUT/runs/$tag-origin.json" "$path")

    local parts=() sum_warn=0 ma
    for inst in cgA cgB; do
        ma=$OUT/runs/$tag-metrics-$inst-after.txt
        save_metrics "${ADMIN_OF[$inst]}" "$ma"
        sum_warn=$((sum_warn + $(log_since "${LOG_OF[$inst]}" "${LOG_MARK[$inst]}" "$OUT/runs/$tag-$inst-lines.log")))
        parts+=("$inst:$(lock_events "$OUT/runs/$tag-metrics-$inst-before.txt" "$ma")bus=$(metric "$ma" cacheguard_event_bus_subscribed)")
    done

    local vals xc
    vals=$(jq -r '[.count, .ok, .non_2xx, .errors, .setup_failures, .ready, .latency_ms.p50, .latency_ms.p99,
        .latency_ms.max] | map(if . == null then "nan" else tostring end) | join("\t")' "$json") ||
        die "cannot parse $json"
    xc=$(json_counts "$json")
    local count ok non2xx errors setup_f ready p50 p99 max
    IFS=$'\t' read -r count ok non2xx errors setup_f ready p50 p99 max <<<"$vals"
    printf 'b\t%s\t%s\t%s\t%s\t-\t%s\t%s\t%s\t%s\t%s\t%s\t-\t%s\t%s\t%s\t-\t-\t%s\t%s\n' "$mode" "$rep" "$c" "$id" \
        "$p50" "$p99" "$max" "$count" "$((errors + setup_f))" "$non2xx" "$origin_cold" "$ok" "$xc" \
        "${parts[*]}" "$sum_warn" >>"$RAW"
    printf '  %-10s C=%-5s origin %-3s  ok %s/%s  p50 %8.1f  p99 %8.1f  max %8.1f ms  X-Cache %s  %s\n' \
        "$mode" "$c" "$origin_cold" "$ok" "$c" "$p50" "$p99" "$max" "$xc" "${parts[*]}" >&2
    ((ready == c)) || log "WARNING: $tag: only $ready of $c connections were ready before the release"
    ((errors == 0 && non2xx == 0 && setup_f == 0)) ||
        log "WARNING: $tag: $errors errors, $non2xx non-2xx, $setup_f setup failures (see $json)"
    [[ $origin_cold == 1 ]] ||
        log "WARNING: $tag: $origin_cold requests for the cold key reached the origin (target 1)"
    sleep 0.3 # let the closed connections drain
}

run_coalescing() {
    local mode=$1 rep=$2 tag="b-$1-rep$2" inst c
    start_cacheguard cgA "$mode" "$tag" "$CGA_PORT" "$CGA_ADMIN" "$ORIGIN_PORT" ""
    start_cacheguard cgB "$mode" "$tag" "$CGB_PORT" "$CGB_ADMIN" "$ORIGIN_PORT" ""
    # the event bus must be live in both instances before a stampede means anything
    for inst in cgA cgB; do
        wait_bus "$tag $inst" "${ADMIN_OF[$inst]}" "$OUT/runs/$tag-$inst-metrics-start.txt" 15
        warm "${URL_OF[$inst]}$WARM_PATH" HIT-L1 HIT-L2
    done
    for c in $CONCURRENCIES; do run_stampede "$mode" "$rep" "$c"; done
    stop_cacheguard cgA
    stop_cacheguard cgB
}

for ((rep = 1; rep <= REPS; rep++)); do
    # shellcheck disable=SC2086 # word splitting of MODES is intended
    order=$(rotate $((rep - 1)) $MODES)
    for m in $order; do run_l2 "$m" "$rep"; done
    for m in $order; do run_coalescing "$m" "$rep"; done
done

for m in $MODES; do
    case $m in
    cluster) rcli "${CLUSTER_PORTS[0]}" cluster nodes | tr -d '\r' >"$OUT/topology/cluster-nodes-end.txt" || true ;;
    sentinel) rcli "${SENTINEL_PORTS[0]}" sentinel master "$MASTER_NAME" | tr -d '\r' | paste - - \
        >"$OUT/topology/sentinel-master-end.txt" || true ;;
    esac
done

end_env

# --- summary ---------------------------------------------------------------------------

col() { # col SECTION MODE C FIELD_NO: one raw.tsv column for one (section, mode[, C])
    awk -F'\t' -v s="$1" -v m="$2" -v c="$3" -v f="$4" \
        'NR > 1 && $1 == s && $2 == m && (c == "-" || $4 == c) { print $f }' "$RAW"
}
sum_col() { col "$@" | sum_lines; }
merge_hist() { col "$@" | merge_counts; } # "K=V,K=V" cells summed over the reps
# paired_ratio MODE: per rep, req/s of MODE / req/s of standalone in the same rep.
paired_ratio() {
    local v=()
    mapfile -t v < <(awk -F'\t' -v m="$1" '
        NR > 1 && $1 == "a" && $2 == "standalone" { base[$3] = $6 }
        NR > 1 && $1 == "a" && $2 == m { val[$3] = $6 }
        END { for (r in val) if (r in base && base[r] > 0) printf "%.4f\n", val[r] / base[r] }' "$RAW")
    ((${#v[@]} > 0)) || {
        printf '–'
        return
    }
    cell_dec 2 "${v[@]}"
}
# cell_rps V...: req/s as "median (min–max)" with thousands separators; a lone value when all
# values are equal.
cell_rps() {
    local med min max
    read -r med min max < <(stats "$@")
    if [[ $med == nan ]]; then
        printf '–'
    elif [[ $(fmt_int "$min") == "$(fmt_int "$max")" ]]; then
        fmt_int "$med"
    else
        printf '%s (%s–%s)' "$(fmt_int "$med")" "$(fmt_int "$min")" "$(fmt_int "$max")"
    fi
}
# pct_cell MODE: section a's HIT-L2 share as a percent, "median (min–max)".
pct_cell() {
    local v=() x
    for x in $(col a "$1" - 13); do v+=("$(awk -v s="$x" 'BEGIN { printf "%.4f", s * 100 }')"); done
    ((${#v[@]} > 0)) || {
        printf '–'
        return
    }
    printf '%s %%' "$(cell_dec 2 "${v[@]}")"
}
declare -A LABEL=(
    [standalone]="standalone (1 redis-server)"
    [cluster]="cluster (3 primaries + 3 replicas)"
    [sentinel]="sentinel (primary + replica, 3 sentinels)"
)

{
    echo "# cacheguard scale-out (Redis Cluster and Sentinel): $STAMP"
    echo
    echo "The same cacheguard on three Redis topologies, all on 127.0.0.1 on the same $(nproc) cores"
    echo "(load generator, cacheguard, origin and every redis-server share them)."
    echo "Each cell is **median (min–max) over $REPS rep(s)** (one value when they agree); modes rotate within each rep."
    env_summary
    echo
    echo "## a. L2-hit throughput, L1 off"
    echo
    echo "One cacheguard with \`l1 = \"off\"\`, $KEYS distinct 1 KiB keys all in Redis, \`wrk -t2 -c64 -d$DURATION --latency\` cycling over them (bench/id_list.lua)."
    echo
    echo "| mode | req/s | p50 ms | p99 ms | max ms | req/s vs standalone (paired per rep) | HIT-L2 share | errors / non-2xx | origin requests | CPU s cacheguard | CPU s redis |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    for m in $MODES; do
        ratio="1.00"
        [[ $m == standalone ]] || ratio=$(paired_ratio "$m")
        # shellcheck disable=SC2046 # one value per rep
        printf '| %s | %s | %s | %s | %s | %s | %s | %s / %s | %s | %s | %s |\n' "${LABEL[$m]}" \
            "$(cell_rps $(col a "$m" - 6))" "$(cell_dec 3 $(col a "$m" - 7))" "$(cell_dec 3 $(col a "$m" - 8))" \
            "$(cell_dec 1 $(col a "$m" - 9))" "$ratio" "$(pct_cell "$m")" \
            "$(sum_col a "$m" - 11)" "$(sum_col a "$m" - 12)" "$(sum_col a "$m" - 14)" \
            "$(cell_dec 2 $(col a "$m" - 17))" "$(cell_dec 2 $(col a "$m" - 18))"
    done
    echo
    outcomes=""
    for m in $MODES; do outcomes+="${outcomes:+; }$m: $(merge_hist a "$m" - 16)"; done
    echo "- HIT-L2 share: hit_l2 / all outcomes of \`cacheguard_requests_total\` between /metrics before and after the run; outcomes summed over the reps: $outcomes."
    echo "- req/s vs standalone: in each rep, the mode's req/s divided by standalone's req/s in the same rep."
    echo "- CPU s: user + system CPU seconds during the wrk run, of cacheguard and of the mode's redis-servers (sentinels included)."
    [[ -z ${SPREAD[cluster]:-} ]] || echo "- cluster: keys per primary after the first fill (port=DBSIZE, cacheguard's own keys such as the invalidation stream included): ${SPREAD[cluster]}."
    echo "- WARN/ERROR lines in cacheguard's log during the section: $(awk -F'\t' 'NR > 1 && $1 == "a" { s += $20 } END { print s + 0 }' "$RAW")."
    for c in $CONCURRENCIES; do
        echo
        echo "## b. Stampede coalescing, C = $c"
        echo
        echo "Two cacheguard instances (L1 default) sharing the topology, origin delay $DELAY_MS ms, $c GETs of one cold key released at once (half on each instance); a fresh key per run."
        echo
        echo "| mode | origin requests | answers 200 | p50 ms | p99 ms | max ms | errors / non-2xx | X-Cache (all reps) |"
        echo "|---|---|---|---|---|---|---|---|"
        for m in $MODES; do
            # shellcheck disable=SC2046
            printf '| %s | %s | %s | %s | %s | %s | %s / %s | %s |\n' "${LABEL[$m]}" \
                "$(cell_dec 0 $(col b "$m" "$c" 14))" "$(cell_dec 0 $(col b "$m" "$c" 15))" \
                "$(cell_dec 1 $(col b "$m" "$c" 7))" "$(cell_dec 1 $(col b "$m" "$c" 8))" \
                "$(cell_dec 1 $(col b "$m" "$c" 9))" "$(sum_col b "$m" "$c" 11)" "$(sum_col b "$m" "$c" 12)" \
                "$(merge_hist b "$m" "$c" 16)"
        done
    done
    echo
    echo "### lock events per stampede (deltas of \`cacheguard_lock_events_total\`; bus = \`cacheguard_event_bus_subscribed\` after the run)"
    echo
    echo "| mode | C | rep | origin requests | lock events | WARN/ERROR log lines |"
    echo "|---|---|---|---|---|---|"
    awk -F'\t' 'NR > 1 && $1 == "b" { printf "| %s | %s | %s | %s | %s | %s |\n", $2, $4, $3, $14, $19, $20 }' "$RAW"
    echo
    echo "## Scale-out target: 1 origin request per stampede in every mode"
    echo
    echo "| mode | C | origin requests per rep | verdict |"
    echo "|---|---|---|---|"
    for c in $CONCURRENCIES; do
        for m in $MODES; do
            o=$(col b "$m" "$c" 14 | tr '\n' ' ')
            ok=1
            for x in $o; do [[ $x == 1 ]] || ok=0; done
            echo "| ${LABEL[$m]} | $c | $o | $(verdict $ok) |"
        done
    done
    echo
    echo "Raw data: \`bench/results/scale-out-$STAMP/\` (raw.tsv, runs/: wrk outputs, loadgen JSON, origin stats, cacheguard logs, /metrics and /admin/redis around each run; configs/; topology/)."
} >"$OUT/summary.md"

show_summary
