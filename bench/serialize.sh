#!/usr/bin/env bash
# Serialized-writes benchmark, in one run on this machine:
#
#   origin   bench/tools `bench-origin --kv`: PUT, PATCH and DELETE /kv/{key} commit the key's
#            next version after DELAY_MS (1 ms) and answer 200
#   redis    one redis-server (no persistence)
#   cacheguard  release build, three instances on that Redis, each with three write routes on
#            /kv/{key}: PUT serialized (wait_timeout 2s, fence_header), PATCH not serialized (the
#            same write without the lock: the reference), DELETE serialized with wait_timeout
#            BOUNDED_WAIT_MS (200 ms), for the wait bound
#   load     bench/tools `loadgen writes`: closed loop, C keep-alive connections per instance,
#            each writing the next key as soon as its last write answered
#
# After a 2 s warm-up of every instance, per rep (REPS=3), each phase DURATION_S (5) seconds, every
# write in it counted:
#   direct   1 connection to the origin itself, PUT over KEYS keys: a write's time at the origin
#            (its 1 ms sleep on tokio's millisecond timer, and the HTTP exchange), the floor of a
#            write and so the ceiling of one resource's serialized rate, 1 / this
#   plain    1 connection to instance 1, PATCH over KEYS (1000) keys: unserialized latency
#   uncont   1 connection to instance 1, PUT over KEYS keys: uncontended serialized latency, and
#            the Redis commands per write (INFO commandstats: every command Redis executed,
#            the scripts' own included; and what cacheguard sent, from its own counters)
#            (plain and uncont alternate which goes first, rep by rep)
#   one      ONE_CONNS (8) connections per instance, PUT of one key: one resource's throughput
#            (writes queue in each instance: most handoffs pass the lock on within one)
#   cross    1 connection per instance, PUT of one key: writes never queue in an instance, so
#            the lock goes from one instance to another (release, its event, an acquire)
#            nearly every time; the origin's write gap (from a write's commit to the next
#            write of the key arriving, bench-origin's kv_write_gap_us) is that handoff as the
#            origin sees it, the release's own round trip included
#   many     MANY_CONNS (32) connections per instance, PUT over KEYS keys
#   manyplain  the same with PATCH: the fleet's unserialized throughput, for the ratio
#   bounded  BOUNDED_CONNS (64) connections per instance, DELETE of one key with wait_timeout
#            BOUNDED_WAIT_MS: more waiters than the lock can serve in time, so some are refused;
#            no answer may take longer than wait_timeout + 50 ms (+ the write itself)
#
# Targets, each rep's ratios to its own baselines: one >= 0.8 x direct's writes/s (the origin
# driven one write at a time: the ceiling of one resource); many >= 0.7 x manyplain;
# uncont p50 - plain p50 <= 0.25 ms; cross: the write gap's p99 <= 1 ms. Also reported, as
# before: Redis commands per uncontended write (<= 3) and bounded: the slowest answer <=
# wait_timeout + 50 ms + 5 ms.
#
# usage: bash bench/serialize.sh
# env:   REPS=3 DURATION_S=5 DELAY_MS=1 KEYS=1000 ONE_CONNS=8 MANY_CONNS=32
#        BOUNDED_CONNS=64 BOUNDED_WAIT_MS=200 BASE_PORT=29400 (uses BASE_PORT+1 .. +8)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        PROFILE="one" (phases of rep 1 to profile with `perf record -a -g` for 3 s; needs perf)
#        TOOLS_TARGET=dir (where bench/tools is built; default bench/results/tools-target)
#
# Writes bench/results/serialize-<UTC timestamp>/ (loadgen JSON, commandstats and /metrics
# before/after each phase, raw.tsv, summary.md) and prints the markdown summary on stdout.
# Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

export LC_ALL=C

bench_defaults REPS=3 DURATION_S=5 DELAY_MS=1 KEYS=1000 ONE_CONNS=8 MANY_CONNS=32 \
    BOUNDED_CONNS=64 BOUNDED_WAIT_MS=200 BASE_PORT=29400
WAIT_TIMEOUT_MS=2000

bench_ports ORIGIN_PORT REDIS_PORT CG1_PORT CG1_ADMIN CG2_PORT CG2_ADMIN CG3_PORT CG3_ADMIN

require_positive REPS DURATION_S DELAY_MS KEYS ONE_CONNS MANY_CONNS BOUNDED_CONNS \
    BOUNDED_WAIT_MS

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools redis-server:redis-server redis-cli:redis-tools curl:curl jq:jq
require_tools cargo awk sort mktemp ss timeout
require_free_ports "${BENCH_PORTS[@]}"
require_fds_for_concurrency $((3 * BOUNDED_CONNS))

build_bench_tools
build_cacheguard
bench_results serialize- runs

write_env redis <<EOF
reps: $REPS
phase_s: $DURATION_S
origin_write_ms: $DELAY_MS
keys: $KEYS
connections_per_instance: one=$ONE_CONNS many=$MANY_CONNS bounded=$BOUNDED_CONNS (plain, uncont: 1 in all)
serialize: lease 5s, wait_timeout ${WAIT_TIMEOUT_MS}ms (bounded: ${BOUNDED_WAIT_MS}ms), max_waiters 1024; redis command_timeout 200ms
EOF

# --- origin, Redis, cacheguard -----------------------------------------------------------

start_origin "$OUT/origin.log" origin "$ORIGIN_PORT" --kv --kv-write-delay-ms "$DELAY_MS" \
    --replica-lag-ms 0
ORIGIN=http://127.0.0.1:$ORIGIN_PORT
start_redis redis "$REDIS_PORT"

# serialize_config PORT ADMIN JOURNAL: one instance's config (the three routes above).
serialize_config() {
    cat <<EOF
[server]
listen = "127.0.0.1:$1"

[upstream]
url = "http://127.0.0.1:$ORIGIN_PORT"
max_concurrency = 1024
queue_timeout = "5s"

[admin]
listen = "127.0.0.1:$2"

[redis]
url = "redis://127.0.0.1:$REDIS_PORT"
# 200 ms, not the default 50 ms: this 2-core box runs the load, the origin, Redis and three
# instances at 100 % CPU, and a breaker opened by a scheduling hiccup measures nothing.
command_timeout = "200ms"

[journal]
path = "$3"

[[routes]]
name = "kv-serialized"
match = "/kv/{key}"
methods = ["PUT"]
serialize = { key = "/kv/{key}", lease = "5s", wait_timeout = "${WAIT_TIMEOUT_MS}ms", max_waiters = 1024, fence_header = "fencing-token" }

[[routes]]
name = "kv-plain"
match = "/kv/{key}"
methods = ["PATCH"]

[[routes]]
name = "kv-bounded"
match = "/kv/{key}"
methods = ["DELETE"]
serialize = { key = "/kv/{key}", lease = "5s", wait_timeout = "${BOUNDED_WAIT_MS}ms", max_waiters = 1024, fence_header = "fencing-token" }
EOF
}

INSTANCES="cg1 cg2 cg3"
declare -A PORT_OF=([cg1]=$CG1_PORT [cg2]=$CG2_PORT [cg3]=$CG3_PORT)
declare -A ADMIN_PORT_OF=([cg1]=$CG1_ADMIN [cg2]=$CG2_ADMIN [cg3]=$CG3_ADMIN)
for name in $INSTANCES; do
    serialize_config "${PORT_OF[$name]}" "${ADMIN_PORT_OF[$name]}" "$BENCH_TMP/$name.journal" \
        >"$BENCH_TMP/$name.toml"
    launch_cacheguard "$name" "$BENCH_TMP/$name.toml" "${PORT_OF[$name]}" "${ADMIN_PORT_OF[$name]}" \
        "$OUT/$name.log"
done
for name in $INSTANCES; do
    wait_bus "$name" "${ADMIN_OF[$name]}" "$OUT/runs/bus-$name.txt"
done
for method in PUT PATCH DELETE; do
    code=$(curl -s -o /dev/null -w '%{http_code}' -X "$method" "${URL_OF[cg1]}/kv/check")
    [[ $code == 200 ]] || die "$method /kv/check through cg1 answered $code"
done

# --- phases ------------------------------------------------------------------------------

# commandstats FILE: Redis's INFO commandstats, one "command calls" line per command.
commandstats() {
    redis-cli -h 127.0.0.1 -p "$REDIS_PORT" info commandstats |
        sed -n 's/^cmdstat_\([a-z|_]*\):calls=\([0-9]*\),.*/\1 \2/p' | sort >"$1"
}

# command_deltas BEFORE AFTER: "command delta" for every command whose calls changed.
command_deltas() {
    join -a 2 -e 0 -o 0,1.2,2.2 "$1" "$2" | awk '$3 - $2 > 0 { print $1, $3 - $2 }'
}

# sent_commands FILE...: the commands cacheguard sent to Redis, summed over /metrics dumps
# (cacheguard_redis_command_duration_seconds_count, every op), as "op count" lines.
sent_commands() {
    cat "$@" | sed -n 's/^cacheguard_redis_command_duration_seconds_count{op="\([a-z_]*\)"} \([0-9.e+]*\)$/\1 \2/p' |
        awk '{ s[$1] += $2 } END { for (k in s) printf "%s %.0f\n", k, s[k] }' | sort
}

printf 'rep\tphase\tmethod\tconns_per_instance\tinstances\tkeys\twrites\tok\tok_per_s\tp50_ms\tp99_ms\tmax_ms\tstatus_503\tmax_503_ms\terrors\tredis_executed\tredis_sent\tsent_serialize\tcpu_busy_pct\tgap_p50_us\tgap_p99_us\tgaps\tpassed_on\n' >"$OUT/raw.tsv"

# cpu_busy_pct BEFORE AFTER: how busy the machine's CPUs were between two "cpu" lines of
# /proc/stat, in percent (everything but idle and iowait).
cpu_busy_pct() {
    awk -v a="$1" -v b="$2" 'BEGIN {
        n = split(a, x, " "); split(b, y, " ")
        for (i = 2; i <= n; i++) { d = y[i] - x[i]; total += d; if (i == 5 || i == 6) idle += d }
        printf "%.0f", (total > 0) ? 100 * (total - idle) / total : 0
    }'
}

# profile_phase PREFIX: perf of the whole machine (every process, with call graphs) for 3 s from
# 1 s into the phase: PREFIX-perf.data, and PREFIX-perf-comm.txt (self time by process) and
# PREFIX-perf-symbols.txt (by process and symbol).
profile_phase() {
    sleep 1
    perf record -q -a -g -F 499 -o "$1-perf.data" -- sleep 3 2>"$1-perf-record.log" ||
        die "perf record failed; see $1-perf-record.log"
    perf report -i "$1-perf.data" --no-children --sort comm --stdio -g none 2>/dev/null |
        grep -v '^#' | grep -v '^[[:space:]]*$' | head -n 20 >"$1-perf-comm.txt" || true
    perf report -i "$1-perf.data" --no-children --sort comm,dso,sym --stdio -g none 2>/dev/null |
        grep -v '^#' | grep -v '^[[:space:]]*$' | head -n 60 >"$1-perf-symbols.txt" || true
}

# run_phase PHASE REP: one phase (see the header), its figures appended to raw.tsv.
run_phase() {
    local phase=$1 rep=$2 method=PUT conns=1 keys=$KEYS urls=() instances=$INSTANCES name
    case $phase in
    direct) ;;
    plain) method=PATCH instances=cg1 ;;
    uncont) instances=cg1 ;;
    one) conns=$ONE_CONNS keys=1 ;;
    cross) keys=1 ;;
    many) conns=$MANY_CONNS ;;
    manyplain) method=PATCH conns=$MANY_CONNS ;;
    bounded) method=DELETE conns=$BOUNDED_CONNS keys=1 ;;
    esac
    if [[ $phase == direct ]]; then
        urls=(--url "$ORIGIN")
        instances=origin
    else
        for name in $instances; do urls+=(--url "${URL_OF[$name]}"); done
    fi
    local prefix="$OUT/runs/$phase-$rep"
    commandstats "$prefix-commands-before.txt"
    for name in $INSTANCES; do save_metrics "${ADMIN_OF[$name]}" "$prefix-metrics-$name-before.txt"; done
    curl -sf -X POST "$ORIGIN/stats/reset" >/dev/null || die "the origin's /stats/reset failed"
    local cpu_before
    cpu_before=$(head -n1 /proc/stat)
    start_bg "$prefix.json" timeout --signal=TERM $((DURATION_S + 60)) "$LOADGEN_BIN" writes "${urls[@]}" \
        --method "$method" --connections "$conns" --keys "$keys" --key-prefix "$phase$rep-" \
        --warmup-s 0 --duration-s "$DURATION_S"
    local loadgen=$LAST_PID
    if [[ -n ${PROFILE:-} && $rep == 1 && " $PROFILE " == *" $phase "* ]]; then
        profile_phase "$prefix"
    fi
    reap "$loadgen" || die "loadgen failed in $phase rep $rep; see $prefix.json"
    local cpu_busy
    cpu_busy=$(cpu_busy_pct "$cpu_before" "$(head -n1 /proc/stat)")
    curl -sf "$ORIGIN/stats" >"$prefix-origin.json" || die "the origin's /stats failed"
    jq -e '.mode == "writes" and .writes > 0' "$prefix.json" >/dev/null ||
        die "loadgen measured no write in $phase rep $rep; see $prefix.json"
    commandstats "$prefix-commands-after.txt"
    for name in $INSTANCES; do save_metrics "${ADMIN_OF[$name]}" "$prefix-metrics-$name-after.txt"; done
    command_deltas "$prefix-commands-before.txt" "$prefix-commands-after.txt" >"$prefix-commands.txt"
    sent_commands "$prefix"-metrics-*-before.txt >"$prefix-sent-before.txt"
    sent_commands "$prefix"-metrics-*-after.txt >"$prefix-sent-after.txt"
    command_deltas "$prefix-sent-before.txt" "$prefix-sent-after.txt" >"$prefix-sent.txt"
    local executed sent serialize passed
    passed=$(cat "$prefix"-metrics-*-after.txt |
        sed -n 's/^cacheguard_serialized_passed_on_total{[^}]*} \([0-9.e+]*\)$/\1/p' |
        awk '{ s += $1 } END { printf "%.0f", s }')
    passed=$((passed - $(cat "$prefix"-metrics-*-before.txt |
        sed -n 's/^cacheguard_serialized_passed_on_total{[^}]*} \([0-9.e+]*\)$/\1/p' |
        awk '{ s += $1 } END { printf "%.0f", s }')))
    executed=$(awk '$1 != "info" { s += $2 } END { print s + 0 }' "$prefix-commands.txt")
    sent=$(awk '{ s += $2 } END { print s + 0 }' "$prefix-sent.txt")
    serialize=$(awk '$1 == "serialize" { print $2 }' "$prefix-sent.txt")
    local gap
    gap=$(jq -r '.kv_write_gap_us | "\(.p50)\t\(.p99)\t\(.count)"' "$prefix-origin.json")
    jq -r --arg rep "$rep" --arg phase "$phase" --arg inst "$(wc -w <<<"$instances")" \
        --arg ex "$executed" --arg sent "$sent" --arg ser "${serialize:-0}" --arg cpu "$cpu_busy" \
        --arg gap "$gap" --arg passed "$passed" \
        '[$rep, $phase, .method, .connections_per_url, $inst, .keys, .writes, .ok, .ok_per_s,
          .ok_latency_ms.p50, .ok_latency_ms.p99, .latency_ms.max, (.status["503"] // 0),
          (.status_503_latency_ms.max // 0), .errors, $ex, $sent, $ser, $cpu, $gap, $passed]
          | @tsv' "$prefix.json" | sed 's/\\t/\t/g' >>"$OUT/raw.tsv"
    log "$phase rep $rep: $(tail -n1 "$OUT/raw.tsv")"
}

# Warm-up: connections opened, scripts loaded, pools filled.
run_bg "$OUT/runs/warmup.json" timeout --signal=TERM 60 "$LOADGEN_BIN" writes --url "${URL_OF[cg1]}" \
    --url "${URL_OF[cg2]}" --url "${URL_OF[cg3]}" --connections 4 --keys 100 --key-prefix warm- \
    --warmup-s 0 --duration-s 2 || die "warm-up failed; see $OUT/runs/warmup.json"

for ((rep = 1; rep <= REPS; rep++)); do
    # plain and uncont alternate which goes first; the rest in order
    if ((rep % 2)); then order="plain uncont"; else order="uncont plain"; fi
    for phase in direct $order one cross many manyplain bounded; do
        run_phase "$phase" "$rep"
    done
done

end_env

# --- summary -----------------------------------------------------------------------------

# col PHASE REP COLUMN: one cell of raw.tsv.
col() {
    awk -F'\t' -v p="$1" -v r="$2" -v c="$3" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i; next }
        $1 == r && $2 == p { print $k }' "$OUT/raw.tsv"
}

# median PHASE COLUMN: the median over reps.
median() {
    local r
    for ((r = 1; r <= REPS; r++)); do col "$1" "$r" "$2"; done | sort -g |
        awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

verdict() { awk -v v="$1" -v t="$3" -v op="$2" 'BEGIN { ok = (op == ">=") ? v >= t : v <= t; print ok ? "met" : "**missed**" }'; }

{
    echo "# Serialized writes"
    echo
    env_summary
    echo
    echo "## Rep by rep"
    echo
    echo "| rep | origin alone: p50 ms, writes/s | uncont p50 ms | plain p50 ms | overhead ms | one res. writes/s (CPU busy %) | one / origin alone | passed on / one res. write | cross: writes/s, gap p50 / p99 µs | 1000 res. writes/s (CPU %) | 1000 res. plain writes/s (CPU %) | ser./plain | Redis executed / uncont. write | sent / uncont. write | bounded: max ms, 503s |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for ((r = 1; r <= REPS; r++)); do
        u=$(col uncont "$r" p50_ms) p=$(col plain "$r" p50_ms)
        m=$(col many "$r" ok_per_s) mp=$(col manyplain "$r" ok_per_s)
        uo=$(col uncont "$r" ok)
        d=$(col direct "$r" p50_ms) ds=$(col direct "$r" ok_per_s)
        o=$(col one "$r" ok_per_s)
        printf '| %s | %s, %s | %s | %s | %+.3f | %s (%s) | %.2f | %.2f | %s, %s / %s | %s (%s) | %s (%s) | %.2f | %.2f | %.2f | %s, %s |\n' \
            "$r" "$d" "$ds" "$u" "$p" \
            "$(awk -v a="$u" -v b="$p" 'BEGIN { print a - b }')" "$o" \
            "$(col one "$r" cpu_busy_pct)" \
            "$(awk -v a="$o" -v b="$ds" 'BEGIN { print (b > 0) ? a / b : 0 }')" \
            "$(awk -v a="$(col one "$r" passed_on)" -v b="$(col one "$r" ok)" 'BEGIN { print (b > 0) ? a / b : 0 }')" \
            "$(col cross "$r" ok_per_s)" "$(col cross "$r" gap_p50_us)" "$(col cross "$r" gap_p99_us)" \
            "$m" "$(col many "$r" cpu_busy_pct)" "$mp" \
            "$(col manyplain "$r" cpu_busy_pct)" \
            "$(awk -v a="$m" -v b="$mp" 'BEGIN { print (b > 0) ? a / b : 0 }')" \
            "$(awk -v a="$(col uncont "$r" redis_executed)" -v b="$uo" 'BEGIN { print (b > 0) ? a / b : 0 }')" \
            "$(awk -v a="$(col uncont "$r" redis_sent)" -v b="$uo" 'BEGIN { print (b > 0) ? a / b : 0 }')" \
            "$(col bounded "$r" max_ms)" "$(col bounded "$r" status_503)"
    done
    echo
    echo "## Targets (median over reps of each rep's own ratio)"
    echo
    # per_rep EXPR: the median over reps of an awk expression of a and b, set per rep by
    # the two columns "PHASE_A COL_A PHASE_B COL_B".
    per_rep() {
        for ((r = 1; r <= REPS; r++)); do
            awk -v a="$(col "$1" "$r" "$2")" -v b="$(col "$3" "$r" "$4")" "BEGIN { print $5 }"
        done | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
    }
    one_ratio=$(per_rep one ok_per_s direct ok_per_s '(b > 0) ? a / b : 0')
    many_ratio=$(per_rep many ok_per_s manyplain ok_per_s '(b > 0) ? a / b : 0')
    over=$(per_rep uncont p50_ms plain p50_ms 'a - b')
    gap99=$(median cross gap_p99_us)
    per=$(per_rep uncont redis_executed uncont ok '(b > 0) ? a / b : 0')
    worst=$(for ((r = 1; r <= REPS; r++)); do col bounded "$r" max_ms; done | sort -g | tail -n1)
    bound=$((BOUNDED_WAIT_MS + 50 + 5))
    echo "| target | measured | verdict |"
    echo "|---|---|---|"
    echo "| one resource, 3 instances: >= 0.8 x the origin driven one write at a time | $one_ratio ($(median one ok_per_s) against $(median direct ok_per_s) writes/s) | $(verdict "$one_ratio" ">=" 0.8) |"
    echo "| 1000 resources: >= 0.7 x the same writes unserialized | $many_ratio ($(median many ok_per_s) against $(median manyplain ok_per_s) writes/s) | $(verdict "$many_ratio" ">=" 0.7) |"
    echo "| uncontended overhead vs unserialized, p50 <= +0.25 ms | $over | $(verdict "$over" "<=" 0.25) |"
    echo "| handoff between instances (cross: the origin's write gap, p99) <= 1000 µs | $gap99 (p50 $(median cross gap_p50_us)) | $(verdict "$gap99" "<=" 1000) |"
    echo "| also: Redis commands executed per uncontended write <= 3 | $per | $(verdict "$per" "<=" 3) |"
    echo "| also: waits <= wait_timeout + 50 ms (slowest answer <= $bound ms) | $worst | $(verdict "$worst" "<=" "$bound") |"
    echo
    echo "## Redis commands per uncontended write (rep 1)"
    echo
    uo=$(col uncont 1 ok)
    echo "Executed (INFO commandstats delta, the scripts' own commands included; INFO left out), per write:"
    echo
    awk -v n="$uo" '$1 != "info" { printf "- %s: %.2f\n", $1, $2 / n }' "$OUT/runs/uncont-1-commands.txt"
    echo
    echo "Sent by cacheguard (its command counters, by op), per write:"
    echo
    awk -v n="$uo" '{ printf "- %s: %.2f\n", $1, $2 / n }' "$OUT/runs/uncont-1-sent.txt"
    echo
    echo "## Raw"
    echo
    echo '```'
    cat "$OUT/raw.tsv"
    echo '```'
} >"$OUT/summary.md"

show_summary
