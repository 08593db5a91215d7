#!/usr/bin/env bash
# Fleet cost: what a cache hit, a cold miss, a cached entry and a plain forward cost in
# cacheguard next to nginx proxy_cache, nginx proxy_pass and Varnish, in one run on this
# machine, with a verdict for each target (summary.md, "Targets"):
#
#   origin   nginx `return 200` with exactly 1024 bytes of JSON for /items/{id}
#            (bench/origin.conf.tmpl, 2 workers); also the "static nginx" reference target
#   peers    nginx 1.22 proxy_cache (bench/nginx.conf.tmpl, 2 workers) and Varnish 7.1
#            (bench/varnish.vcl.tmpl, malloc storage), in front of that origin
#   cacheguard  release build: cg-l1 = embedded mode (no [redis]), `l1 = "all"`, every
#            measured request an L1 hit; cg-l2 = shared mode with one redis-server started
#            here, `l1 = "off"`, every measured request an L2 hit (one Redis GET)
#
#   a. hit throughput  `wrk -t2 -c64 -d$DURATION --latency` on one warmed 1 KiB key; targets
#            static, nginx, varnish, cg-l1, cg-l2; REPS reps, the targets rotating within each
#            rep. A run whose answers were not all hits (requests reached the origin, or the
#            X-Cache after it is not the hit) is listed as not clean.
#   b. CPU per hit  `loadgen rate` at RATE req/s (open loop) over RATE_CONNECTIONS connections
#            for RATE_DURATION_S, one warmed key, after a RATE_WARMUP_S warm-up run of its own
#            that is not counted. CPU = utime + stime (/proc/PID/stat) of every process of the
#            target (nginx: master and workers; varnishd: manager and cache child; cacheguard:
#            its one process, threads included) read just before and after the measured run,
#            in µs per answered request; for cg-l2 also redis-server's (its /proc/PID/stat) and
#            the sum. Same targets, reps and rotation as a; a run under 98% of RATE, with
#            errors or with answers that were not hits is listed as not clean. The same runs
#            give section g's open-loop reading (context switches, read beside the CPU).
#   c. Redis commands per request  cacheguard shared mode with `l1 = "off"` and with
#            `l1 = "hot"`: REDIS_N GETs of never-seen ids (cold misses), then the same ids again
#            (L2 hits), `loadgen list` over 8 connections. Around each batch: `CONFIG
#            RESETSTAT`, a MONITOR capture, the batch, `INFO commandstats`, and cacheguard's
#            /metrics before and after; then an idle window of the same length, measured the
#            same way and subtracted (cacheguard's own background commands: PING, INFO, the
#            event bus's reads). Reported per request: the commands cacheguard sent (MONITOR, without the
#            calls made inside Lua scripts), the commandstats calls (which count those inner
#            calls too) with a per-command breakdown, and cacheguard's own
#            cacheguard_request_redis_commands_total / cacheguard_requests_total. Then, without
#            MONITOR (whose own output costs Redis CPU), REDIS_N more never-seen ids and the
#            same again: redis-server's CPU (INFO cpu used_cpu_sys + used_cpu_user) per cold
#            miss and per L2 hit, net of an idle window as long.
#   d. memory per cached entry  one fresh instance per target, filled with MEM_KEYS distinct
#            1 KiB keys (wrk + bench/distinct.lua): cacheguard embedded with `l1_max_bytes =
#            MEM_L1_MAX_BYTES`, nginx proxy_cache with a keys_zone and max_size for MEM_KEYS
#            keys, Varnish with malloc storage for them. Memory = (Pss summed over the target's
#            processes, /proc/PID/smaps_rollup, after the fill) − (the same before it), divided
#            by the entries stored (cacheguard_l1_entries; the files in nginx's cache dir;
#            varnishstat MAIN.n_object), in KiB and as a multiple of body + origin response
#            head; nginx also: disk bytes (du -sb) per entry. One rep.
#   e. stampede  bench/stampede.sh as a sub-step: CONCURRENCIES=STAMPEDE_C TARGETS="direct nginx2
#            varnish2 cg2" (two instances of each; cg2 = two cacheguard sharing one Redis;
#            direct = the origin itself, no proxy, the floor of this machine),
#            origin delay STAMPEDE_DELAY_MS, REPS reps; its raw.tsv gives the origin requests
#            and the waiters' p99 per run. Target: cacheguard's p99 over direct's (the floor).
#   f. plain forward  a POST of a 1 KiB JSON body to /items/1 (bench/post_body.lua; `loadgen
#            rate --post-bytes 1024`, the same body) through cg-fwd = cacheguard embedded mode
#            with a write route for POST /items/{id} (no invalidate, no stock gate, no
#            serialize: the body read whole, then forwarded) and through nginx-fwd = nginx
#            proxy_pass (bench/forward.conf.tmpl: no cache, keep-alive upstream, 2 workers,
#            the body read whole too), both to the origin above (`return 200` answers a POST as
#            it answers a GET). As a (`wrk -t2 -c64`) and as b (CPU µs per request at RATE
#            req/s open loop, context switches beside), REPS reps rotating; a run in which fewer
#            requests reached the origin than were answered is listed as not clean.
#   g. context switches per request  voluntary_ctxt_switches + nonvoluntary_ctxt_switches
#            summed over /proc/PID/task/*/status of every process of the target, read before
#            and after a run, divided by the answers; redis-server's apart for cg-l2. Two
#            readings: (1) at RATE req/s open loop, taken in b's and f's own runs (no runs of
#            its own: columns of cpu.tsv and forward-cpu.tsv, there whenever b or f runs);
#            (2) closed loop, `wrk -t1 -c16 -d$DURATION` (the POST body for the forward
#            targets) on static, nginx, cg-l1, cg-l2, nginx-fwd and cg-fwd, REPS reps rotating,
#            CPU µs per request beside (ctxsw.tsv). A process that sleeps in epoll between
#            requests arriving 1/RATE apart wakes about once per request whatever it does, so
#            the open-loop reading has a floor near 1 per request for one that idles between
#            them; in the closed loop requests are always queued and a wake-up serves several.
#   h. allocations per hit  COUNTED_BIN (bench/tools `cacheguard-counted`: cacheguard run as
#            `cacheguard --config FILE`, with a counting global allocator that writes
#            "<allocations> <bytes>", cumulative for the whole process, to the file named by
#            ALLOC_REPORT every 200 ms) as alloc-l1 (embedded, `l1 = "all"`) and alloc-l2
#            (shared, `l1 = "off"`), warmed; per rep: a warm-up run (as b's), 0.5 s, a reading,
#            ALLOC_N requests of the warmed key (`loadgen rate` at RATE req/s over
#            RATE_CONNECTIONS connections), 0.5 s, a reading, an idle window as long as that, a
#            reading. (Allocations, bytes) per request = (batch − idle) / answered (the
#            RATE_CONNECTIONS new connections of each run included). Built (`cargo build --release --bin
#            cacheguard-counted` in bench/tools) when bench/tools/Cargo.toml declares it, from this
#            checkout's sources, whatever CACHEGUARD_BIN is; when it is not there (or does not
#            build) the section is skipped and the summary says so.
#   i. 1M-key working set  cacheguard embedded (`l1 = "all"`, `l1_max_bytes = I_L1_MAX_BYTES`)
#            and nginx proxy_cache (keys_zone and max_size for I_KEYS keys, as in d), both up
#            at once, each filled with ids 1 .. I_KEYS (`loadgen list` over 64 connections:
#            every id once, every answer awaited; d's wrk fill stops with ids in flight, so the
#            ids it stored are not an exact range), then `wrk -t2 -c64 -d$DURATION -s
#            bench/random_keys.lua` (GET /items/<id at random in 1 .. I_KEYS>, the request built
#            in request(), the same id sequence for both), REPS reps rotating. Hit share =
#            1 − (requests that reached the origin during the run, its stub_status) / wrk's
#            requests; a run is clean only when it is 1. Target: cacheguard's req/s ≥ 1.9×
#            nginx's. TTL 3600s for both, and nginx's inactive=60m (it drops an entry not read
#            for that long), so no entry leaves either during the section.
#
# usage: CACHEGUARD_BIN=path bash bench/fleet_cost.sh
# env:   SECTIONS="a b c d e f g h i" (leave sections out to skip them) REPS=3
#        DURATION=10s (a, f, g and i: wrk -d)
#        RATE=5000 RATE_CONNECTIONS=16 RATE_DURATION_S=10 RATE_WARMUP_S=1 (b, f, h)
#        REDIS_N=1000 (c, requests per batch)
#        MEM_KEYS=1000000 MEM_MAX_DURATION=600s (d, wrk -d: the bound of one fill)
#        MEM_L1_MAX_BYTES=8589934592 (d, cacheguard's l1_max_bytes)
#        MEM_KEYS_ZONE=<32m per 125,000 keys> MEM_NGINX_MAX_SIZE=<8 KiB per key, at least 1g>
#        MEM_VARNISH_MALLOC=<4 KiB per key, at least 1g> (d, the peers' room for MEM_KEYS keys)
#        STAMPEDE_C=1000 STAMPEDE_DELAY_MS=200 (e)
#        ALLOC_N=20000 COUNTED_BIN=<TOOLS_TARGET>/release/cacheguard-counted (h)
#        I_KEYS=1000000 I_FILL_MAX_S=900 (i: the bound of one fill) I_L1_MAX_BYTES=MEM_L1_MAX_BYTES
#        I_KEYS_ZONE, I_NGINX_MAX_SIZE (i: as MEM_KEYS_ZONE and MEM_NGINX_MAX_SIZE, for I_KEYS)
#        BASE_PORT=32080 (uses BASE_PORT+1 .. +30) STAMPEDE_BASE_PORT=BASE_PORT+50 (e: +1 .. +12)
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        BASE_BIN=path (a, b, f and g: also measure this cacheguard build, targets base-l1,
#        base-l2 and base-fwd, e.g. a build from before a change; its rows are in the section
#        tables, not the summary's)
#        KEEP_TMP=1 (keep the scratch dir with the rendered nginx/varnish/redis dirs)
#
# Writes bench/results/fleet-cost-<UTC timestamp>/: throughput.tsv (a), cpu.tsv (b),
# redis.tsv and redis-batches.tsv (c), memory.tsv (d), stampede.tsv (e, from the sub-step's
# raw.tsv), forward-throughput.tsv and forward-cpu.tsv (f), ctxsw.tsv (g), alloc.tsv (h),
# working-set.tsv and working-set-fill.tsv (i), the raw wrk / loadgen / MONITOR / INFO /
# /metrics outputs under a/ .. i/, the sub-step's whole results dir under e/stampede/, configs,
# logs, env.txt and summary.md, and prints the markdown summary on stdout. Every process it starts is stopped on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults SECTIONS="a b c d e f g h i" REPS=3 DURATION=10s RATE=5000 RATE_CONNECTIONS=16 \
    RATE_DURATION_S=10 RATE_WARMUP_S=1 REDIS_N=1000 MEM_KEYS=1000000 MEM_MAX_DURATION=600s \
    MEM_L1_MAX_BYTES=8589934592 STAMPEDE_C=1000 STAMPEDE_DELAY_MS=200 BASE_PORT=32080 \
    ALLOC_N=20000 I_KEYS=1000000 I_FILL_MAX_S=900
bench_defaults I_L1_MAX_BYTES="$MEM_L1_MAX_BYTES"
require_positive REPS RATE RATE_CONNECTIONS RATE_DURATION_S RATE_WARMUP_S REDIS_N MEM_KEYS \
    MEM_L1_MAX_BYTES STAMPEDE_C STAMPEDE_DELAY_MS BASE_PORT ALLOC_N I_KEYS I_FILL_MAX_S I_L1_MAX_BYTES
check_list SECTIONS section a b c d e f g h i
# room in the peers for MEM_KEYS keys: nginx keeps ~8,000 keys per MB of keys_zone (here half
# that, rounded up to 32m steps) and a 1 KiB entry takes one 4 KiB block in its cache dir (its
# max_size: twice that), and Varnish gets 4 KiB per key of malloc storage
bench_defaults MEM_KEYS_ZONE=$((32 * ((MEM_KEYS + 124999) / 125000)))m \
    MEM_NGINX_MAX_SIZE=$(((MEM_KEYS * 8 + 1048575) / 1048576))g \
    MEM_VARNISH_MALLOC=$(((MEM_KEYS * 4 + 1048575) / 1048576))g \
    I_KEYS_ZONE=$((32 * ((I_KEYS + 124999) / 125000)))m \
    I_NGINX_MAX_SIZE=$(((I_KEYS * 8 + 1048575) / 1048576))g \
    STAMPEDE_BASE_PORT=$((BASE_PORT + 50))
BODY_BYTES=1024
KEY=/items/1
LIST_CONNECTIONS=8
SETTLE_S=0.5
RATE_DRAIN_S=5
MAIN_TARGETS="static nginx varnish cg-l1 cg-l2"
TARGETS=$MAIN_TARGETS
FWD_TARGETS="nginx-fwd cg-fwd"
G_TARGETS="static nginx cg-l1 cg-l2 nginx-fwd cg-fwd"
# BASE_BIN: another cacheguard build, measured beside the rest in sections a, b, f and g.
BASE_BIN=${BASE_BIN:-}
if [[ -n $BASE_BIN ]]; then
    TARGETS+=" base-l1 base-l2"
    FWD_TARGETS+=" base-fwd"
    G_TARGETS+=" base-l1 base-l2 base-fwd"
fi
L1_MODES="off hot"
ALLOC_TARGETS="alloc-l1 alloc-l2"
I_TARGETS="i-nginx i-cg"
FILL_CONNECTIONS=64
# the write route of the forward targets (section f): no invalidate, no stock gate, no serialize
FWD_ROUTE=$'[[routes]]\nname = "item-post"\nmatch = "/items/{id}"\nmethods = ["POST"]'

bench_ports ORIGIN_PORT NGINX_PORT VARNISH_PORT REDIS_PORT CGL1_PORT CGL1_ADMIN CGL2_PORT CGL2_ADMIN \
    CGC_PORT CGC_ADMIN MEM_NGINX_PORT MEM_VARNISH_PORT MEM_CG_PORT MEM_CG_ADMIN \
    BASEL1_PORT BASEL1_ADMIN BASEL2_PORT BASEL2_ADMIN NGINXFWD_PORT CGFWD_PORT CGFWD_ADMIN \
    BASEFWD_PORT BASEFWD_ADMIN ALLOCL1_PORT ALLOCL1_ADMIN ALLOCL2_PORT ALLOCL2_ADMIN I_NGINX_PORT \
    I_CG_PORT I_CG_ADMIN

# has SECTION: true when SECTION is in SECTIONS.
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
# has_any SECTION...: true when one of them is in SECTIONS.
has_any() {
    local sec
    for sec in "$@"; do has "$sec" && return 0; done
    return 1
}

bench_init

# --- preflight -------------------------------------------------------------------------

ensure_apt_tools nginx:nginx varnishd:varnish redis-server:redis-server redis-cli:redis-tools \
    wrk:wrk curl:curl jq:jq
require_tools cargo awk sort pgrep timeout find du getconf
require_free_ports "${BENCH_PORTS[@]}"
raise_fd_limit

build_cacheguard

build_bench_tools

bench_results fleet-cost- a b c d e f g h i
COUNTED_BIN=${COUNTED_BIN:-$TOOLS_TARGET/release/cacheguard-counted}

TCK=$(getconf CLK_TCK)
PROBLEMS=() # runs that were not clean, for the summary

write_env nginx varnishd redis wrk <<EOF
sections: $SECTIONS
reps: $REPS
throughput: wrk -t2 -c64 -d$DURATION --latency, one warmed 1 KiB key
cpu_load: $RATE req/s open loop over $RATE_CONNECTIONS connections, ${RATE_DURATION_S}s after a ${RATE_WARMUP_S}s warm-up run
redis_batch: $REDIS_N requests, $LIST_CONNECTIONS connections
memory: $MEM_KEYS keys; cacheguard l1_max_bytes $MEM_L1_MAX_BYTES; nginx keys_zone $MEM_KEYS_ZONE, max_size $MEM_NGINX_MAX_SIZE; varnish malloc $MEM_VARNISH_MALLOC
stampede: C=$STAMPEDE_C, origin delay ${STAMPEDE_DELAY_MS} ms, bench/stampede.sh BASE_PORT=$STAMPEDE_BASE_PORT
forward: POST of a ${BODY_BYTES}-byte JSON body; wrk -t2 -c64 -d$DURATION -s bench/post_body.lua; loadgen rate --post-bytes $BODY_BYTES at $RATE req/s
ctx_closed_loop: wrk -t1 -c16 -d$DURATION
alloc: $ALLOC_N requests per batch at $RATE req/s; $COUNTED_BIN
working_set: $I_KEYS keys; cacheguard l1_max_bytes $I_L1_MAX_BYTES; nginx keys_zone $I_KEYS_ZONE, max_size $I_NGINX_MAX_SIZE; wrk -t2 -c64 -d$DURATION -s bench/random_keys.lua
EOF

# --- the origin (static nginx) ------------------------------------------------------------

BODY=$(static_body "$BODY_BYTES")
if has_any a b c d f g h i; then
    start_nginx origin bench/origin.conf.tmpl WORKERS=2 PORT="$ORIGIN_PORT" STATIC_BODY="$BODY"
    PID_OF[static]=$LAST_PID
    wait_http "http://127.0.0.1:$ORIGIN_PORT$KEY" "$LAST_PID" "origin nginx"
    cp "$BENCH_TMP/nginx-origin/nginx.conf" "$OUT/nginx-origin.conf"
    check_origin_body "http://127.0.0.1:$ORIGIN_PORT$KEY" "$BODY_BYTES"
    # what a cache stores at least per entry: the body and the origin's response head
    HEAD_BYTES=$(curl -s -o /dev/null -w '%{size_header}' "http://127.0.0.1:$ORIGIN_PORT$KEY")
    ENTRY_BYTES=$((BODY_BYTES + HEAD_BYTES))
fi

# start_cg NAME PORT ADMIN_PORT embedded|shared SECTION.KEY=VALUE...: one cacheguard instance
# (cg_config: upstream max_concurrency 256 and ttl 600s unless given, the settings given;
# shared: the redis-server started here, a journal of its own; CG_APPEND, when set: lines
# appended to the config, e.g. a second route) with its config, log and /metrics in OUT.
start_cg() {
    local name=$1 port=$2 admin=$3 mode=$4 shared=() d
    shift 4
    for d in upstream.max_concurrency=256 cache.ttl=600s; do
        [[ " $* " == *" ${d%%=*}="* ]] || set -- "$d" "$@"
    done
    [[ $mode == embedded ]] ||
        shared=(redis.url="redis://127.0.0.1:$REDIS_PORT" journal.path="$BENCH_TMP/journal-$name")
    {
        cg_config "$port" "$admin" "$ORIGIN_PORT" "${shared[@]}" "$@"
        [[ -z ${CG_APPEND:-} ]] || printf '\n%s\n' "$CG_APPEND"
    } >"$OUT/$name.toml"
    launch_cacheguard "$name" "$OUT/$name.toml" "$port" "$admin" "$OUT/$name.log"
}

REDIS_CLI=(redis-cli -h 127.0.0.1 -p "$REDIS_PORT")
if has_any a b c g h; then
    start_redis fleet "$REDIS_PORT"
    PID_OF[redis]=$LAST_PID
fi

# --- a, b, f and g: one warmed key (a POST, for the forward targets) through every target ------

declare -A URL=(
    [static]="http://127.0.0.1:$ORIGIN_PORT$KEY"
    [nginx]="http://127.0.0.1:$NGINX_PORT$KEY"
    [varnish]="http://127.0.0.1:$VARNISH_PORT$KEY"
    [cg-l1]="http://127.0.0.1:$CGL1_PORT$KEY"
    [cg-l2]="http://127.0.0.1:$CGL2_PORT$KEY"
    [base-l1]="http://127.0.0.1:$BASEL1_PORT$KEY"
    [base-l2]="http://127.0.0.1:$BASEL2_PORT$KEY"
    [nginx-fwd]="http://127.0.0.1:$NGINXFWD_PORT$KEY"
    [cg-fwd]="http://127.0.0.1:$CGFWD_PORT$KEY"
    [base-fwd]="http://127.0.0.1:$BASEFWD_PORT$KEY"
    [alloc-l1]="http://127.0.0.1:$ALLOCL1_PORT$KEY"
    [alloc-l2]="http://127.0.0.1:$ALLOCL2_PORT$KEY"
    [i-nginx]="http://127.0.0.1:$I_NGINX_PORT$KEY"
    [i-cg]="http://127.0.0.1:$I_CG_PORT$KEY"
)
# the X-Cache of a hit ("" for a target that answers every request itself or forwards it)
declare -A HIT=([static]="" [nginx]=HIT [varnish]=HIT [cg-l1]=HIT-L1 [cg-l2]=HIT-L2 [base-l1]=HIT-L1
    [base-l2]=HIT-L2 [nginx-fwd]="" [cg-fwd]="" [base-fwd]="" [alloc-l1]=HIT-L1 [alloc-l2]=HIT-L2
    [i-nginx]=HIT [i-cg]=HIT-L1)
# the forward targets: every request a POST of the 1 KiB body
declare -A POST_OF=([nginx-fwd]=1 [cg-fwd]=1 [base-fwd]=1)
# wrk's script and its arguments per target, when not a GET of URL
declare -A WRK_SCRIPT_OF=([nginx-fwd]=bench/post_body.lua [cg-fwd]=bench/post_body.lua
    [base-fwd]=bench/post_body.lua [i-nginx]=bench/random_keys.lua [i-cg]=bench/random_keys.lua)
declare -A WRK_ARGS_OF=([i-nginx]=$I_KEYS [i-cg]=$I_KEYS)
# per kind of run: its TSV file (and its raw outputs go to OUT/<kind up to the first ->/)
declare -A TSV_OF=([a]=throughput.tsv [b]=cpu.tsv [f-wrk]=forward-throughput.tsv [f-rate]=forward-cpu.tsv
    [g]=ctxsw.tsv [i]=working-set.tsv)
POST_BODY=$(awk -v n="$BODY_BYTES" 'BEGIN { h = "{\"payload\":\""; printf "%s", h; for (i = 0; i < n - 14; i++) printf "x"; printf "\"}" }')

# per_req DELTA N [FACTOR]: DELTA × FACTOR (default 1) / N, 3 decimals.
per_req() { awk -v d="$1" -v n="$2" -v f="${3:-1}" 'BEGIN { printf "%.3f", (n > 0) ? d * f / n : 0 }'; }

# take_readings before|after TARGET: the readings around a run: CPU ticks and context switches
# of TARGET's processes (R_PIDS, listed by `before`) and, for an L2 target, of redis-server.
# `after` sets R_CPU, R_CTX, R_RCPU and R_RCTX to the changes since the last `before`.
take_readings() {
    local when=$1 t=$2 c x rc=0 rx=0
    if [[ $when == before ]]; then mapfile -t R_PIDS < <(proc_tree "${PID_OF[$t]}"); fi
    c=$(cpu_ticks "${R_PIDS[@]}")
    x=$(ctx_switches "${R_PIDS[@]}")
    if [[ $t == *-l2 ]]; then
        rc=$(cpu_ticks "${PID_OF[redis]}")
        rx=$(ctx_switches "${PID_OF[redis]}")
    fi
    if [[ $when == before ]]; then
        R0=("$c" "$x" "$rc" "$rx")
    else
        R_CPU=$((c - R0[0])) R_CTX=$((x - R0[1])) R_RCPU=$((rc - R0[2])) R_RCTX=$((rx - R0[3]))
    fi
}

# readings_cells N TARGET: "cpu_us ctxsw redis_us redis_ctxsw" per request of the last readings
# (the redis-server ones "-" unless TARGET is an L2 target).
readings_cells() {
    local n=$1 t=$2
    printf '%s\t%s\t' "$(per_req "$R_CPU" "$n" "$((1000000 / TCK))")" "$(per_req "$R_CTX" "$n")"
    if [[ $t == *-l2 ]]; then
        printf '%s\t%s' "$(per_req "$R_RCPU" "$n" "$((1000000 / TCK))")" "$(per_req "$R_RCTX" "$n")"
    else
        printf -- '-\t-'
    fi
}

# run_throughput KIND TARGET REP: one wrk run into TSV_OF[KIND]: KIND a (section a: `wrk -t2
# -c64` on URL), f-wrk (section f: the same with the POST body), g (section g: `wrk -t1 -c16`)
# or i (section i: random keys); CPU and context switches of the target read around it. A hit
# target's run is not clean when a request reached the origin or X-Cache after it is not the
# hit; a forward target's when fewer requests reached the origin than were answered.
run_throughput() {
    local kind=$1 t=$2 rep=$3 dir=${1%%-*} before after origin=- xc=- parsed problems=() load=(-t2 -c64)
    local rps p50 p99 max reqs errs non2xx file script=()
    file="$OUT/$dir/wrk-$t-rep$rep.txt"
    [[ $kind != g ]] || load=(-t1 -c16)
    [[ -z ${WRK_SCRIPT_OF[$t]:-} ]] || script=(-s "${WRK_SCRIPT_OF[$t]}")
    before=$(stub_requests "$ORIGIN_PORT")
    log "$kind. rep $rep/$REPS: $t: wrk ${load[*]} -d$DURATION --latency ${script[*]} ${URL[$t]} ${WRK_ARGS_OF[$t]:+-- ${WRK_ARGS_OF[$t]}}"
    take_readings before "$t"
    # shellcheck disable=SC2086 # WRK_ARGS_OF: words on purpose
    wrk_once "$file" "$t" "${load[@]}" -d"$DURATION" --timeout 10s --latency "${script[@]}" "${URL[$t]}" \
        ${WRK_ARGS_OF[$t]:+-- ${WRK_ARGS_OF[$t]}}
    take_readings after "$t"
    after=$(stub_requests "$ORIGIN_PORT")
    parsed=$(wrk_parse "$file") || die "cannot parse wrk output $file"
    read -r rps p50 p99 max reqs errs non2xx <<<"$parsed"
    ((errs == 0 && non2xx == 0)) || problems+=("$errs socket errors, $non2xx non-2xx")
    # the stub_status read after the run counts itself
    [[ $t == static ]] || origin=$((after - before - 1))
    if [[ -n ${HIT[$t]} ]]; then
        xc=$(x_cache "${URL[$t]}")
        ((origin == 0)) || problems+=("$origin requests reached the origin: not every answer was a hit")
        [[ $xc == "${HIT[$t]}" ]] || problems+=("X-Cache after the run was '$xc', not ${HIT[$t]}")
    elif [[ -n ${POST_OF[$t]:-} ]] && ((origin < reqs)); then
        problems+=("$origin requests reached the origin for $reqs answers: not every answer was forwarded")
    fi
    note_problems PROBLEMS "$kind. $t rep $rep" " (see $file)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "$rps" "$p50" "$p99" "$max" \
        "$reqs" "$errs" "$non2xx" "$origin" "$xc" "$(readings_cells "$reqs" "$t")" >>"$OUT/${TSV_OF[$kind]}"
    printf '  %-9s %12s req/s  p50 %7.3f ms  p99 %7.3f ms  %s ctx switches/req\n' "$t" "$rps" "$p50" "$p99" \
        "$(per_req "$R_CTX" "$reqs")" >&2
}
THROUGHPUT_HEAD=$'target\trep\trps\tp50_ms\tp99_ms\tmax_ms\trequests\tsocket_errors\tnon2xx\torigin_requests\tx_cache_after\tcpu_us_per_req\tctxsw_per_req\tredis_us_per_req\tredis_ctxsw_per_req'

RATE_BOUND_S=$((RATE_WARMUP_S + RATE_DURATION_S + RATE_DRAIN_S + 30))
# rate_args SECONDS TARGET: the `loadgen rate` arguments of a section-b run of SECONDS (a POST
# of the body for a forward TARGET).
rate_args() {
    echo --rate "$RATE" --connections "$RATE_CONNECTIONS" --duration-s "$1" --drain-s "$RATE_DRAIN_S" \
        --timeout-s 10 --threads 1 ${POST_OF[$2]:+--post-bytes "$BODY_BYTES"}
}

# run_cpu KIND TARGET REP: one section-b (KIND b) or section-f (KIND f-rate) run: a warm-up
# run, then the measured one with the CPU and context switches of the target's processes, and
# of redis-server, read around it; into TSV_OF[KIND].
run_cpu() {
    local kind=$1 t=$2 rep=$3 dir=${1%%-*} json ok achieved us redis_us=- problems
    json="$OUT/$dir/loadgen-$t-rep$rep.json"
    log "$kind. rep $rep/$REPS: $t: loadgen rate $(rate_args "$RATE_DURATION_S" "$t") --url ${URL[$t]}"
    # shellcheck disable=SC2046 # rate_args: words on purpose
    loadgen_rate "$OUT/$dir/warmup-$t-rep$rep.json" "$t (warm-up)" "$RATE_BOUND_S" --url "${URL[$t]}" \
        $(rate_args "$RATE_WARMUP_S" "$t")
    take_readings before "$t"
    # shellcheck disable=SC2046
    loadgen_rate "$json" "$t" "$RATE_BOUND_S" --url "${URL[$t]}" $(rate_args "$RATE_DURATION_S" "$t")
    take_readings after "$t"
    read -r ok achieved < <(jq -r '[.ok, .achieved_rate_rps] | @tsv' "$json")
    ((ok > 0)) || die "$kind. $t: no request answered; see $json"
    us=$(per_req "$R_CPU" "$ok" "$((1000000 / TCK))")
    [[ $t != *-l2 ]] || redis_us=$(per_req "$R_RCPU" "$ok" "$((1000000 / TCK))")
    mapfile -t problems < <(rate_problems "$json" "$RATE" "${HIT[$t]}")
    note_problems PROBLEMS "$kind. $t rep $rep" " (see $json)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "${#R_PIDS[@]}" "$ok" "$achieved" "$us" "$redis_us" \
        "$(awk -v a="$us" -v b="$redis_us" 'BEGIN { printf "%.3f", a + b }')" "$(per_req "$R_CTX" "$ok")" \
        "$([[ $t == *-l2 ]] && per_req "$R_RCTX" "$ok" || printf -- -)" >>"$OUT/${TSV_OF[$kind]}"
    printf '  %-9s %9s req/s  %8s µs/req  %s ctx switches/req  (redis-server %s µs/req; %s processes)\n' "$t" \
        "$achieved" "$us" "$(per_req "$R_CTX" "$ok")" "$redis_us" "${#R_PIDS[@]}" >&2
}
CPU_HEAD=$'target\trep\tprocesses\tanswered\tachieved_rps\tcpu_us_per_req\tredis_us_per_req\ttotal_us_per_req\tctxsw_per_req\tredis_ctxsw_per_req'

# check_post NAME URL HEADERS: save the headers of one POST of the body to URL to HEADERS, and
# die unless it answers 200 with a body of BODY_BYTES bytes.
check_post() {
    local got
    got=$(curl -s -o /dev/null -D "$3" -w '%{http_code} %{size_download}' -H 'Content-Type: application/json' \
        --data-binary "$POST_BODY" "$2")
    [[ $got == "200 $BODY_BYTES" ]] || die "$1 answered a POST with '$got' (status, body bytes), expected 200 $BODY_BYTES"
}

# start_forward_cg NAME PORT ADMIN_PORT: a forward target: cacheguard embedded, with the POST
# write route.
start_forward_cg() { CG_APPEND=$FWD_ROUTE start_cg "$1" "$2" "$3" embedded cache.l1=all; }

LIVE=() # the instances of this block, stopped at its end
if has_any a b f g; then
    if has_any a b g; then
        start_nginx_cache nginx "$NGINX_PORT" "nginx proxy_cache" "$OUT/nginx-proxy.conf" WORKERS=2 TTL=600s
        start_cg cg-l1 "$CGL1_PORT" "$CGL1_ADMIN" embedded cache.l1=all
        start_cg cg-l2 "$CGL2_PORT" "$CGL2_ADMIN" shared cache.l1=off
        LIVE+=(nginx cg-l1 cg-l2)
        if has_any a b; then
            start_varnish_cache varnish "$VARNISH_PORT" varnishd "$OUT/varnish.vcl" TTL=600s GRACE=10s
            LIVE+=(varnish)
        fi
        if [[ -n $BASE_BIN ]]; then
            CG_BIN=$BASE_BIN start_cg base-l1 "$BASEL1_PORT" "$BASEL1_ADMIN" embedded cache.l1=all
            CG_BIN=$BASE_BIN start_cg base-l2 "$BASEL2_PORT" "$BASEL2_ADMIN" shared cache.l1=off
            LIVE+=(base-l1 base-l2)
        fi
    fi
    if has_any f g; then
        start_nginx forward bench/forward.conf.tmpl WORKERS=2 PORT="$NGINXFWD_PORT" ORIGIN_PORT="$ORIGIN_PORT"
        PID_OF[nginx-fwd]=$LAST_PID
        wait_http "http://127.0.0.1:$NGINXFWD_PORT/nginx-ready" "$LAST_PID" "nginx proxy_pass"
        cp "$BENCH_TMP/nginx-forward/nginx.conf" "$OUT/nginx-forward.conf"
        start_forward_cg cg-fwd "$CGFWD_PORT" "$CGFWD_ADMIN"
        LIVE+=(nginx-fwd cg-fwd)
        if [[ -n $BASE_BIN ]]; then
            CG_BIN=$BASE_BIN start_forward_cg base-fwd "$BASEFWD_PORT" "$BASEFWD_ADMIN"
            LIVE+=(base-fwd)
        fi
    fi
    log "warming $KEY"
    for t in static "${LIVE[@]}"; do
        if [[ -n ${POST_OF[$t]:-} ]]; then
            check_post "$t" "${URL[$t]}" "$OUT/headers-$t.txt"
            continue
        fi
        [[ -z ${HIT[$t]} ]] || warm "${URL[$t]}" "${HIT[$t]}"
        check_answer "$t" "${URL[$t]}" "$OUT/headers-$t.txt" "$BODY_BYTES"
    done

    if has a; then
        echo "$THROUGHPUT_HEAD" >"$OUT/throughput.tsv"
        each_rep "$TARGETS" run_throughput a
    fi
    if has b; then
        echo "$CPU_HEAD" >"$OUT/cpu.tsv"
        each_rep "$TARGETS" run_cpu b
    fi
    if has f; then
        echo "$THROUGHPUT_HEAD" >"$OUT/forward-throughput.tsv"
        each_rep "$FWD_TARGETS" run_throughput f-wrk
        echo "$CPU_HEAD" >"$OUT/forward-cpu.tsv"
        each_rep "$FWD_TARGETS" run_cpu f-rate
    fi
    if has g; then
        echo "$THROUGHPUT_HEAD" >"$OUT/ctxsw.tsv"
        each_rep "$G_TARGETS" run_throughput g
    fi
    for t in "${LIVE[@]}"; do
        [[ -z ${ADMIN_OF[$t]:-} ]] || save_metrics "${ADMIN_OF[$t]}" "$OUT/metrics-$t-end.txt"
    done
    for t in "${LIVE[@]}"; do stop_pid "${PID_OF[$t]}"; done
fi

# --- h. allocations per hit (a counting build) ------------------------------------------------

H_SKIPPED="" # why section h did not run, for the summary

# alloc_read TARGET: "<allocations> <bytes>" of TARGET's allocation report (dies when it is not
# two numbers).
alloc_read() {
    local a b
    read -r a b <"$BENCH_TMP/alloc-$1.txt" || die "h. cannot read $BENCH_TMP/alloc-$1.txt"
    [[ $a =~ ^[0-9]+$ && $b =~ ^[0-9]+$ ]] || die "h. $1: allocation report is '$a $b', not two numbers"
    echo "$a $b"
}

ALLOC_BATCH_S=$(awk -v n="$ALLOC_N" -v r="$RATE" 'BEGIN { printf "%.3f", n / r }')
ALLOC_BOUND_S=$(awk -v s="$ALLOC_BATCH_S" -v d="$RATE_DRAIN_S" 'BEGIN { printf "%d", s + d + 30 }')
# run_alloc TARGET REP: one section-h batch and its idle window, into alloc.tsv.
run_alloc() {
    local t=$1 rep=$2 json="$OUT/h/loadgen-$1-rep$2.json" a0 b0 a1 b1 a2 b2 t0 w ok problems
    log "h. rep $rep/$REPS: $t: loadgen rate $(rate_args "$ALLOC_BATCH_S" "$t") --url ${URL[$t]}, then an idle window"
    # shellcheck disable=SC2046 # rate_args: words on purpose
    loadgen_rate "$OUT/h/warmup-$t-rep$rep.json" "$t (warm-up)" "$RATE_BOUND_S" --url "${URL[$t]}" \
        $(rate_args "$RATE_WARMUP_S" "$t")
    sleep "$SETTLE_S"
    read -r a0 b0 < <(alloc_read "$t")
    t0=$EPOCHREALTIME
    # shellcheck disable=SC2046
    loadgen_rate "$json" "$t" "$ALLOC_BOUND_S" --url "${URL[$t]}" $(rate_args "$ALLOC_BATCH_S" "$t")
    sleep "$SETTLE_S"
    read -r a1 b1 < <(alloc_read "$t")
    w=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    sleep "$w"
    read -r a2 b2 < <(alloc_read "$t")
    ok=$(jq '.ok' "$json")
    ((ok > 0)) || die "h. $t: no request answered; see $json"
    mapfile -t problems < <(rate_problems "$json" "$RATE" "${HIT[$t]}")
    note_problems PROBLEMS "h. $t rep $rep" " (see $json)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$rep" "$ok" "$w" $((a1 - a0)) $((b1 - b0)) \
        $((a2 - a1)) $((b2 - b1)) "$(per_req $(((a1 - a0) - (a2 - a1))) "$ok")" \
        "$(per_req $(((b1 - b0) - (b2 - b1))) "$ok")" >>"$OUT/alloc.tsv"
    printf '  %-9s %s allocations, %s bytes per request (net of idle)\n' "$t" \
        "$(per_req $(((a1 - a0) - (a2 - a1))) "$ok")" "$(per_req $(((b1 - b0) - (b2 - b1))) "$ok")" >&2
}

if has h; then
    # bench/tools may build it only when asked (its own --bin): build it when it declares it
    if [[ $COUNTED_BIN == "$TOOLS_TARGET/release/cacheguard-counted" ]] &&
        grep -q '^name = "cacheguard-counted"' bench/tools/Cargo.toml; then
        log "h. cargo build --release --manifest-path bench/tools/Cargo.toml --bin cacheguard-counted"
        CARGO_TARGET_DIR=$TOOLS_TARGET cargo build --release --manifest-path bench/tools/Cargo.toml \
            --bin cacheguard-counted >&2 || H_SKIPPED="building \`cacheguard-counted\` failed (see the log)"
    fi
    if [[ -n $H_SKIPPED ]]; then
        log "h. skipped: $H_SKIPPED"
    elif [[ ! -x $COUNTED_BIN ]]; then
        H_SKIPPED="no counting build at \`${COUNTED_BIN#"$ROOT"/}\` (bench/tools builds no \`cacheguard-counted\`)"
        log "h. skipped: $H_SKIPPED"
    else
        declare -A ALLOC_START=([alloc-l1]="$ALLOCL1_PORT $ALLOCL1_ADMIN embedded cache.l1=all"
            [alloc-l2]="$ALLOCL2_PORT $ALLOCL2_ADMIN shared cache.l1=off")
        for t in $ALLOC_TARGETS; do
            # shellcheck disable=SC2086 # ALLOC_START: words on purpose
            CG_BIN=$COUNTED_BIN ALLOC_REPORT=$BENCH_TMP/alloc-$t.txt start_cg "$t" ${ALLOC_START[$t]}
            warm "${URL[$t]}" "${HIT[$t]}"
            check_answer "$t" "${URL[$t]}" "$OUT/headers-$t.txt" "$BODY_BYTES"
            deadline=$((SECONDS + 5))
            until [[ -s $BENCH_TMP/alloc-$t.txt ]]; do
                ((SECONDS < deadline)) || die "h. $t wrote no allocation report to $BENCH_TMP/alloc-$t.txt within 5 s"
                sleep 0.1
            done
        done
        printf 'target\trep\tanswered\twindow_s\tbatch_allocs\tbatch_bytes\tidle_allocs\tidle_bytes\tallocs_per_req\tbytes_per_req\n' \
            >"$OUT/alloc.tsv"
        each_rep "$ALLOC_TARGETS" run_alloc
        for t in $ALLOC_TARGETS; do stop_pid "${PID_OF[$t]}"; done
    fi
fi

# --- c. Redis commands per cold miss and per L2 hit ------------------------------------------

# redis_window PREFIX CMD...: one measured window: CONFIG RESETSTAT, MONITOR into
# PREFIX.monitor, CMD..., SETTLE_S for what is still on its way, then INFO commandstats into
# PREFIX.cmdstats. Sets CMD_S (how long CMD took, in seconds).
redis_window() {
    local prefix=$1 t0 mon deadline
    shift
    "${REDIS_CLI[@]}" config resetstat >/dev/null
    start_bg "$prefix.monitor" "${REDIS_CLI[@]}" monitor
    mon=$LAST_PID
    deadline=$((SECONDS + 5))
    until [[ -s $prefix.monitor ]]; do
        ((SECONDS < deadline)) || die "redis-cli monitor did not start (see $prefix.monitor)"
        sleep 0.05
    done
    t0=$EPOCHREALTIME
    "$@"
    CMD_S=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    sleep "$SETTLE_S"
    stop_pid "$mon"
    "${REDIS_CLI[@]}" info commandstats | tr -d '\r' >"$prefix.cmdstats"
}

# window_counts PREFIX: "source command count" lines of one redis_window: source "client" for
# what the clients sent and "lua" for the calls made inside Lua scripts (from MONITOR), and
# "commandstats" (INFO commandstats, which counts both; this script's own CONFIG, INFO and
# MONITOR left out).
window_counts() {
    awk '$2 ~ /^\[/ {
            c = tolower($4); gsub(/"/, "", c)
            n[($3 == "lua]" ? "lua" : "client") " " c]++
        }
        END { for (k in n) print k, n[k] }' "$1.monitor"
    awk -F: '/^cmdstat_/ {
            name = substr($1, 9); split($2, kv, ","); sub(/^calls=/, "", kv[1])
            if (name != "config|resetstat" && name != "info" && name != "monitor") print "commandstats", name, kv[1] + 0
        }' "$1.cmdstats"
}

# redis_cpu_s: redis-server's CPU so far (INFO cpu: used_cpu_sys + used_cpu_user), seconds.
redis_cpu_s() {
    "${REDIS_CLI[@]}" info cpu | tr -d '\r' |
        awk -F: '$1 == "used_cpu_sys" || $1 == "used_cpu_user" { t += $2 } END { printf "%.6f", t }'
}

# redis_cpu_batch MODE PHASE IDS: every id of IDS once, without MONITOR, then an idle window
# as long; redis-server's CPU of each into redis-cpu.tsv.
redis_cpu_batch() {
    local mode=$1 phase=$2 ids=$3 p="$OUT/c/$1-$2-cpu" c0 c1 c2 t0 cmd_s n
    n=$(wc -l <"$ids")
    log "c. l1 = $mode: $phase, Redis CPU: $n requests, then an idle window as long"
    c0=$(redis_cpu_s)
    t0=$EPOCHREALTIME
    run_list "$p.json" "$ids"
    cmd_s=$(awk -v a="$EPOCHREALTIME" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    sleep "$SETTLE_S"
    c1=$(redis_cpu_s)
    sleep "$(awk -v a="$cmd_s" -v b="$SETTLE_S" 'BEGIN { printf "%.3f", a + b }')"
    c2=$(redis_cpu_s)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$phase" "$n" "$(json_counts "$p.json")" \
        "$(awk -v a="$c1" -v b="$c0" 'BEGIN { printf "%.6f", a - b }')" \
        "$(awk -v a="$c2" -v b="$c1" 'BEGIN { printf "%.6f", a - b }')" >>"$OUT/redis-cpu.tsv"
}

# run_list JSON IDS: every id of IDS once through the section-c instance (loadgen list).
run_list() {
    run_bg "$1" timeout --signal=TERM 120 "$LOADGEN_BIN" list --url "http://127.0.0.1:$CGC_PORT/items/{id}" \
        --ids-file "$2" --connections "$LIST_CONNECTIONS" --max-duration-s 60 ||
        die "loadgen list failed ($?); see $1"
}

# redis_batch MODE PHASE IDS EXPECT: one batch (every id of IDS once) and an idle window of the
# same length, into redis.tsv (counts) and redis-batches.tsv (requests, X-Cache, cacheguard's
# metric); a batch with an answer other than X-Cache EXPECT is listed as not clean.
redis_batch() {
    local mode=$1 phase=$2 ids=$3 expect=$4 p="$OUT/c/$1-$2" cmd_s ok xc m_cmds m_reqs n
    n=$(wc -l <"$ids")
    log "c. l1 = $mode: $phase: $n requests, then an idle window as long"
    save_metrics "$CGC_ADMIN_URL" "$p-metrics-before.txt"
    redis_window "$p-batch" run_list "$p.json" "$ids"
    cmd_s=$CMD_S
    save_metrics "$CGC_ADMIN_URL" "$p-metrics-after.txt"
    redis_window "$p-idle" sleep "$cmd_s"
    local w
    for w in batch idle; do
        window_counts "$p-$w" | awk -v m="$mode" -v ph="$phase" -v w="$w" -v OFS='\t' \
            '{ print m, ph, w, $1, $2, $3 }' >>"$OUT/redis.tsv"
    done
    ok=$(jq '.ok' "$p.json")
    xc=$(json_counts "$p.json")
    m_cmds=$(($(metric_sum "$p-metrics-after.txt" cacheguard_request_redis_commands_total) -
        $(metric_sum "$p-metrics-before.txt" cacheguard_request_redis_commands_total)))
    m_reqs=$(($(metric_sum "$p-metrics-after.txt" cacheguard_requests_total) -
        $(metric_sum "$p-metrics-before.txt" cacheguard_requests_total)))
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$phase" "$n" "$ok" "$xc" "$cmd_s" "$m_cmds" "$m_reqs" \
        >>"$OUT/c/batches.tmp"
    local problems=()
    [[ $xc == "$expect=$n" ]] || problems+=("X-Cache $xc, expected $expect for all $n")
    ((ok == n)) || problems+=("$ok of $n answered 2xx")
    note_problems PROBLEMS "c. l1 = $mode, $phase" " (see $p.json)" "${problems[@]}"
}

if has c; then
    printf 'mode\tphase\twindow\tsource\tcommand\tcount\n' >"$OUT/redis.tsv"
    printf 'mode\tphase\trequests\tx_cache\tbatch_cpu_s\tidle_cpu_s\n' >"$OUT/redis-cpu.tsv"
    : >"$OUT/c/batches.tmp"
    first=1000001
    for mode in $L1_MODES; do
        "${REDIS_CLI[@]}" flushall >/dev/null
        start_cg "cg-c-$mode" "$CGC_PORT" "$CGC_ADMIN" shared cache.l1="$mode"
        CGC_ADMIN_URL=${ADMIN_OF[cg-c-$mode]}
        wait_bus "cg-c-$mode" "$CGC_ADMIN_URL" "$OUT/c/$mode-metrics-start.txt"
        sleep 1 # past start-up's own commands
        seq "$first" $((first + REDIS_N - 1)) >"$OUT/c/$mode-ids.txt"
        first=$((first + REDIS_N))
        redis_batch "$mode" miss "$OUT/c/$mode-ids.txt" MISS
        redis_batch "$mode" hit "$OUT/c/$mode-ids.txt" HIT-L2
        seq "$first" $((first + REDIS_N - 1)) >"$OUT/c/$mode-cpu-ids.txt"
        first=$((first + REDIS_N))
        redis_cpu_batch "$mode" miss "$OUT/c/$mode-cpu-ids.txt"
        redis_cpu_batch "$mode" hit "$OUT/c/$mode-cpu-ids.txt"
        stop_pid "${PID_OF[cg-c-$mode]}"
    done
    {
        printf 'mode\tphase\trequests\tok\tx_cache\twindow_s\tmetric_redis_commands\tmetric_requests\n'
        cat "$OUT/c/batches.tmp"
    } >"$OUT/redis-batches.tsv"
    rm -f "$OUT/c/batches.tmp"
fi
if has_any a b c g h; then stop_pid "${PID_OF[redis]}"; fi

# --- d. memory per cached entry --------------------------------------------------------------

# mem_entries TARGET: the entries the section-d instance of TARGET holds.
mem_entries() {
    case $1 in
    nginx) find "$BENCH_TMP/nginx-mem-nginx/cache" -type f | wc -l ;;
    varnish) varnishstat -n "$BENCH_TMP/varnish-mem-varnish/n" -1 -f MAIN.n_object | awk '{ print $2 + 0 }' ;;
    cg-l1)
        save_metrics "${ADMIN_OF[mem-cg-l1]}" "$OUT/d/metrics-cg-l1.txt"
        metric "$OUT/d/metrics-cg-l1.txt" cacheguard_l1_entries
        ;;
    esac
}

# per_entry_kib BYTES ENTRIES: BYTES / ENTRIES in KiB, 3 decimals ("-" when BYTES is "-").
per_entry_kib() {
    if [[ $1 == - ]]; then echo -; else awk -v b="$1" -v n="$2" 'BEGIN { printf "%.3f", b / n / 1024 }'; fi
}

# run_memory TARGET: a fresh instance of TARGET, filled with MEM_KEYS keys, into memory.tsv;
# stopped afterwards.
run_memory() {
    local t=$1 name=mem-$1 pid url pss0 pss1 e0 e1 stored t0 secs received non200 disk=- alloc=-
    case $t in
    nginx)
        start_nginx_cache "$name" "$MEM_NGINX_PORT" "nginx proxy_cache (memory)" "$OUT/d/nginx.conf" \
            WORKERS=2 TTL=600s KEYS_ZONE="$MEM_KEYS_ZONE" MAX_SIZE="$MEM_NGINX_MAX_SIZE"
        ;;
    varnish)
        VARNISH_MALLOC=$MEM_VARNISH_MALLOC start_varnish_cache "$name" "$MEM_VARNISH_PORT" \
            "varnishd (memory)" "$OUT/d/varnish.vcl" TTL=600s GRACE=10s
        ;;
    cg-l1)
        start_cg "$name" "$MEM_CG_PORT" "$MEM_CG_ADMIN" embedded cache.l1=all \
            cache.l1_max_bytes="$MEM_L1_MAX_BYTES"
        ;;
    esac
    pid=${PID_OF[$name]}
    url=${URL_OF[$name]}
    # one entry outside the fill (id 0), so pools and buffers exist before the first reading
    curl -s -o /dev/null "$url/items/0"
    sleep 1
    # shellcheck disable=SC2046 # one PID per line
    pss0=$(pss_kb $(proc_tree "$pid"))
    e0=$(mem_entries "$t")
    log "d. $t: $MEM_KEYS distinct keys, at most $MEM_MAX_DURATION (Pss before: $(mib "$pss0"))"
    t0=$SECONDS
    wrk_distinct "$OUT/d/wrk-$t.txt" "$url" "$MEM_KEYS" "$MEM_MAX_DURATION" "$BENCH_TMP/distinct-done-$t"
    secs=$((SECONDS - t0))
    sleep 3 # writes and cache maintenance still under way
    # shellcheck disable=SC2046
    pss1=$(pss_kb $(proc_tree "$pid"))
    e1=$(mem_entries "$t")
    stored=$((e1 - e0))
    if [[ $t == nginx ]]; then
        # apparent size (du -sb) and the blocks allocated (du -s -B1), directories included
        disk=$(du -sb "$BENCH_TMP/nginx-$name/cache" | awk '{ print $1 }')
        alloc=$(du -s -B1 "$BENCH_TMP/nginx-$name/cache" | awk '{ print $1 }')
    fi
    received=$(distinct_field "$OUT/d/wrk-$t.txt" received)
    non200=$(distinct_field "$OUT/d/wrk-$t.txt" non200)
    local problems=()
    [[ -n $received ]] || die "d. $t: no 'distinct:' line in $OUT/d/wrk-$t.txt"
    ((received >= MEM_KEYS)) || problems+=("only $received of $MEM_KEYS requests answered within $MEM_MAX_DURATION")
    ((non200 == 0)) || problems+=("$non200 non-200 answers")
    ((stored * 100 >= MEM_KEYS * 98)) || problems+=("$stored entries stored for $MEM_KEYS keys")
    ((stored > 0)) || die "d. $t stored no entry"
    note_problems PROBLEMS "d. $t" " (see $OUT/d/wrk-$t.txt)" "${problems[@]}"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$MEM_KEYS" "$received" "$e1" "$stored" \
        "$pss0" "$pss1" "$(per_entry_kib $(((pss1 - pss0) * 1024)) "$stored")" "$disk" "$(per_entry_kib "$disk" "$e1")" \
        "$(per_entry_kib "$alloc" "$e1")" "$secs" >>"$OUT/memory.tsv"
    log "d. $t: $stored entries in $secs s, Pss $(mib "$pss0") -> $(mib "$pss1")"
    stop_pid "$pid"
}

if has d; then
    printf 'target\tkeys\tanswered\tentries\tfilled\tpss_before_kb\tpss_after_kb\tkib_per_entry\tdisk_bytes\tdisk_kib_per_entry\talloc_kib_per_entry\tfill_s\n' \
        >"$OUT/memory.tsv"
    for t in cg-l1 nginx varnish; do run_memory "$t"; done
fi

# --- i. a 1M-key working set ----------------------------------------------------------------

# fill_ids TARGET IDS: every id of IDS once through TARGET (`loadgen list`, FILL_CONNECTIONS
# connections, every answer awaited), into working-set-fill.tsv; not clean unless every id was
# answered 2xx as a miss and stored.
fill_ids() {
    local t=$1 ids=$2 json="$OUT/i/fill-$1.json" t0 secs ok xc entries problems=() n
    n=$(wc -l <"$ids")
    log "i. $t: filling $n keys (loadgen list, $FILL_CONNECTIONS connections, at most ${I_FILL_MAX_S}s)"
    t0=$SECONDS
    run_bg "$json" timeout --signal=TERM $((I_FILL_MAX_S + 60)) "$LOADGEN_BIN" list \
        --url "${URL_OF[$t]}/items/{id}" --ids-file "$ids" --connections "$FILL_CONNECTIONS" \
        --max-duration-s "$I_FILL_MAX_S" || die "loadgen list failed ($?) for the $t fill; see $json"
    secs=$((SECONDS - t0))
    sleep 1 # writes still under way
    case $t in
    i-nginx) entries=$(find "$BENCH_TMP/nginx-$t/cache" -type f | wc -l) ;;
    i-cg)
        save_metrics "${ADMIN_OF[$t]}" "$OUT/i/metrics-$t-filled.txt"
        entries=$(metric "$OUT/i/metrics-$t-filled.txt" cacheguard_l1_entries)
        ;;
    esac
    ok=$(jq '.ok' "$json")
    xc=$(json_counts "$json")
    ((ok == n)) || problems+=("$ok of $n answered 2xx")
    [[ $xc == "MISS=$n" ]] || problems+=("X-Cache $xc, expected MISS for all $n")
    ((entries >= n)) || problems+=("$entries entries stored for $n keys")
    note_problems PROBLEMS "i. $t fill" " (see $json)" "${problems[@]}"
    printf '%s	%s	%s	%s	%s	%s
' "$t" "$n" "$ok" "$xc" "$entries" "$secs" >>"$OUT/working-set-fill.tsv"
    log "i. $t: $entries entries after $secs s"
}

if has i; then
    start_cg i-cg "$I_CG_PORT" "$I_CG_ADMIN" embedded cache.l1=all cache.l1_max_bytes="$I_L1_MAX_BYTES" \
        cache.ttl=3600s
    start_nginx_cache i-nginx "$I_NGINX_PORT" "nginx proxy_cache (working set)" "$OUT/i/nginx.conf" \
        WORKERS=2 TTL=3600s INACTIVE=60m KEYS_ZONE="$I_KEYS_ZONE" MAX_SIZE="$I_NGINX_MAX_SIZE"
    seq 1 "$I_KEYS" >"$BENCH_TMP/i-ids.txt"
    printf 'target\tkeys\tanswered\tx_cache\tentries\tfill_s\n' >"$OUT/working-set-fill.tsv"
    for t in i-cg i-nginx; do fill_ids "$t" "$BENCH_TMP/i-ids.txt"; done
    echo "$THROUGHPUT_HEAD" >"$OUT/working-set.tsv"
    each_rep "$I_TARGETS" run_throughput i
    for t in $I_TARGETS; do stop_pid "${PID_OF[$t]}"; done
fi
if has_any a b c d f g h i; then stop_pid "${PID_OF[static]}"; fi

# --- e. stampede (bench/stampede.sh) --------------------------------------------------------

STAMPEDE_DIR=$OUT/e/stampede
if has e; then
    log "e. bash bench/stampede.sh (CONCURRENCIES=$STAMPEDE_C TARGETS=\"direct nginx2 varnish2 cg2\" REPS=$REPS; log in $OUT/e/stampede.log)"
    rc=0
    run_bg "$OUT/e/stampede.log" env CONCURRENCIES="$STAMPEDE_C" TARGETS="direct nginx2 varnish2 cg2" REPS="$REPS" \
        DELAY_MS="$STAMPEDE_DELAY_MS" CACHEGUARD_BIN="$CG_BIN" BASE_PORT="$STAMPEDE_BASE_PORT" \
        RESULTS_DIR="$STAMPEDE_DIR" TOOLS_TARGET="$TOOLS_TARGET" bash bench/stampede.sh || rc=$?
    if ((rc != 0)) || [[ ! -f $STAMPEDE_DIR/raw.tsv ]]; then
        note_problems PROBLEMS "e. bench/stampede.sh" " (see $OUT/e/stampede.log)" "exited with $rc"
    else
        cp "$STAMPEDE_DIR/raw.tsv" "$OUT/stampede.tsv"
        while IFS=$'\t' read -r c t rep ready ok non2xx errors setup_f; do
            problems=()
            ((ready == c)) || problems+=("$ready of $c connections ready")
            ((ok == c && non2xx == 0 && errors == 0 && setup_f == 0)) ||
                problems+=("$ok ok, $non2xx non-2xx, $errors errors, $setup_f setup failures")
            note_problems PROBLEMS "e. $t rep $rep" "" "${problems[@]}"
        done < <(awk -F'\t' -v OFS='\t' 'NR > 1 { print $1, $2, $3, $8, $10, $11, $12, $13 }' "$OUT/stampede.tsv")
    fi
fi

end_env

# --- summary -----------------------------------------------------------------------------

# values FILE COLUMN TARGET [NAME=VALUE...]: tsv_col of one target's rows.
values() { tsv_col "$1" "$2" target="$3" "${@:4}"; }
# med FILE COLUMN TARGET [NAME=VALUE...]: their median ("" without any).
med() {
    local v
    mapfile -t v < <(values "$@")
    ((${#v[@]} == 0)) || median "${v[@]}"
}
# vals_cell KIND V...: "median (min–max)" of V... (KIND int, or a number of decimals); "–"
# without any.
vals_cell() {
    local kind=$1
    shift
    if (($# == 0)); then
        printf '–'
    elif [[ $kind == int ]]; then
        cell int "$@"
    else
        cell_dec "$kind" "$@"
    fi
}
# vcell KIND FILE COLUMN TARGET: vals_cell of one target's values.
vcell() {
    local v
    mapfile -t v < <(values "${@:2}")
    vals_cell "$1" "${v[@]}"
}
# q A B: A / B with 4 decimals; "" unless both are positive.
q() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.4f", a / b }'; }
# r2 X [SUFFIX]: X with 2 decimals and SUFFIX; "–" when X is empty.
r2() { if [[ -n $1 ]]; then LC_ALL=C printf '%.2f%s' "$1" "${2:-}"; else printf '–'; fi; }
# judge VALUE OP LIMIT: the verdict of VALUE OP LIMIT (<= or >=); "not measured" without VALUE.
judge() {
    if [[ -z $1 ]]; then
        echo "not measured"
        return
    fi
    verdict "$(awk -v v="$1" -v l="$3" -v op="$2" 'BEGIN { print ((op == "<=") ? (v <= l) : (v >= l)) ? 1 : 0 }')"
}
# row LABEL CELL...: one markdown table row.
row() {
    local out="| $1 |" c
    shift
    for c in "$@"; do out+=" $c |"; done
    echo "$out"
}
# ratio_row FILE COLUMN WHICH: "↳ ratio to nginx proxy_cache" cells of the medians, for the
# targets in WHICH (the other cells empty).
ratio_row() {
    local file=$1 col=$2 which=$3 t base cells=()
    base=$(med "$file" "$col" nginx)
    for t in $MAIN_TARGETS; do
        if [[ " $which " == *" $t "* ]]; then cells+=("$(r2 "$(q "$(med "$file" "$col" "$t")" "$base")")"); else cells+=(""); fi
    done
    row "↳ ratio to nginx proxy_cache" "${cells[@]}"
}

# section c: per request, net of the idle window (SOURCE client, lua or commandstats)
# c_total MODE PHASE SOURCE: (batch − idle) commands / requests.
c_total() {
    [[ -f $OUT/redis-batches.tsv ]] || return 0
    local n
    n=$(tsv_col "$OUT/redis-batches.tsv" requests mode="$1" phase="$2")
    [[ -n $n ]] || return 0
    awk -F'\t' -v m="$1" -v p="$2" -v s="$3" -v n="$n" '
        NR > 1 && $1 == m && $2 == p && $4 == s { t += ($3 == "batch") ? $6 : -$6 }
        END { printf "%.3f", t / n }' "$OUT/redis.tsv"
}
# c_breakdown MODE PHASE SOURCE: "cmd x.xx, cmd y.yy" per request, net of the idle window (the
# commands that round to 0.00 left out).
c_breakdown() {
    local n
    n=$(tsv_col "$OUT/redis-batches.tsv" requests mode="$1" phase="$2")
    awk -F'\t' -v m="$1" -v p="$2" -v s="$3" -v n="$n" '
        NR > 1 && $1 == m && $2 == p && $4 == s { t[$5] += ($3 == "batch") ? $6 : -$6 }
        END { for (c in t) if (t[c] / n >= 0.005 || t[c] / n <= -0.005) printf "%s %.2f\n", c, t[c] / n }' "$OUT/redis.tsv" |
        sort -k2,2gr -k1,1 | awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2 }'
}
# c_cpu MODE PHASE: redis-server's CPU µs per request (batch − idle, without MONITOR).
c_cpu() {
    [[ -f $OUT/redis-cpu.tsv ]] || return 0
    awk -F'\t' -v m="$1" -v p="$2" 'NR > 1 && $1 == m && $2 == p && $3 > 0 {
            printf "%.1f", ($5 - $6) * 1e6 / $3 }' "$OUT/redis-cpu.tsv"
}
# c_metric MODE PHASE: cacheguard_request_redis_commands_total / cacheguard_requests_total over
# the batch.
c_metric() {
    local c n
    c=$(tsv_col "$OUT/redis-batches.tsv" metric_redis_commands mode="$1" phase="$2")
    n=$(tsv_col "$OUT/redis-batches.tsv" metric_requests mode="$1" phase="$2")
    [[ -n $c ]] || return 0
    awk -v c="$c" -v n="$n" 'BEGIN { if (n > 0) printf "%.3f", c / n }'
}

# section e (stampede.tsv: c, target, rep, ..., origin_cold, p99_ms)
e_values() { values "$OUT/stampede.tsv" "$1" "$2" c="$STAMPEDE_C"; }
# e_cell COLUMN TARGET DECIMALS: vals_cell of one stampede.tsv column.
e_cell() {
    local v
    mapfile -t v < <(e_values "$1" "$2")
    vals_cell "$3" "${v[@]}"
}
# e_ratio_cell TARGET: vals_cell of the runs' p99 / origin delay.
e_ratio_cell() {
    local v
    mapfile -t v < <(e_values p99_ms "$1" | awk -v d="$STAMPEDE_DELAY_MS" '{ printf "%.4f\n", $1 / d }')
    vals_cell 2 "${v[@]}"
}
declare -A E_OF=([static]=direct [nginx]=nginx2 [varnish]=varnish2 [cg-l2]=cg2)

# l2_cell KIND FILE COLUMN TARGET: vcell for an L2 target (its redis-server columns), "–" for
# the others.
l2_cell() { if [[ $4 == *-l2 ]]; then vcell "$@"; else printf '–'; fi; }
# wrk_table FILE TARGETS: the detail table of a wrk section (a, f, g, i): per target, req/s,
# latencies, the requests that reached the origin, X-Cache after, and CPU and context switches
# per request of the target's processes (and redis-server's) over the run.
wrk_table() {
    local f=$1 t
    echo "| target | req/s | p50 ms | p99 ms | max ms | origin requests per rep | X-Cache after | CPU µs/req | ctx switches/req | redis-server µs/req | redis-server ctx switches/req |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    for t in $2; do
        [[ -n $(values "$f" rps "$t") ]] || continue
        echo "| $t | $(vcell int "$f" rps "$t") | $(vcell 3 "$f" p50_ms "$t") | $(vcell 3 "$f" p99_ms "$t") | $(vcell 3 "$f" max_ms "$t") | $(values "$f" origin_requests "$t" | paste -sd/) | $(values "$f" x_cache_after "$t" | sort -u | paste -sd,) | $(vcell 2 "$f" cpu_us_per_req "$t") | $(vcell 3 "$f" ctxsw_per_req "$t") | $(l2_cell 2 "$f" redis_us_per_req "$t") | $(l2_cell 3 "$f" redis_ctxsw_per_req "$t") |"
    done
}
# cpu_table FILE TARGETS: the detail table of a fixed-rate section (b, f).
cpu_table() {
    local f=$1 t
    echo "| target | processes | achieved req/s | CPU µs/req | redis-server µs/req | total µs/req | ctx switches/req | redis-server ctx switches/req |"
    echo "|---|---|---|---|---|---|---|---|"
    for t in $2; do
        [[ -n $(values "$f" achieved_rps "$t") ]] || continue
        echo "| $t | $(values "$f" processes "$t" | sort -u | paste -sd/) | $(vcell int "$f" achieved_rps "$t") | $(vcell 2 "$f" cpu_us_per_req "$t") | $(l2_cell 2 "$f" redis_us_per_req "$t") | $(vcell 2 "$f" total_us_per_req "$t") | $(vcell 3 "$f" ctxsw_per_req "$t") | $(l2_cell 3 "$f" redis_ctxsw_per_req "$t") |"
    done
}

# the targets' figures
RPS_NGINX=$(med "$OUT/throughput.tsv" rps nginx)
CPU_NGINX=$(med "$OUT/cpu.tsv" total_us_per_req nginx)
R_L1_RPS=$(q "$(med "$OUT/throughput.tsv" rps cg-l1)" "$RPS_NGINX")
R_L2_RPS=$(q "$(med "$OUT/throughput.tsv" rps cg-l2)" "$RPS_NGINX")
R_L1_CPU=$(q "$(med "$OUT/cpu.tsv" total_us_per_req cg-l1)" "$CPU_NGINX")
R_L2_CPU=$(q "$(med "$OUT/cpu.tsv" total_us_per_req cg-l2)" "$CPU_NGINX")
R_L2_OWN_CPU=$(q "$(med "$OUT/cpu.tsv" cpu_us_per_req cg-l2)" "$CPU_NGINX")
R_L2_REDIS_CPU=$(q "$(med "$OUT/cpu.tsv" redis_us_per_req cg-l2)" "$CPU_NGINX")
R_FWD_CPU=$(q "$(med "$OUT/forward-cpu.tsv" cpu_us_per_req cg-fwd)" "$(med "$OUT/forward-cpu.tsv" cpu_us_per_req nginx-fwd)")
R_FWD_RPS=$(q "$(med "$OUT/forward-throughput.tsv" rps cg-fwd)" "$(med "$OUT/forward-throughput.tsv" rps nginx-fwd)")
# section g: context switches per request at RATE (b's runs) and closed loop (g's own)
CTX_OPEN_L1=$(med "$OUT/cpu.tsv" ctxsw_per_req cg-l1)
CTX_OPEN_L2=$(med "$OUT/cpu.tsv" ctxsw_per_req cg-l2)
CTX_CLOSED_L1=$(med "$OUT/ctxsw.tsv" ctxsw_per_req cg-l1)
CTX_CLOSED_L2=$(med "$OUT/ctxsw.tsv" ctxsw_per_req cg-l2)
R_I_RPS=$(q "$(med "$OUT/working-set.tsv" rps i-cg)" "$(med "$OUT/working-set.tsv" rps i-nginx)")
MISS_CMDS=""
for mode in $L1_MODES; do
    miss=$(c_total "$mode" miss client)
    [[ -z $miss ]] || MISS_CMDS=$(awk -v a="$miss" -v b="${MISS_CMDS:-0}" 'BEGIN { print (a > b) ? a : b }')
done
MEM_CG=$(med "$OUT/memory.tsv" kib_per_entry cg-l1)
P99_CG2=$(q "$(med "$OUT/stampede.tsv" p99_ms cg2 c="$STAMPEDE_C")" "$STAMPEDE_DELAY_MS")
P99_FLOOR=$(q "$(med "$OUT/stampede.tsv" p99_ms cg2 c="$STAMPEDE_C")" "$(med "$OUT/stampede.tsv" p99_ms direct c="$STAMPEDE_C")")

# hit_share TARGET: 1 − (requests that reached the origin) / (requests answered), over every
# section-i run of TARGET, 4 decimals ("" without any).
hit_share() {
    awk -F'\t' -v t="$1" 'NR > 1 && $1 == t { o += $10; n += $7 }
        END { if (n > 0) printf "%.4f", 1 - o / n }' "$OUT/working-set.tsv" 2>/dev/null || true
}
# reported VALUE: the verdict of a figure without a target: "reported", or "not measured".
reported() { if [[ -n $1 ]]; then echo reported; else echo "not measured"; fi; }
# ctx_where LIMIT OPEN CLOSED: in which of the two readings (at RATE, open loop; closed loop)
# a figure is within LIMIT.
ctx_where() {
    local open=- closed=-
    [[ -z $2 ]] || open=$(awk -v v="$2" -v l="$1" 'BEGIN { print (v <= l) ? "yes" : "no" }')
    [[ -z $3 ]] || closed=$(awk -v v="$3" -v l="$1" 'BEGIN { print (v <= l) ? "yes" : "no" }')
    case $open/$closed in
    yes/yes) echo "met in both readings" ;;
    no/yes) echo "met only in the closed loop (\`wrk -t1 -c16\`), not at $(fmt_int "$RATE") req/s open loop" ;;
    yes/no) echo "met only at $(fmt_int "$RATE") req/s open loop, not in the closed loop" ;;
    no/no) echo "met in neither reading" ;;
    *) echo "not measured in both readings (open loop: ${2:-not measured}; closed loop: ${3:-not measured})" ;;
    esac
}
# alloc_cell TARGET: "allocations (bytes)" per request, medians over the reps; "–" without any.
alloc_cell() {
    local a b
    a=$(med "$OUT/alloc.tsv" allocs_per_req "$1")
    b=$(med "$OUT/alloc.tsv" bytes_per_req "$1")
    if [[ -z $a ]]; then printf '–'; else LC_ALL=C printf '%.2f (%.0f B)' "$a" "$b"; fi
}
I_SHARE_CG=$(hit_share i-cg)
I_SHARE_NGINX=$(hit_share i-nginx)
I_CLEAN=""
if [[ -n $I_SHARE_CG ]] && ! awk -v a="$I_SHARE_CG" -v b="$I_SHARE_NGINX" 'BEGIN { exit !(a == 1 && b == 1) }'; then
    I_CLEAN=" (not clean: hit share cacheguard $I_SHARE_CG, nginx $I_SHARE_NGINX)"
fi

{
    echo "# cacheguard fleet cost: $STAMP"
    echo
    echo "cacheguard next to nginx proxy_cache and Varnish on one 1 KiB JSON key (origin: nginx \`return 200\`, the"
    echo "\"static nginx\" column). Cells are **median (min–max)** over $REPS reps, targets rotating within each rep (sections d"
    echo "and i's fill: one run). cacheguard L1 = embedded, \`l1 = \"all\"\`, L1 hits; cacheguard L2 = shared mode with one"
    echo "redis-server, \`l1 = \"off\"\`, L2 hits. Everything runs on 127.0.0.1 on the same $(nproc) cores: load generator,"
    echo "targets, origin, Redis. Sections: $SECTIONS."
    echo
    if has_any a b c d e g h i; then
        row measure "static nginx" "nginx proxy_cache" Varnish "cacheguard L1" "cacheguard L2"
        echo "|---|---|---|---|---|---|"
        if has a; then
            cells=()
            for t in $MAIN_TARGETS; do cells+=("$(vcell int "$OUT/throughput.tsv" rps "$t")"); done
            row "a. hit req/s (\`wrk -t2 -c64 -d$DURATION\`)" "${cells[@]}"
            ratio_row "$OUT/throughput.tsv" rps "$TARGETS"
            cells=()
            for t in $MAIN_TARGETS; do cells+=("$(vcell 3 "$OUT/throughput.tsv" p99_ms "$t")"); done
            row "a. hit p99 ms under that load" "${cells[@]}"
        fi
        if has b; then
            cells=()
            for t in $MAIN_TARGETS; do cells+=("$(vcell 2 "$OUT/cpu.tsv" cpu_us_per_req "$t")"); done
            row "b. CPU µs per hit at $(fmt_int "$RATE") req/s, the target's processes" "${cells[@]}"
            row "b. redis-server CPU µs per hit" "" "" "" "" "$(vcell 2 "$OUT/cpu.tsv" redis_us_per_req cg-l2)"
            cells=()
            for t in $MAIN_TARGETS; do cells+=("$(vcell 2 "$OUT/cpu.tsv" total_us_per_req "$t")"); done
            row "**b. CPU µs per hit, all processes** (cacheguard L2: + redis-server)" "${cells[@]}"
            ratio_row "$OUT/cpu.tsv" total_us_per_req "$TARGETS"
            cells=()
            for t in $MAIN_TARGETS; do cells+=("$(vcell 3 "$OUT/cpu.tsv" ctxsw_per_req "$t")"); done
            row "g. context switches per hit at $(fmt_int "$RATE") req/s (b's runs), the target's processes" "${cells[@]}"
            row "g. redis-server context switches per hit at $(fmt_int "$RATE") req/s" "" "" "" "" "$(vcell 3 "$OUT/cpu.tsv" redis_ctxsw_per_req cg-l2)"
        fi
        if has g; then
            cells=()
            for t in $MAIN_TARGETS; do cells+=("$(vcell 3 "$OUT/ctxsw.tsv" ctxsw_per_req "$t")"); done
            row "g. context switches per hit, closed loop \`wrk -t1 -c16\`" "${cells[@]}"
            row "g. redis-server context switches per hit, closed loop" "" "" "" "" "$(vcell 3 "$OUT/ctxsw.tsv" redis_ctxsw_per_req cg-l2)"
        fi
        if has h; then
            row "h. allocations (bytes) per hit, net of idle" "" "" "" "$(alloc_cell alloc-l1)" "$(alloc_cell alloc-l2)"
        fi
        if has c; then
            for mode in $L1_MODES; do
                row "c. Redis commands per cold miss, \`l1 = \"$mode\"\` (sent by cacheguard; its metric; executed by Redis; Redis CPU µs)" "n/a" "n/a" "n/a" "0 (no Redis)" \
                    "$(r2 "$(c_total "$mode" miss client)") ($(r2 "$(c_metric "$mode" miss)")); $(r2 "$(c_total "$mode" miss commandstats)"); $(c_cpu "$mode" miss) µs"
            done
            row "c. Redis commands per L2 hit, \`l1 = \"off\"\` (sent by cacheguard; its metric; executed by Redis; Redis CPU µs)" "n/a" "n/a" "n/a" "0 (no Redis)" \
                "$(r2 "$(c_total off hit client)") ($(r2 "$(c_metric off hit)")); $(r2 "$(c_total off hit commandstats)"); $(c_cpu off hit) µs"
        fi
        if has d; then
            cells=("")
            for t in nginx varnish cg-l1; do cells+=("$(vcell 3 "$OUT/memory.tsv" kib_per_entry "$t")"); done
            row "d. KiB of memory (Pss) per cached 1 KiB entry, $(fmt_int "$MEM_KEYS") keys" "${cells[@]}" ""
            ratio_row "$OUT/memory.tsv" kib_per_entry "nginx varnish cg-l1"
            row "d. nginx: KiB of disk per entry (du -sb)" "" "$(vcell 3 "$OUT/memory.tsv" disk_kib_per_entry nginx)" "" "" ""
        fi
        if has i; then
            row "i. req/s over $(fmt_int "$I_KEYS") cached keys, random (\`wrk -t2 -c64 -d$DURATION\`)" "" \
                "$(vcell int "$OUT/working-set.tsv" rps i-nginx)" "" "$(vcell int "$OUT/working-set.tsv" rps i-cg)" ""
            row "↳ ratio to nginx proxy_cache" "" "1.00" "" "$(r2 "$R_I_RPS")" ""
            row "i. hit share (1 − origin requests / requests)" "" "$(r2 "$I_SHARE_NGINX")" "" "$(r2 "$I_SHARE_CG")" ""
        fi
        if has e; then
            cells=()
            for t in static nginx varnish cg-l1 cg-l2; do
                if [[ -n ${E_OF[$t]:-} ]]; then cells+=("$(e_cell origin_cold "${E_OF[$t]}" 0)"); else cells+=(""); fi
            done
            row "e. stampede, 2 instances, C = $(fmt_int "$STAMPEDE_C"): origin requests" "${cells[@]}"
            cells=()
            for t in static nginx varnish cg-l1 cg-l2; do
                if [[ -n ${E_OF[$t]:-} ]]; then cells+=("$(e_cell p99_ms "${E_OF[$t]}" 1)"); else cells+=(""); fi
            done
            row "e. waiter p99 ms (origin delay $STAMPEDE_DELAY_MS ms)" "${cells[@]}"
            cells=()
            for t in static nginx varnish cg-l1 cg-l2; do
                if [[ -n ${E_OF[$t]:-} ]]; then cells+=("$(e_ratio_cell "${E_OF[$t]}")"); else cells+=(""); fi
            done
            row "e. waiter p99 / origin delay" "${cells[@]}"
        fi
    fi
    echo
    echo "- ↳ rows: the target's median over nginx proxy_cache's median. Section e's cacheguard is two shared-mode"
    echo "  instances on one Redis (bench/stampede.sh \`cg2\`), shown in the L2 column; in the static column, the"
    echo "  origin answering the same C requests itself, with no proxy (\`direct\`): the floor of this machine."
    echo "- c: commands per request net of an idle window as long as the batch; \"its metric\" ="
    echo "  \`cacheguard_request_redis_commands_total\` / \`cacheguard_requests_total\` over the batch. Details below."
    echo "- g: voluntary + nonvoluntary context switches of every thread of the target's processes per answered request."
    echo "  Two readings: at $(fmt_int "$RATE") req/s open loop (in b's runs) a process idle between requests wakes about once"
    echo "  per request whatever it does; in the closed loop requests are always queued. h: a counting build, see below."
    echo
    if has_any f g; then
        echo "Plain forward (section f): a POST of a $BODY_BYTES-byte JSON body to $KEY, nginx \`proxy_pass\` (no cache,"
        echo "keep-alive upstream, 2 workers) and a cacheguard write route (embedded mode; no invalidate, stock gate or"
        echo "serialize), both to the same origin."
        echo
        row measure "nginx proxy_pass" "cacheguard forward" "ratio"
        echo "|---|---|---|---|"
        row "f. req/s (\`wrk -t2 -c64 -d$DURATION\`, POST body)" "$(vcell int "$OUT/forward-throughput.tsv" rps nginx-fwd)" \
            "$(vcell int "$OUT/forward-throughput.tsv" rps cg-fwd)" "$(r2 "$R_FWD_RPS")"
        row "f. p99 ms under that load" "$(vcell 3 "$OUT/forward-throughput.tsv" p99_ms nginx-fwd)" \
            "$(vcell 3 "$OUT/forward-throughput.tsv" p99_ms cg-fwd)" ""
        row "**f. CPU µs per request at $(fmt_int "$RATE") req/s**" "$(vcell 2 "$OUT/forward-cpu.tsv" cpu_us_per_req nginx-fwd)" \
            "$(vcell 2 "$OUT/forward-cpu.tsv" cpu_us_per_req cg-fwd)" "$(r2 "$R_FWD_CPU")"
        row "g. context switches per request at $(fmt_int "$RATE") req/s (f's runs)" "$(vcell 3 "$OUT/forward-cpu.tsv" ctxsw_per_req nginx-fwd)" \
            "$(vcell 3 "$OUT/forward-cpu.tsv" ctxsw_per_req cg-fwd)" ""
        row "g. context switches per request, closed loop \`wrk -t1 -c16\`" "$(vcell 3 "$OUT/ctxsw.tsv" ctxsw_per_req nginx-fwd)" \
            "$(vcell 3 "$OUT/ctxsw.tsv" ctxsw_per_req cg-fwd)" ""
        echo
    fi
    echo "## Targets"
    echo
    echo "Ratios of medians from this run. Context-switch targets: both readings shown, the verdict is the"
    echo "open-loop one (at $(fmt_int "$RATE") req/s, as the target is stated), the closed-loop one in its own row."
    echo
    echo "| target | measured | verdict |"
    echo "|---|---|---|"
    echo "| L1 hit req/s ≥ 1.25× nginx proxy_cache's (a) | $(r2 "$R_L1_RPS" ×) | $(judge "$R_L1_RPS" ">=" 1.25) |"
    echo "| L1 hit CPU ≤ 0.75× nginx proxy_cache's at $(fmt_int "$RATE") req/s (b) | $(r2 "$R_L1_CPU" ×) | $(judge "$R_L1_CPU" "<=" 0.75) |"
    echo "| L2 hit CPU, cacheguard's own, ≤ 1.5× nginx proxy_cache's (b; redis-server's beside) | $(r2 "$R_L2_OWN_CPU" ×) (+ redis-server $(r2 "$R_L2_REDIS_CPU" ×) = $(r2 "$R_L2_CPU" ×)) | $(judge "$R_L2_OWN_CPU" "<=" 1.5) |"
    echo "| L2 hit req/s ≥ 1.0× nginx proxy_cache's (a) | $(r2 "$R_L2_RPS" ×) | $(judge "$R_L2_RPS" ">=" 1.0) |"
    echo "| memory (Pss) per cached 1 KiB entry at $(fmt_int "$MEM_KEYS") keys ≤ 1.25 KiB (d, cacheguard L1) | $(r2 "$MEM_CG" " KiB") | $(judge "$MEM_CG" "<=" 1.25) |"
    echo "| plain forward CPU ≤ 1.0× nginx proxy_pass's at $(fmt_int "$RATE") req/s (f) | $(r2 "$R_FWD_CPU" ×) | $(judge "$R_FWD_CPU" "<=" 1.0) |"
    echo "| plain forward req/s, to nginx proxy_pass's (f; no target) | $(r2 "$R_FWD_RPS" ×) | $(reported "$R_FWD_RPS") |"
    echo "| context switches per L1 hit ≤ 0.05 at $(fmt_int "$RATE") req/s (g, b's runs; nginx proxy_cache: $(r2 "$(med "$OUT/cpu.tsv" ctxsw_per_req nginx)")) | $(r2 "$CTX_OPEN_L1") | $(judge "$CTX_OPEN_L1" "<=" 0.05) |"
    echo "| ↳ the same, closed loop \`wrk -t1 -c16\` (nginx proxy_cache: $(r2 "$(med "$OUT/ctxsw.tsv" ctxsw_per_req nginx)")) | $(r2 "$CTX_CLOSED_L1") | $(judge "$CTX_CLOSED_L1" "<=" 0.05) |"
    echo "| context switches per L2 hit ≤ 1.0 at $(fmt_int "$RATE") req/s, cacheguard's own (g; redis-server's: $(r2 "$(med "$OUT/cpu.tsv" redis_ctxsw_per_req cg-l2)")) | $(r2 "$CTX_OPEN_L2") | $(judge "$CTX_OPEN_L2" "<=" 1.0) |"
    echo "| ↳ the same, closed loop \`wrk -t1 -c16\` (redis-server's: $(r2 "$(med "$OUT/ctxsw.tsv" redis_ctxsw_per_req cg-l2)")) | $(r2 "$CTX_CLOSED_L2") | $(judge "$CTX_CLOSED_L2" "<=" 1.0) |"
    echo "| allocations (bytes) per hit, L1 / L2 (h; no target) | ${H_SKIPPED:-$(alloc_cell alloc-l1) / $(alloc_cell alloc-l2)} | $(reported "$(med "$OUT/alloc.tsv" allocs_per_req alloc-l1)") |"
    echo "| $(fmt_int "$I_KEYS")-key working set req/s ≥ 1.9× nginx proxy_cache's (i) | $(r2 "$R_I_RPS" ×)$I_CLEAN | $(judge "$R_I_RPS" ">=" 1.9) |"
    echo "| Redis commands per cold miss ≤ 4 (c, the larger of \`l1 = \"off\"\` and \`\"hot\"\`) | $(r2 "$MISS_CMDS") | $(judge "$MISS_CMDS" "<=" 4) |"
    echo "| Redis commands per L2 hit ≤ 1 (c, \`l1 = \"off\"\`) | $(r2 "$(c_total off hit client)") | $(judge "$(c_total off hit client)" "<=" 1) |"
    echo "| stampede waiter p99 ≤ 1.10× the no-proxy floor (e: cacheguard's p99 / direct's, 2 instances, C = $(fmt_int "$STAMPEDE_C")) | $(r2 "$P99_FLOOR" ×) | $(judge "$P99_FLOOR" "<=" 1.10) |"
    echo "| ↳ waiter p99 / origin delay (e; no target) | $(r2 "$P99_CG2" ×) | $(reported "$P99_CG2") |"
    echo
    echo "- Context switches per L1 hit ≤ 0.05: $(ctx_where 0.05 "$CTX_OPEN_L1" "$CTX_CLOSED_L1"). Per L2 hit ≤ 1.0:"
    echo "  $(ctx_where 1.0 "$CTX_OPEN_L2" "$CTX_CLOSED_L2"). nginx proxy_cache's own: $(r2 "$(med "$OUT/cpu.tsv" ctxsw_per_req nginx)") at"
    echo "  $(fmt_int "$RATE") req/s, $(r2 "$(med "$OUT/ctxsw.tsv" ctxsw_per_req nginx)") closed loop."
    echo
    env_summary
    echo
    problem_items "- Every run was clean: no errors or non-2xx, every answer a hit where one was expected, the fixed rate reached, every key stored." \
        "" "${PROBLEMS[@]}"

    if has a; then
        echo
        echo "## a. Hit throughput"
        echo
        echo "\`wrk -t2 -c64 -d$DURATION --timeout 10s --latency\` on $KEY, warmed first. origin requests = requests that"
        echo "reached the origin during the run (its stub_status counter): 0 means every answer was a hit."
        echo
        wrk_table "$OUT/throughput.tsv" "$TARGETS"
    fi
    if has b; then
        echo
        echo "## b. CPU per hit at $(fmt_int "$RATE") req/s"
        echo
        echo "\`loadgen rate --rate $RATE --connections $RATE_CONNECTIONS --duration-s $RATE_DURATION_S\` after a ${RATE_WARMUP_S} s warm-up run."
        echo "CPU = utime + stime of /proc/PID/stat (clock ticks of 1/$TCK s) of every process of the target, read just"
        echo "before and after the measured run, divided by the answers. Processes: static and nginx = master + workers"
        echo "(and the cache manager / loader), Varnish = manager + cache child, cacheguard = one process (every thread)."
        echo
        cpu_table "$OUT/cpu.tsv" "$TARGETS"
    fi
    if has c; then
        echo
        echo "## c. Redis commands per request (cacheguard shared mode)"
        echo
        echo "$REDIS_N requests per batch (\`loadgen list\`, $LIST_CONNECTIONS connections): never-seen ids (miss), then the same"
        echo "ids again (hit). Each batch and an idle window as long as it: \`CONFIG RESETSTAT\`, MONITOR, the batch,"
        echo "${SETTLE_S} s, \`INFO commandstats\`. Per request, net of the idle window:"
        echo "**sent** = the commands cacheguard sent (MONITOR, without the calls made inside Lua scripts);"
        echo "**commandstats** = INFO commandstats calls, which count the calls made inside scripts as well;"
        echo "**metric** = cacheguard's \`cacheguard_request_redis_commands_total\` / \`cacheguard_requests_total\` over the batch;"
        echo "**Redis CPU** = redis-server's used_cpu_sys + used_cpu_user (\`INFO cpu\`) per request, from a second batch of"
        echo "$REDIS_N other ids (and the same again for hits) run without MONITOR, net of an idle window as long."
        echo
        echo "| l1 | batch | X-Cache | window s | sent | sent, per command | commandstats | commandstats, per command | metric | Redis CPU µs | idle window: sent |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|"
        for mode in $L1_MODES; do
            for phase in miss hit; do
                idle=$(awk -F'\t' -v m="$mode" -v p="$phase" 'NR > 1 && $1 == m && $2 == p && $3 == "idle" && $4 == "client" { printf "%s%s %s", (n++ ? ", " : ""), $5, $6 }' "$OUT/redis.tsv")
                echo "| $mode | $phase | $(tsv_col "$OUT/redis-batches.tsv" x_cache mode="$mode" phase="$phase") | $(tsv_col "$OUT/redis-batches.tsv" window_s mode="$mode" phase="$phase") | **$(r2 "$(c_total "$mode" "$phase" client)")** | $(c_breakdown "$mode" "$phase" client) | $(r2 "$(c_total "$mode" "$phase" commandstats)") | $(c_breakdown "$mode" "$phase" commandstats) | $(r2 "$(c_metric "$mode" "$phase")") | $(c_cpu "$mode" "$phase") | ${idle:-none} |"
            done
        done
    fi
    if has d; then
        echo
        echo "## d. Memory per cached entry, $(fmt_int "$MEM_KEYS") keys"
        echo
        echo "A fresh instance per target, filled by \`wrk -t2 -c64 -s bench/distinct.lua\` (every request a new key)."
        echo "Memory = Pss after − Pss before (summed over the target's processes, /proc/PID/smaps_rollup) / entries stored."
        echo "One entry is $BODY_BYTES body bytes + ${HEAD_BYTES:-?} bytes of origin response head = ${ENTRY_BYTES:-?} bytes."
        echo "nginx keeps its entries in files (page cache, not in its Pss): its disk use is the next column."
        echo
        echo "| target | entries after the fill | of them filled | Pss before | Pss after | KiB per entry | × (body + head) | disk KiB per entry: du -sb / allocated | fill s |"
        echo "|---|---|---|---|---|---|---|---|---|"
        for t in cg-l1 nginx varnish; do
            [[ -n $(values "$OUT/memory.tsv" entries "$t") ]] || continue
            k=$(values "$OUT/memory.tsv" kib_per_entry "$t")
            echo "| $t | $(fmt_int "$(values "$OUT/memory.tsv" entries "$t")") | $(fmt_int "$(values "$OUT/memory.tsv" filled "$t")") | $(mib "$(values "$OUT/memory.tsv" pss_before_kb "$t")") | $(mib "$(values "$OUT/memory.tsv" pss_after_kb "$t")") | $k | $(r2 "$(q "$k" "$(awk -v b="${ENTRY_BYTES:-0}" 'BEGIN { print b / 1024 }')")") | $(values "$OUT/memory.tsv" disk_kib_per_entry "$t") / $(values "$OUT/memory.tsv" alloc_kib_per_entry "$t") | $(values "$OUT/memory.tsv" fill_s "$t") |"
        done
        echo
        echo "- Each target answered one request (id 0) before the first reading, so its buffers and pools exist; \"of them"
        echo "  filled\" = the entries the fill added, the divisor. The wrk threads stop at their quota, so a few requests more"
        echo "  than $(fmt_int "$MEM_KEYS") may be stored."
        echo "- du -sb counts apparent sizes, the cache's 1:2-level directories included; allocated = du -s -B1 (whole blocks)." 
    fi
    if has e; then
        echo
        echo "## e. Stampede (bench/stampede.sh)"
        echo
        echo "C = $STAMPEDE_C GETs of one cold key released at once over two instances of each target, origin delay"
        echo "$STAMPEDE_DELAY_MS ms, $REPS reps (a fresh key per run). Its own summary: \`${STAMPEDE_DIR#"$ROOT"/}/summary.md\`."
        echo
        echo "| target | origin requests | waiter p99 ms | p99 / origin delay | X-Cache (all reps) |"
        echo "|---|---|---|---|---|"
        for t in nginx2 varnish2 cg2; do
            echo "| $t | $(e_cell origin_cold "$t" 0) | $(e_cell p99_ms "$t" 1) | $(e_ratio_cell "$t") | $(e_values x_cache "$t" | merge_counts) |"
        done
    fi
    if has f; then
        echo
        echo "## f. Plain forward: a POST of $BODY_BYTES bytes"
        echo
        echo "nginx-fwd = nginx \`proxy_pass\` (bench/forward.conf.tmpl: no cache, keep-alive upstream, 2 workers);"
        echo "cg-fwd = cacheguard embedded mode, a write route for POST /items/{id} (no invalidate, stock gate or"
        echo "serialize). Both read the body whole, then forward it to the origin, which answers $BODY_BYTES bytes."
        echo "\`wrk -t2 -c64 -d$DURATION -s bench/post_body.lua\` (origin requests per rep: at least the answers), then"
        echo "\`loadgen rate --post-bytes $BODY_BYTES\` at $(fmt_int "$RATE") req/s as in b."
        echo
        wrk_table "$OUT/forward-throughput.tsv" "$FWD_TARGETS"
        echo
        cpu_table "$OUT/forward-cpu.tsv" "$FWD_TARGETS"
    fi
    if has g; then
        echo
        echo "## g. Context switches per request"
        echo
        echo "voluntary_ctxt_switches + nonvoluntary_ctxt_switches over /proc/PID/task/*/status of every process of"
        echo "the target, read before and after the run, divided by the answers (a thread that exits meanwhile drops"
        echo "out). The $(fmt_int "$RATE") req/s open-loop reading comes from b's and f's runs (their tables, and the summary"
        echo "above); this is the closed-loop one: \`wrk -t1 -c16 -d$DURATION\` (forward targets: the POST body), with CPU"
        echo "per request over the same run."
        echo
        wrk_table "$OUT/ctxsw.tsv" "$G_TARGETS"
    fi
    if has h; then
        echo
        echo "## h. Allocations per hit (counting build)"
        echo
        if [[ -n $H_SKIPPED ]]; then
            echo "Skipped: $H_SKIPPED."
        else
            echo "\`${COUNTED_BIN#"$ROOT"/}\` (cacheguard with a counting global allocator, built from this checkout) as"
            echo "alloc-l1 (embedded, \`l1 = \"all\"\`) and alloc-l2 (shared, \`l1 = \"off\"\`). Per rep: a warm-up run, ${SETTLE_S} s,"
            echo "a reading, $(fmt_int "$ALLOC_N") hits of $KEY (\`loadgen rate\` at $(fmt_int "$RATE") req/s, $RATE_CONNECTIONS new connections), ${SETTLE_S} s,"
            echo "a reading, an idle window as long, a reading. Per request = (batch − idle) / answered; whole process."
            echo
            echo "| target | answered per rep | window s | allocations per hit | bytes per hit | idle window: allocations |"
            echo "|---|---|---|---|---|---|"
            for t in $ALLOC_TARGETS; do
                echo "| $t | $(values "$OUT/alloc.tsv" answered "$t" | paste -sd/) | $(values "$OUT/alloc.tsv" window_s "$t" | paste -sd/) | $(vcell 2 "$OUT/alloc.tsv" allocs_per_req "$t") | $(vcell 0 "$OUT/alloc.tsv" bytes_per_req "$t") | $(values "$OUT/alloc.tsv" idle_allocs "$t" | paste -sd/) |"
            done
        fi
    fi
    if has i; then
        echo
        echo "## i. $(fmt_int "$I_KEYS")-key working set"
        echo
        echo "i-cg = cacheguard embedded, \`l1 = \"all\"\`, \`l1_max_bytes = $I_L1_MAX_BYTES\`; i-nginx = nginx proxy_cache,"
        echo "keys_zone $I_KEYS_ZONE, max_size $I_NGINX_MAX_SIZE, inactive 60m; TTL 3600s. Both filled with ids 1 .. $(fmt_int "$I_KEYS")"
        echo "(\`loadgen list\`, $FILL_CONNECTIONS connections, every id once), then \`wrk -t2 -c64 -d$DURATION -s bench/random_keys.lua\`:"
        echo "GET /items/<id at random in 1 .. $(fmt_int "$I_KEYS")>, the same id sequence for both. Hit share = 1 − origin"
        echo "requests / requests: cacheguard $(r2 "$I_SHARE_CG"), nginx $(r2 "$I_SHARE_NGINX") (clean only at 1.00)."
        echo
        echo "| target | fill: answered | fill: X-Cache | entries after the fill | fill s |"
        echo "|---|---|---|---|---|"
        for t in $I_TARGETS; do
            echo "| $t | $(fmt_int "$(values "$OUT/working-set-fill.tsv" answered "$t")") | $(values "$OUT/working-set-fill.tsv" x_cache "$t") | $(fmt_int "$(values "$OUT/working-set-fill.tsv" entries "$t")") | $(values "$OUT/working-set-fill.tsv" fill_s "$t") |"
        done
        echo
        wrk_table "$OUT/working-set.tsv" "$I_TARGETS"
    fi
    echo
    echo "Raw data: \`${OUT#"$ROOT"/}/\` (throughput.tsv, cpu.tsv, redis.tsv, redis-batches.tsv, memory.tsv, stampede.tsv, forward-throughput.tsv, forward-cpu.tsv, ctxsw.tsv, alloc.tsv, working-set.tsv, working-set-fill.tsv; wrk, loadgen, MONITOR, INFO and /metrics outputs under a/ .. i/; configs and logs)."
} >"$OUT/summary.md"

show_summary
