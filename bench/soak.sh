#!/usr/bin/env bash
# Soak benchmark: two cacheguard instances sharing one Redis, minutes of mixed reads and writes,
# and Redis / pub/sub / disk faults injected on a schedule while the load runs. Not part of CI.
#
#   origin   bench/tools `bench-origin --kv --replica-lag-ms 0`: a versioned key-value store.
#            `PUT /kv/{key}` bumps the key's version and answers it; `GET /kv/{key}` answers
#            `{"key":..,"version":N}`, always the current version (no replica lag).
#   redis    one redis-server started here on 127.0.0.1:REDIS_PORT, its dir in the run
#            directory (redis/), no persistence (a restart comes back empty),
#            maxmemory REDIS_MAXMEMORY (256mb), maxmemory-policy REDIS_POLICY (noeviction).
#   cacheguard  TWO instances (release build, server.worker_threads CG_WORKERS), shared mode
#            on that Redis, each with `[journal] path` on its own tmpfs of JOURNAL_FS_SIZE
#            (512k; `mount -t tmpfs`, needs root; unmounted on exit). When the mount fails the
#            journals go to the run directory and the disk-fill fault is skipped (said in the
#            log and the summary). Routes (everything else at its documented default):
#              [[routes]] name = "kv"        match = "/kv/{key}"  methods = ["GET"]
#                         l1 = <phase>  ttl = TTL (1h: entries never expire during a run, so
#                         a stale copy cannot heal by expiring)
#              [[routes]] name = "kv-write"  match = "/kv/{key}"  methods = ["PUT"]
#                         invalidate = ["/kv/{key}"]  double_delete_delay = DD (200ms)
#   load     bench/tools `loadgen soak`: WRITERS (8) writer loops sharing WRITE_RATE (40) PUT/s and
#            READERS (32) reader loops sharing READ_RATE (400) GET/s, paced (not closed loop),
#            for DURATION (180) s over KEYS (200) keys, each request to a random instance.
#
# Faults, at offsets scaled by DURATION/180 (fault durations are not scaled), each logged with
# its time (faults.tsv):
#   10, 20, 50, 100, 130, 150 s   CLIENT KILL TYPE pubsub (drops both instances' event bus)
#   30 s, 110 s                   SIGKILL redis-server; the same command line again 5 s later
#   60 s, 140 s                   SIGSTOP redis-server for 2 s, then SIGCONT
#   75 s                          fill both journal tmpfs (dd), SIGKILL redis 1 s later, restart
#                                 it 10 s after that, delete the fillers 3 s after the restart
# The last 30 s (scaled) run without faults.
#
# Measured:
#   - during the run (loadgen): reads that started more than DD after a write to their key
#     returned version v and read a version < v ("stale reads"), per second; each second is
#     classified as inside a fault (+ BOUND_S after it healed) or outside. Outside must be 0:
#     after a fault heals, every key is current within BOUND_S (5 s). During a Redis outage
#     instances serve from L1 and invalidate only locally, so the other instance may serve
#     the old version until Redis is back (documented behaviour, counted separately).
#   - after the load: faults healed, then /readyz says `ready` on both admin ports, then
#     cacheguard_invalidations_held and cacheguard_journal_depth are 0 on both (each bounded by
#     SETTLE_MAX_S, 60 s; held invalidations are retried every 500 ms, journaled ones wake when
#     Redis returns), then DD + SETTLE_S (3 s). Then, for every key and both instances, GET
#     /kv/{key} through cacheguard and directly from the origin: `stale` = (instance, key) pairs
#     where cacheguard answers an older version. Goal: 0. When it is not, the check runs again
#     after RECHECK_S (30 s).
#   - every second: VmRSS and open fds of each instance, Redis used_memory, and from /metrics
#     cacheguard_invalidations_held, cacheguard_journal_failing, cacheguard_journal_depth,
#     cacheguard_redis_up, cacheguard_event_bus_subscribed (samples.tsv): start, peak, end.
#   - /metrics at the end: cacheguard_invalidations_total by source and result, journal
#     appended / applied, Redis restarts seen, event-bus resubscriptions, breaker openings.
#
# usage: bash bench/soak.sh
# env:   DURATION=180 (s, at least 120) L1_MODES="all" (route l1 per phase, run one after the
#        other with fresh instances, keys and Redis prefix, e.g. L1_MODES="all hot")
#        WRITERS=8 READERS=32 KEYS=200 WRITE_RATE=40 READ_RATE=400 DD=200ms TTL=1h
#        BOUND_S=5 SETTLE_S=3 SETTLE_MAX_S=60 RECHECK_S=30 CG_WORKERS=1
#        REDIS_MAXMEMORY=256mb REDIS_POLICY=noeviction JOURNAL_FS_SIZE=512k
#        CACHEGUARD_BIN=path (skip `cargo build --release`) BASE_PORT=29780 (uses +1 .. +6)
#        SEED=N (loadgen's choices; default from the clock, recorded) KEEP_TMP=1
#
# Writes bench/results/soak-<UTC timestamp>/ (env.txt; redis/ with each redis-server start's
# log; per phase l1-<mode>/: cg<n>.toml, cg<n>.log, journal-<n> (copied), faults.tsv,
# samples.tsv, loadgen.log and soak.json, /metrics before and after, check-<pass>.tsv;
# summary.md) and prints the markdown summary on stdout. Every process it starts is stopped
# on exit, by PID; the tmpfs mounts are unmounted.

set -euo pipefail

# shellcheck source=bench/lib.sh disable=SC1091 # followed with shellcheck -x
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults DURATION=180 L1_MODES=all WRITERS=8 READERS=32 KEYS=200 WRITE_RATE=40 READ_RATE=400 \
    DD=200ms TTL=1h BOUND_S=5 SETTLE_S=3 SETTLE_MAX_S=60 RECHECK_S=30 CG_WORKERS=1 \
    REDIS_MAXMEMORY=256mb REDIS_POLICY=noeviction JOURNAL_FS_SIZE=512k SEED= BASE_PORT=29780
INSTANCES=2
REQUEST_TIMEOUT_S=5 # per request of loadgen
LOAD_SLACK_S=60     # the whole loadgen run is bounded by DURATION + LOAD_SLACK_S

require_positive DURATION WRITERS READERS KEYS WRITE_RATE READ_RATE BOUND_S SETTLE_S SETTLE_MAX_S RECHECK_S
((DURATION >= 120)) || die "DURATION must be at least 120 s (the fault schedule needs it)"
check_list L1_MODES "l1 mode" all hot off
[[ -n ${L1_MODES// /} ]] || die "L1_MODES is empty: nothing to run"
[[ $CG_WORKERS =~ ^[0-9]+$ ]] || die "CG_WORKERS must be a non-negative integer"
[[ -z $SEED || $SEED =~ ^[0-9]+$ ]] || die "SEED must be a non-negative integer"
[[ $BASE_PORT =~ ^[0-9]+$ ]] || die "BASE_PORT must be a port number"
if [[ $DD =~ ^([0-9]+)ms$ ]]; then
    DD_MS=${BASH_REMATCH[1]}
elif [[ $DD =~ ^([0-9]+)s$ ]]; then
    DD_MS=$((BASH_REMATCH[1] * 1000))
else
    die "DD must be whole ms or s, e.g. 200ms (got '$DD')"
fi

bench_ports ORIGIN_PORT REDIS_PORT
cg_port() { echo $((BASE_PORT + 1 + 2 * $1)); }  # instance 1, 2: +3, +5
cg_admin() { echo $((BASE_PORT + 2 + 2 * $1)); } # instance 1, 2: +4, +6

now_ms() { date +%s%3N; }

bench_init

MOUNTS=()      # tmpfs mount points, unmounted on exit
REDIS_PID=""   # the running redis-server, if any
REDIS_STARTS=0 # how many times it was started

# soak_cleanup: stop every process (cacheguard first, so the journals are closed), unmount the
# tmpfs, then lib.sh's cleanup (which removes the scratch dir and exits with the status).
soak_cleanup() {
    local rc=$? pid mp
    trap - EXIT
    [[ -z $REDIS_PID ]] || kill -CONT "$REDIS_PID" 2>/dev/null || true
    for pid in "${BENCH_PIDS[@]}"; do stop_pid "$pid"; done
    for mp in "${MOUNTS[@]}"; do
        if mountpoint -q "$mp"; then
            umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || log "WARNING: could not unmount $mp"
        fi
    done
    (exit "$rc")
    bench_cleanup
}
trap soak_cleanup EXIT

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools redis-server:redis-server redis-cli:redis-tools curl:curl jq:jq
require_tools cargo awk timeout dd mount umount mountpoint df
ports=("${BENCH_PORTS[@]}")
for ((n = 1; n <= INSTANCES; n++)); do ports+=("$(cg_port "$n")" "$(cg_admin "$n")"); done
require_free_ports "${ports[@]}"
require_fd_limit 4096 "2 instances with $((WRITERS + READERS)) loops each"

build_bench_tools
build_cacheguard
log "cacheguard: $CG_BIN"

bench_results soak- redis
REDIS_DIR=$OUT/redis

# Can we mount a tmpfs? (root, and a kernel / container that allows it)
DISK_FAULT=1
DISK_NOTE="journals on their own ${JOURNAL_FS_SIZE} tmpfs each; disk-fill fault on"
probe=$BENCH_TMP/mount-probe
mkdir -p "$probe"
if mount -t tmpfs -o "size=$JOURNAL_FS_SIZE" tmpfs "$probe" 2>"$BENCH_TMP/mount.err"; then
    umount "$probe"
else
    DISK_FAULT=0
    DISK_NOTE="tmpfs mount failed ($(tr '\n' ' ' <"$BENCH_TMP/mount.err")): journals in the run directory, disk-fill fault SKIPPED"
    log "WARNING: $DISK_NOTE"
fi

write_env redis <<EOF
instances: $INSTANCES (shared Redis, standalone)
cacheguard_worker_threads: $CG_WORKERS (per instance)
redis_config: maxmemory $REDIS_MAXMEMORY, maxmemory-policy $REDIS_POLICY, no persistence
journals: $DISK_NOTE
load: loadgen soak, $WRITERS writers ($WRITE_RATE PUT/s), $READERS readers ($READ_RATE GET/s), $KEYS keys, ${DURATION} s, paced
routes: kv GET ttl $TTL, l1 per phase ($L1_MODES); kv-write PUT invalidate /kv/{key}, double_delete_delay $DD
bound: every key current within ${BOUND_S} s of a fault healing
EOF

# --- origin and Redis ----------------------------------------------------------------------

ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_origin "$OUT/origin.log" bench-origin "$ORIGIN_PORT" --threads 1 --kv --replica-lag-ms 0
[[ $(curl -s --max-time 2 "$ORIGIN/kv/preflight" | jq -r .version) == 0 ]] ||
    die "bench-origin does not answer GET /kv/{key} (KV mode)"

# redis_start: redis-server on REDIS_PORT (the same command line every time), waited for until
# it answers PING (15 s). Sets REDIS_PID.
redis_start() {
    local deadline=$((SECONDS + 15))
    REDIS_STARTS=$((REDIS_STARTS + 1))
    start_bg "$REDIS_DIR/redis-$REDIS_STARTS.log" redis-server --bind 127.0.0.1 --port "$REDIS_PORT" \
        --dir "$REDIS_DIR" --save "" --appendonly no --daemonize no \
        --maxmemory "$REDIS_MAXMEMORY" --maxmemory-policy "$REDIS_POLICY"
    REDIS_PID=$LAST_PID
    while ((SECONDS < deadline)); do
        kill -0 "$REDIS_PID" 2>/dev/null || die "redis-server exited; see $REDIS_DIR/redis-$REDIS_STARTS.log"
        [[ $(timeout 1 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]] && return 0
        sleep 0.1
    done
    die "redis-server did not answer PING on port $REDIS_PORT within 15 s"
}

# redis_kill: SIGKILL the redis-server we started, and reap it.
redis_kill() {
    [[ -n $REDIS_PID ]] || return 0
    kill -KILL "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
    forget_pid "$REDIS_PID"
    REDIS_PID=""
}

redis_cli() { timeout 2 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@" 2>&1; }

redis_start

# --- cacheguard ----------------------------------------------------------------------------

# cacheguard_config N L1 JOURNAL KEY_PREFIX
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

[journal]
path = "$3"

[[routes]]
name = "kv"
match = "/kv/{key}"
methods = ["GET"]
l1 = "$2"
ttl = "$TTL"

[[routes]]
name = "kv-write"
match = "/kv/{key}"
methods = ["PUT"]
invalidate = ["/kv/{key}"]
double_delete_delay = "$DD"
EOF
}

# --- faults ----------------------------------------------------------------------------------

# schedule: "offset_ms action" lines, sorted (see the header).
schedule() {
    ev() { echo "$(($1 * DURATION * 1000 / 180 + ${3:-0} * 1000)) $2"; }
    {
        for t in 10 20 50 100 130 150; do ev "$t" pubsub_kill; done
        for t in 30 110; do
            ev "$t" redis_kill
            ev "$t" redis_start 5
        done
        for t in 60 140; do
            ev "$t" redis_stop
            ev "$t" redis_cont 2
        done
        if ((DISK_FAULT)); then ev 75 disk_fill; fi
        ev 75 redis_kill 1
        ev 75 redis_start 11
        if ((DISK_FAULT)); then ev 75 disk_free 14; fi
    } | sort -n -s -k1,1
}

# fault ACTION FILE: do one fault action; append "start_unix_ms done_unix_ms action detail" to
# FILE (done: when the action returned, e.g. the restarted Redis answered PING) and log it.
fault() {
    local action=$1 file=$2 detail="" mp at
    at=$(now_ms)
    case $action in
    pubsub_kill) detail="clients killed: $(redis_cli CLIENT KILL TYPE pubsub | tr '\n' ' ')" ;;
    redis_kill)
        detail="pid $REDIS_PID"
        redis_kill
        ;;
    redis_start)
        redis_start
        detail="pid $REDIS_PID"
        ;;
    redis_stop)
        kill -STOP "$REDIS_PID"
        detail="pid $REDIS_PID"
        ;;
    redis_cont)
        kill -CONT "$REDIS_PID"
        detail="pid $REDIS_PID"
        ;;
    disk_fill)
        for mp in "${PHASE_MOUNTS[@]}"; do
            dd if=/dev/zero of="$mp/filler" bs=16k 2>/dev/null || true
            detail+="$(basename "$mp"): $(df --output=avail -B1 "$mp" | tail -n1 | tr -d ' ') B free; "
        done
        ;;
    disk_free)
        for mp in "${PHASE_MOUNTS[@]}"; do rm -f "$mp/filler"; done
        detail="fillers removed"
        ;;
    *) die "unknown fault $action" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$at" "$(now_ms)" "$action" "$detail" >>"$file"
    log "fault: $action ($detail)"
}

# heal FILE: whatever a fault left behind (Redis down or stopped, a filler) is undone.
heal() {
    local mp
    [[ -z $REDIS_PID ]] || kill -CONT "$REDIS_PID" 2>/dev/null || true
    [[ -n $REDIS_PID ]] || fault redis_start "$1"
    for mp in "${PHASE_MOUNTS[@]}"; do rm -f "$mp/filler"; done
}

# --- sampling -----------------------------------------------------------------------------

# sampler STOPFILE PID1 ADMIN1 PID2 ADMIN2: one line per second on stdout until STOPFILE
# exists (bounded: DURATION + 20 min of lines).
sampler() {
    local stop=$1 i n pid admin m rss fds mem line name
    shift
    local targets=("$@") mets=()
    printf 'unix_ms\trss_kb_1\tfds_1\trss_kb_2\tfds_2\tredis_used_memory\theld_1\theld_2\tjournal_failing_1\tjournal_failing_2\tjournal_depth_1\tjournal_depth_2\tredis_up_1\tredis_up_2\tbus_1\tbus_2\n'
    m=$BENCH_TMP/sampler-metrics
    for ((i = 0; i < DURATION + 1200; i++)); do
        [[ -e $stop ]] && break
        line="$(now_ms)"
        mets=()
        for n in 1 2; do
            pid=${targets[2 * n - 2]} admin=${targets[2 * n - 1]}
            rss=$(proc_kb "$pid" VmRSS || true)
            fds=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
            line+=$'\t'"${rss:-NA}"$'\t'"$fds"
            save_metrics "$admin" "$m-$n"
            mets+=("$m-$n")
        done
        mem=$(timeout 1 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" INFO memory 2>/dev/null |
            tr -d '\r' | awk -F: '$1 == "used_memory" { print $2 }' || true)
        line+=$'\t'"${mem:-NA}"
        for name in cacheguard_invalidations_held cacheguard_journal_failing cacheguard_journal_depth \
            cacheguard_redis_up cacheguard_event_bus_subscribed; do
            for n in 1 2; do
                if [[ -s ${mets[n - 1]} ]]; then
                    line+=$'\t'"$(metric "${mets[n - 1]}" "$name")"
                else
                    line+=$'\t'NA
                fi
            done
        done
        echo "$line"
        sleep 1
    done
}

# col_stats FILE COLUMN: "start peak end" of one column of samples.tsv (NA rows skipped).
col_stats() {
    awk -F'\t' -v c="$2" 'NR > 1 && $c != "NA" && $c != "" {
            if (n == 0) first = $c
            if (n == 0 || $c + 0 > peak) peak = $c + 0
            last = $c; n++
        }
        END { if (n == 0) print "NA NA NA"; else print first, peak, last }' "$1"
}

# --- one phase -----------------------------------------------------------------------------

declare -A R # results, R[<phase>.<field>]
PHASES=()
PHASE_MOUNTS=()

# wait_all WHAT LIMIT_S CMD...: run CMD (a check of both instances) every 0.2 s until it
# succeeds; prints the seconds it took, or "timeout" after LIMIT_S.
wait_all() {
    local what=$1 limit=$2 t0
    shift 2
    t0=$(now_ms)
    while ! "$@"; do
        if (($(now_ms) - t0 > limit * 1000)); then
            log "WARNING: $what not reached within $limit s"
            echo timeout
            return 0
        fi
        sleep 0.2
    done
    awk -v ms=$(($(now_ms) - t0)) 'BEGIN { printf "%.1f", ms / 1000 }'
}

both_ready() {
    local n
    for n in 1 2; do
        [[ $(curl -s --max-time 1 "http://127.0.0.1:$(cg_admin "$n")/readyz") == ready ]] || return 1
    done
}

both_drained() {
    local n f=$BENCH_TMP/drain-metrics
    for n in 1 2; do
        save_metrics "http://127.0.0.1:$(cg_admin "$n")" "$f"
        [[ -s $f ]] || return 1
        (($(metric "$f" cacheguard_invalidations_held) == 0)) || return 1
        (($(metric "$f" cacheguard_journal_depth) == 0)) || return 1
    done
}

# check_keys PHASE_DIR PREFIX PASS: for every key and instance, the version through cacheguard
# against the origin's; writes check-PASS.tsv and prints "stale errors".
check_keys() {
    local dir=$1 prefix=$2 pass=$3 i n key want resp status xc got stale=0 errs=0
    local file=$dir/check-$pass.tsv
    printf 'key\torigin_version\tinstance\tstatus\tx_cache\tversion\tstale\n' >"$file"
    for ((i = 0; i < KEYS; i++)); do
        key=$prefix$i
        want=$(curl -s --max-time 5 "$ORIGIN/kv/$key" | jq -r '.version // "err"' 2>/dev/null || echo err)
        for n in 1 2; do
            resp=$(curl -s -i --max-time 5 "http://127.0.0.1:$(cg_port "$n")/kv/$key" | tr -d '\r' || true)
            status=$(head -n1 <<<"$resp" | awk '{ print $2 }')
            xc=$(awk -F': ' 'tolower($1) == "x-cache" { print $2 }' <<<"$resp")
            got=$(tail -n1 <<<"$resp" | jq -r '.version // "err"' 2>/dev/null || echo err)
            local s=0
            if [[ $status != 200 || $got == err || $want == err ]]; then
                errs=$((errs + 1))
                s=err
            elif ((got < want)); then
                stale=$((stale + 1))
                s=1
            fi
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$key" "$want" "$n" "${status:-none}" "${xc:-none}" "$got" "$s" >>"$file"
        done
    done
    echo "$stale $errs"
}

# inv_counts METRICS: the non-zero cacheguard_invalidations_total samples as "source/result=N, ...".
inv_counts() {
    awk '$1 ~ /^cacheguard_invalidations_total\{/ && $2 + 0 > 0 {
            s = $1; sub(/.*source="/, "", s); sub(/".*/, "", s)
            r = $1; sub(/.*result="/, "", r); sub(/".*/, "", r)
            printf "%s%s/%s=%d", (n++ ? ", " : ""), s, r, $2
        }
        END { if (n == 0) printf "none" }' "$1"
}

# run_phase L1 INDEX
run_phase() {
    local l1=$1 idx=$2 name dir n mp conf pids=() urls=() prefix keyp
    name=l1-$l1
    dir=$OUT/$name
    mkdir -p "$dir"
    PHASES+=("$name")
    prefix="soak-$idx:"
    keyp="p$idx-"
    log "phase $name: l1 = \"$l1\""

    PHASE_MOUNTS=()
    for ((n = 1; n <= INSTANCES; n++)); do
        if ((DISK_FAULT)); then
            mp=$BENCH_TMP/journal-fs-$idx-$n
            mkdir -p "$mp"
            mount -t tmpfs -o "size=$JOURNAL_FS_SIZE" tmpfs "$mp" || die "mount tmpfs on $mp failed"
            MOUNTS+=("$mp")
        else
            mp=$dir/journal-dir-$n
            mkdir -p "$mp"
        fi
        PHASE_MOUNTS+=("$mp")
        conf=$dir/cg$n.toml
        cacheguard_config "$n" "$l1" "$mp/journal" "$prefix" >"$conf"
        "$CG_BIN" --check-config "$conf" >"$dir/check-config-$n.txt" 2>&1 ||
            die "cacheguard --check-config $conf failed: $(cat "$dir/check-config-$n.txt")"
        start_bg "$dir/cg$n.log" "$CG_BIN" --config "$conf"
        pids+=("$LAST_PID")
        urls+=(--url "http://127.0.0.1:$(cg_port "$n")")
    done
    for ((n = 1; n <= INSTANCES; n++)); do
        wait_http "http://127.0.0.1:$(cg_admin "$n")/healthz" "${pids[n - 1]}" "cacheguard $n ($name)"
        wait_bus "cacheguard $n" "http://127.0.0.1:$(cg_admin "$n")" "$dir/metrics-$n-before.txt"
    done

    # sampler
    local stopfile=$BENCH_TMP/sampler-stop-$idx
    rm -f "$stopfile"
    sampler "$stopfile" "${pids[0]}" "http://127.0.0.1:$(cg_admin 1)" "${pids[1]}" "http://127.0.0.1:$(cg_admin 2)" \
        >"$dir/samples.tsv" 2>"$dir/sampler.err" &
    local sampler_pid=$!
    BENCH_PIDS+=("$sampler_pid")

    # load
    local seed_args=()
    [[ -z $SEED ]] || seed_args=(--seed "$SEED")
    log "loadgen soak: $WRITERS writers ($WRITE_RATE/s), $READERS readers ($READ_RATE/s), $KEYS keys, ${DURATION} s"
    start_bg "$dir/loadgen.log" timeout -k 5 $((DURATION + LOAD_SLACK_S)) \
        "$LOADGEN_BIN" soak "${urls[@]}" --path-template '/kv/{key}' \
        --writers "$WRITERS" --readers "$READERS" --keys "$KEYS" --key-prefix "$keyp" \
        --write-rate "$WRITE_RATE" --read-rate "$READ_RATE" --duration-s "$DURATION" \
        --delay-ms "$DD_MS" --timeout-s "$REQUEST_TIMEOUT_S" "${seed_args[@]}"
    local lg_pid=$LAST_PID t0 off action
    t0=$(now_ms)

    # faults, on schedule, while the load runs
    : >"$dir/faults.tsv"
    while read -r off action; do
        while (($(now_ms) < t0 + off)); do
            kill -0 "$lg_pid" 2>/dev/null || break 2
            sleep 0.1
        done
        fault "$action" "$dir/faults.tsv"
    done < <(schedule)
    kill -0 "$lg_pid" 2>/dev/null || log "WARNING: loadgen ended before the fault schedule did"

    local rc=0
    reap "$lg_pid" || rc=$?
    heal "$dir/faults.tsv"
    local healed_ms
    healed_ms=$(now_ms)
    grep '^{' "$dir/loadgen.log" | tail -n1 >"$dir/soak.json" || true
    if ((rc != 0)) || ! jq -e .mode "$dir/soak.json" >/dev/null 2>&1; then
        die "loadgen soak failed (exit $rc); see $dir/loadgen.log"
    fi
    for ((n = 1; n <= INSTANCES; n++)); do
        kill -0 "${pids[n - 1]}" 2>/dev/null || log "WARNING: cacheguard $n (PID ${pids[n - 1]}) is gone; see $dir/cg$n.log"
    done

    # settle: ready, nothing owed, then DD + SETTLE_S
    R[$name.ready_s]=$(wait_all "/readyz ready on both" "$SETTLE_MAX_S" both_ready)
    R[$name.drained_s]=$(wait_all "held = 0 and journal depth = 0 on both" "$SETTLE_MAX_S" both_drained)
    sleep "$(awk -v d="$DD_MS" -v s="$SETTLE_S" 'BEGIN { printf "%.3f", d / 1000 + s }')"
    R[$name.check_after_s]=$(awk -v ms=$(($(now_ms) - healed_ms)) 'BEGIN { printf "%.1f", ms / 1000 }')
    local stale errs
    read -r stale errs < <(check_keys "$dir" "$keyp" 1)
    R[$name.stale1]=$stale
    R[$name.checkerr1]=$errs
    R[$name.stale2]="–"
    log "$name: final check: $stale stale (instance, key) pairs, $errs errors, of $((KEYS * INSTANCES))"
    if ((stale > 0)); then
        log "$name: stale > 0: checking again in $RECHECK_S s"
        sleep "$RECHECK_S"
        read -r stale errs < <(check_keys "$dir" "$keyp" 2)
        R[$name.stale2]="$stale ($errs errors, after ${RECHECK_S} s more)"
    fi

    touch "$stopfile"
    reap "$sampler_pid" || true
    for ((n = 1; n <= INSTANCES; n++)); do
        save_metrics "http://127.0.0.1:$(cg_admin "$n")" "$dir/metrics-$n-after.txt"
        R[$name.alive$n]=$(if kill -0 "${pids[n - 1]}" 2>/dev/null; then echo yes; else echo "NO (exited)"; fi)
    done
    for pid in "${pids[@]}"; do stop_pid "$pid"; done
    for ((n = 1; n <= INSTANCES; n++)); do
        mp=${PHASE_MOUNTS[n - 1]}
        cp "$mp/journal" "$dir/journal-$n" 2>/dev/null || true
        if ((DISK_FAULT)); then
            umount "$mp" || log "WARNING: could not unmount $mp"
        fi
        R[$name.warn$n]=$(grep -c -E 'WARN|ERROR' "$dir/cg$n.log" || true)
        R[$name.panic$n]=$(grep -c -i 'panic' "$dir/cg$n.log" || true)
    done
    R[$name.t0]=$(jq -r .start_unix_ms "$dir/soak.json")
    log "$name: $(jq -c '{writes, reads, status_5xx, errors, stale_reads_after_delay, last_stale_read_s, dropped_slots}' "$dir/soak.json")"
}

idx=0
for l1 in $L1_MODES; do
    idx=$((idx + 1))
    run_phase "$l1" "$idx"
done

end_env

# --- summary -------------------------------------------------------------------------------

# fault_windows PHASE MODE: the stale reads of the run (loadgen's stale_read_times_s), each given
# to the latest fault window that started at or before it. A window is a pub/sub kill, a Redis
# SIGKILL up to its restart answering PING, a SIGSTOP up to its SIGCONT, a disk fill up to the
# restart of the Redis outage inside it, a disk free. A stale read before the window healed
# is "during"; up to BOUND_S after, "after heal"; later (or before any fault), "outside".
# MODE rows: one markdown row per window; MODE totals: "during after outside max_after_ms".
fault_windows() {
    local dir=$OUT/$1
    jq -r '.stale_read_times_s[]' "$dir/soak.json" |
        awk -v t0="${R[$1.t0]}" -v bound="$BOUND_S" -v faults="$dir/faults.tsv" -v mode="$2" '
            BEGIN {
                FS = "\t"
                while ((getline line < faults) > 0) {
                    split(line, f, "\t"); a = f[3]
                    st = (f[1] - t0) / 1000; dn = (f[2] - t0) / 1000
                    if (a == "redis_kill" || a == "redis_stop" || a == "disk_fill") {
                        if (open) { lab[k] = lab[k] " + " a; continue }
                        k++; s[k] = st; lab[k] = a; open = 1
                    } else if (a == "redis_start" || a == "redis_cont") {
                        if (open) { h[k] = dn; lab[k] = lab[k] " → " a; open = 0 }
                        else { k++; s[k] = st; h[k] = dn; lab[k] = a }
                    } else if (open) {
                        lab[k] = lab[k] " + " a
                    } else { k++; s[k] = st; h[k] = dn; lab[k] = a }
                }
                if (open) h[k] = 1e12
                FS = " "
            }
            {
                t = $1 + 0; w = 0
                for (i = 1; i <= k; i++) if (s[i] <= t) w = i
                if (w == 0) { outside++; next }
                if (t < h[w]) { during[w]++; dur++ }
                else if (t - h[w] <= bound) {
                    after[w]++; aft++
                    d = (t - h[w]) * 1000
                    if (d > maxa[w]) maxa[w] = d
                    if (d > maxall) maxall = d
                } else { beyond[w]++; outside++ }
            }
            END {
                if (mode == "totals") { printf "%d %d %d %.0f\n", dur, aft, outside, maxall; exit }
                for (i = 1; i <= k; i++)
                    printf "| %.1f | %s | %s | %d | %d | %s | %d |\n", s[i], lab[i],
                        (h[i] >= 1e12 ? "not healed" : sprintf("%.1f", h[i])), during[i], after[i],
                        (after[i] ? sprintf("%.0f", maxa[i]) : "–"), beyond[i]
            }'
}

# fault_rows PHASE: the fault log as markdown rows, times from the load start.
fault_rows() {
    awk -F'\t' -v t0="${R[$1.t0]}" '{ printf "| %.1f | %.1f | %s | %s |\n", ($1 - t0) / 1000, ($2 - t0) / 1000, $3, $4 }' "$OUT/$1/faults.tsv"
}

# res_cell PHASE COLUMN [DIV]: "start / peak / end" of a samples.tsv column (divided by DIV).
res_cell() {
    local a b c
    read -r a b c < <(col_stats "$OUT/$1/samples.tsv" "$2")
    if [[ $a == NA ]]; then
        echo "NA"
    else
        awk -v a="$a" -v b="$b" -v c="$c" -v d="${3:-1}" -v u="${4:-}" \
            'BEGIN { printf "%.1f / %.1f / %.1f%s", a / d, b / d, c / d, u }'
    fi
}

j() { jq -r "$2" "$OUT/$1/soak.json"; }

{
    echo "# cacheguard soak: $STAMP"
    echo
    echo "$INSTANCES cacheguard instances sharing one Redis in front of \`bench-origin --kv --replica-lag-ms 0\`;"
    echo "\`loadgen soak\`: $WRITERS writers ($WRITE_RATE PUT/s) and $READERS readers ($READ_RATE GET/s), paced, $KEYS keys, ${DURATION} s per phase, every request to a random instance;"
    echo "faults injected on a schedule while it runs (pub/sub kills, Redis SIGKILL + restart, Redis SIGSTOP, full journal disks). $DISK_NOTE."
    echo "All processes on 127.0.0.1 on the same $(nproc) cores."
    echo
    env_summary
    echo
    echo "## Freshness"
    echo
    echo "| l1 | writes | reads | 5xx | errors | stale reads during faults | stale reads ≤ ${BOUND_S} s after a heal | latest of those (ms after the heal) | **stale reads outside** | ready after load end (s) | held/journal drained (s) | check at (s after load end) | **final stale pairs** | recheck |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for p in "${PHASES[@]}"; do
        read -r during after outside max_after < <(fault_windows "$p" totals)
        printf '| %s | %s | %s | %s | %s | %s | %s | %s | **%s** | %s | %s | %s | **%s** / %s | %s |\n' "${p#l1-}" \
            "$(j "$p" .writes)" "$(j "$p" .reads)" "$(j "$p" .status_5xx)" "$(j "$p" .errors)" \
            "$during" "$after" "$max_after" "$outside" "${R[$p.ready_s]}" "${R[$p.drained_s]}" \
            "${R[$p.check_after_s]}" "${R[$p.stale1]}" "$((KEYS * INSTANCES))" "${R[$p.stale2]}"
    done
    echo
    echo "## Resources (start / peak / end, sampled every second)"
    echo
    echo "| l1 | RSS cg1 (MiB) | RSS cg2 (MiB) | fds cg1 | fds cg2 | Redis used_memory (MiB) | held peak cg1/cg2 | journal_failing peak cg1/cg2 |"
    echo "|---|---|---|---|---|---|---|---|"
    for p in "${PHASES[@]}"; do
        f=$OUT/$p/samples.tsv
        printf '| %s | %s | %s | %s | %s | %s | %s / %s | %s / %s |\n' "${p#l1-}" \
            "$(res_cell "$p" 2 1024)" "$(res_cell "$p" 4 1024)" "$(res_cell "$p" 3)" "$(res_cell "$p" 5)" \
            "$(res_cell "$p" 6 1048576)" \
            "$(col_stats "$f" 7 | awk '{ print $2 }')" "$(col_stats "$f" 8 | awk '{ print $2 }')" \
            "$(col_stats "$f" 9 | awk '{ print $2 }')" "$(col_stats "$f" 10 | awk '{ print $2 }')"
    done
    echo
    echo "## Counters at the end (/metrics)"
    echo
    echo "| l1 | instance | invalidations_total (source/result) | held | journal_failing | journal appended / applied | Redis restarts seen | bus resubscriptions | breaker opened | WARN/ERROR lines | panics | alive at end |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    for p in "${PHASES[@]}"; do
        for n in 1 2; do
            m=$OUT/$p/metrics-$n-after.txt
            printf '| %s | cg%s | %s | %s | %s | %s / %s | %s | %s | %s | %s | %s | %s |\n' "${p#l1-}" "$n" \
                "$(inv_counts "$m")" "$(metric "$m" cacheguard_invalidations_held)" \
                "$(metric "$m" cacheguard_journal_failing)" "$(metric "$m" cacheguard_journal_appended_total)" \
                "$(metric "$m" cacheguard_journal_applied_total)" "$(metric "$m" cacheguard_redis_restarts_total)" \
                "$(metric "$m" cacheguard_event_bus_resubscriptions_total)" \
                "$(metric "$m" 'cacheguard_redis_breaker_transitions_total{to="open"}')" \
                "${R[$p.warn$n]}" "${R[$p.panic$n]}" "${R[$p.alive$n]}"
        done
    done
    echo
    for p in "${PHASES[@]}"; do
        echo "- ${p#l1-}: reads by X-Cache $(j "$p" '.read_x_cache | to_entries | map("\(.key)=\(.value)") | join(", ")');" \
            "read statuses $(j "$p" '.read_status | to_entries | map("\(.key)=\(.value)") | join(", ")');" \
            "write statuses $(j "$p" '.write_status | to_entries | map("\(.key)=\(.value)") | join(", ")');" \
            "stale reads by instance $(j "$p" '.stale_by_instance | map(tostring) | join("/")'), by X-Cache $(j "$p" '.stale_by_x_cache | to_entries | map("\(.key)=\(.value)") | join(", ") | if . == "" then "–" else . end');" \
            "read p99 $(j "$p" .read_latency_ms.p99) ms, write p99 $(j "$p" .write_latency_ms.p99) ms; dropped slots $(j "$p" .dropped_slots)."
    done
    echo "- stale read: a read that started more than double_delete_delay ($DD) after some write to its key returned version v, and read an older version. Each is given to the latest fault window that started before it: during it (before it healed: the restarted Redis answered PING, SIGCONT, ...), within ${BOUND_S} s after it healed, or outside (later, or before any fault). During a Redis outage the other instance is expected to serve the old version from L1 until Redis is back; outside must be 0."
    echo "- final stale pairs: after the load and the faults stopped, /readyz \`ready\` and nothing owed on both instances, and $DD + ${SETTLE_S} s: (instance, key) pairs where GET through cacheguard answered an older version than the origin. Goal 0."
    echo
    for p in "${PHASES[@]}"; do
        echo "### Faults and stale reads, ${p#l1-} (seconds from the load start)"
        echo
        echo "| from (s) | fault window | healed (s) | stale reads during | ≤ ${BOUND_S} s after heal | latest after heal (ms) | later |"
        echo "|---|---|---|---|---|---|---|"
        fault_windows "$p" rows
        echo
        echo "<details><summary>fault log</summary>"
        echo
        echo "| start (s) | done (s) | action | detail |"
        echo "|---|---|---|---|"
        fault_rows "$p"
        echo
        echo "</details>"
        echo
    done
    echo "Raw data: \`bench/results/soak-$STAMP/\` (per phase: soak.json with the per-second timeline, samples.tsv, faults.tsv, check-*.tsv, configs, logs, /metrics before and after)."
} >"$OUT/summary.md"

show_summary
