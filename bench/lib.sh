# shellcheck shell=bash
# Helpers for the bench/ scripts: tool checks, ports, process bookkeeping (every process we
# start is recorded by PID and stopped on EXIT), template rendering, wrk output parsing and
# small statistics. Source it; it does not run anything by itself.

BENCH_PIDS=()          # every background process started through start_bg / our own loops
BENCH_TMP=""           # scratch dir (nginx prefixes, configs); removed on exit

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() {
    printf '\nFATAL: %s\n' "$*" >&2
    exit 1
}

# --- cleanup ---------------------------------------------------------------------------

# Stop every process we started, by PID: TERM, wait up to 5 s, then KILL.
bench_cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    local pid
    for pid in "${BENCH_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    local deadline=$((SECONDS + 5))
    for pid in "${BENCH_PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "PID $pid did not stop after TERM; sending KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    if [[ -n "$BENCH_TMP" && -d "$BENCH_TMP" && -z "${KEEP_TMP:-}" ]]; then
        rm -rf "$BENCH_TMP"
    fi
    exit "$rc"
}

bench_init() {
    BENCH_TMP=$(mktemp -d /tmp/cacheguard-bench.XXXXXX)
    trap bench_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# start_bg LOGFILE CMD...: run CMD in the background, record its PID in BENCH_PIDS and in
# the global LAST_PID.
start_bg() {
    local logfile=$1
    shift
    "$@" >"$logfile" 2>&1 &
    LAST_PID=$!
    BENCH_PIDS+=("$LAST_PID")
}

# forget_pid PID: drop a reaped PID from BENCH_PIDS, so cleanup never signals a reused PID.
forget_pid() {
    local keep=() p
    for p in "${BENCH_PIDS[@]}"; do
        [[ $p == "$1" ]] || keep+=("$p")
    done
    BENCH_PIDS=("${keep[@]}")
}

# stop_pid PID: stop one process we started (TERM, then KILL after 5 s) and reap it.
stop_pid() {
    local pid=$1 deadline=$((SECONDS + 5))
    if kill -TERM "$pid" 2>/dev/null; then
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    forget_pid "$pid"
}

# --- tools and ports -------------------------------------------------------------------

# ensure_apt_tools TOOL:PACKAGE...: install missing Debian packages (apt-get update first).
ensure_apt_tools() {
    local missing=() spec
    for spec in "$@"; do
        command -v "${spec%%:*}" >/dev/null 2>&1 || missing+=("${spec#*:}")
    done
    ((${#missing[@]} == 0)) && return 0
    log "missing tools; installing Debian packages: ${missing[*]}"
    [[ $EUID -eq 0 ]] || die "need root to apt-get install ${missing[*]} (or install them yourself)"
    command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} yourself"
    DEBIAN_FRONTEND=noninteractive apt-get update -q || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" ||
        die "apt-get install ${missing[*]} failed"
    for spec in "$@"; do
        command -v "${spec%%:*}" >/dev/null 2>&1 || die "${spec%%:*} still missing after apt-get install"
    done
}

require_tools() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null 2>&1 || die "required tool '$t' not found in PATH"
    done
}

# port_in_use PORT: true when something listens on 127.0.0.1:PORT (or any address).
port_in_use() {
    local port=$1
    if command -v ss >/dev/null 2>&1; then
        [[ -n "$(ss -Hltn "sport = :$port" 2>/dev/null)" ]]
    else
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
    fi
}

require_free_ports() {
    local p
    for p in "$@"; do
        port_in_use "$p" && die "port $p is already in use (set BASE_PORT to move every bench port)"
    done
    return 0
}

# wait_http URL PID NAME: wait up to 15 s for URL to answer; fail if PID died.
wait_http() {
    local url=$1 pid=$2 name=$3 deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || die "$name (PID $pid) exited during start-up; see its log"
        curl -s -o /dev/null --max-time 1 "$url" && return 0
        sleep 0.1
    done
    die "$name did not answer $url within 15 s"
}

# --- builds and limits -----------------------------------------------------------------

# raise_fd_limit: ask for FD_WANTED (65536) open files. A container without CAP_SYS_RESOURCE
# cannot raise the hard limit, so fall back to the hard limit. Sets FD_LIMIT (a number or
# "unlimited"); each script checks it against what its load needs.
FD_WANTED=65536
# shellcheck disable=SC2034 # the variables it sets are for the calling script
raise_fd_limit() {
    if ! ulimit -n "$FD_WANTED" 2>/dev/null; then
        ulimit -n "$(ulimit -Hn)"
        log "ulimit -n $FD_WANTED refused (hard limit $(ulimit -Hn)); using $(ulimit -n)"
    fi
    FD_LIMIT=$(ulimit -n)
}

# build_bench_tools: release build of bench/tools into TOOLS_TARGET (default
# bench/results/tools-target). Sets ORIGIN_BIN and LOADGEN_BIN.
# shellcheck disable=SC2034 # the variables it sets are for the calling script
build_bench_tools() {
    TOOLS_TARGET=${TOOLS_TARGET:-$ROOT/bench/results/tools-target}
    log "cargo build --release --manifest-path bench/tools/Cargo.toml (target dir $TOOLS_TARGET)"
    CARGO_TARGET_DIR=$TOOLS_TARGET cargo build --release --manifest-path bench/tools/Cargo.toml >&2 ||
        die "building bench/tools failed"
    ORIGIN_BIN=$TOOLS_TARGET/release/bench-origin
    LOADGEN_BIN=$TOOLS_TARGET/release/loadgen
}

# build_cacheguard: sets CG_BIN to CACHEGUARD_BIN when that is set (no build), otherwise to a
# fresh `cargo build --release` of the cacheguard binary.
build_cacheguard() {
    if [[ -n "${CACHEGUARD_BIN:-}" ]]; then
        CG_BIN=$CACHEGUARD_BIN
        log "using CACHEGUARD_BIN=$CG_BIN (no build)"
    else
        log "cargo build --release"
        cargo build --release --bin cacheguard >&2 || die "cargo build --release failed"
        CG_BIN=$ROOT/target/release/cacheguard
    fi
    [[ -x $CG_BIN ]] || die "cacheguard binary not found at $CG_BIN"
}

# --- templates -------------------------------------------------------------------------

# render_template TEMPLATE OUT KEY=VALUE...: replace @KEY@ with VALUE (no sed escaping games:
# done in awk with plain string search, so VALUE may hold / & and quotes).
render_template() {
    local tmpl=$1 out=$2
    shift 2
    awk -v pairs="$(printf '%s\n' "$@")" '
        BEGIN {
            n = split(pairs, lines, "\n")
            for (i = 1; i <= n; i++) {
                if (lines[i] == "") continue
                eq = index(lines[i], "=")
                keys[++k] = "@" substr(lines[i], 1, eq - 1) "@"
                vals[k] = substr(lines[i], eq + 1)
            }
        }
        {
            line = $0
            for (j = 1; j <= k; j++) {
                out = ""
                while ((p = index(line, keys[j])) > 0) {
                    out = out substr(line, 1, p - 1) vals[j]
                    line = substr(line, p + length(keys[j]))
                }
                line = out line
            }
            print line
        }' "$tmpl" >"$out"
    local left
    left=$(grep -v '^[[:space:]]*#' "$out" | grep -o '@[A-Z_]*@' | sort -u | tr '\n' ' ' || true)
    [[ -z $left ]] || die "unfilled placeholder in $out: $left"
}

# static_body N: a JSON object of exactly N bytes, safe inside nginx single quotes
# (no quote, backslash or $).
static_body() {
    local n=$1 head='{"id":1,"name":"bench item","payload":"' tail='"}'
    local pad=$((n - ${#head} - ${#tail}))
    ((pad > 0)) || die "static_body: $n bytes is too small"
    printf '%s%s%s' "$head" "$(head -c "$pad" /dev/zero | tr '\0' 'x')" "$tail"
}

# start_nginx NAME TEMPLATE KEY=VALUE...: render TEMPLATE into $BENCH_TMP/nginx-NAME and run
# nginx in the foreground (daemon off) from that prefix. Sets LAST_PID.
start_nginx() {
    local name=$1 tmpl=$2
    shift 2
    local prefix="$BENCH_TMP/nginx-$name"
    mkdir -p "$prefix"/tmp/{body,proxy,fastcgi,uwsgi,scgi} "$prefix/cache" "$prefix/logs"
    render_template "$tmpl" "$prefix/nginx.conf" PREFIX="$prefix" USER="$(id -un)" "$@"
    nginx -t -q -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log" ||
        die "nginx -t failed for $name ($prefix/nginx.conf)"
    start_bg "$prefix/stdout.log" nginx -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log"
}

# --- wrk output ------------------------------------------------------------------------

# wrk_parse FILE: prints "rps p50_ms p99_ms max_ms requests errors non2xx" for a wrk
# --latency output file.
wrk_parse() {
    awk '
        function ms(v) {
            if (v ~ /us$/) { sub(/us$/, "", v); return v / 1000 }
            if (v ~ /ms$/) { sub(/ms$/, "", v); return v + 0 }
            if (v ~ /m$/)  { sub(/m$/, "", v);  return v * 60000 }
            if (v ~ /s$/)  { sub(/s$/, "", v);  return v * 1000 }
            return v + 0
        }
        /^ +Latency +[0-9]/ { max = ms($4) }
        /^ +50%/ { p50 = ms($2) }
        /^ +99%/ { p99 = ms($2) }
        /requests in/ { reqs = $1 }
        /^Requests\/sec:/ { rps = $2 }
        /Socket errors:/ {
            gsub(/,/, "")
            errs = $4 + $6 + $8 + $10
        }
        /Non-2xx or 3xx responses:/ { non2xx = $5 }
        END {
            if (rps == "" || p99 == "") exit 1
            printf "%.2f %.3f %.3f %.3f %d %d %d\n", rps, p50, p99, max, reqs, errs + 0, non2xx + 0
        }' "$1"
}

# --- run environment -------------------------------------------------------------------

# env_machine: the machine lines every env.txt starts with (STAMP must be set).
env_machine() {
    echo "date_utc: $STAMP"
    echo "nproc: $(nproc)"
    echo "mem_total: $(awk '/^MemTotal:/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
    echo "uname: $(uname -srm)"
    echo "cpu: $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)"
    echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
}

# env_build: the build lines of env.txt: rustc, the cacheguard binary (CG_BIN) and the git
# commit (flagged when src/ has uncommitted changes).
env_build() {
    echo "rustc: $(rustc -V 2>/dev/null || echo unknown)"
    echo "cacheguard: $("$CG_BIN" --version 2>/dev/null || echo unknown) ($CG_BIN)"
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$ROOT" diff --quiet HEAD -- src 2>/dev/null || echo ' (src/ has uncommitted changes)')"
}

# --- statistics --------------------------------------------------------------------------

# stats V...: prints "median min max" (median of an even count = mean of the middle two).
stats() {
    printf '%s\n' "$@" | sort -g | awk '
        { v[NR] = $1 }
        END {
            if (NR == 0) { print "nan nan nan"; exit }
            med = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
            printf "%s %s %s\n", med, v[1], v[NR]
        }'
}

# fmt_int N: 118327.4 -> 118,327
fmt_int() {
    LC_ALL=C awk -v n="$1" 'BEGIN {
        s = sprintf("%.0f", n); out = ""
        while (length(s) > 3) { out = "," substr(s, length(s) - 2) out; s = substr(s, 1, length(s) - 3) }
        print s out
    }'
}

# cell KIND V...: "median (min–max)" formatted as req/s (KIND=int) or ms (KIND=ms).
cell() {
    local kind=$1
    shift
    local med min max
    read -r med min max < <(stats "$@")
    if [[ $kind == int ]]; then
        printf '%s (%s–%s)' "$(fmt_int "$med")" "$(fmt_int "$min")" "$(fmt_int "$max")"
    else
        LC_ALL=C printf '%.3f (%.3f–%.3f)' "$med" "$min" "$max"
    fi
}

median() { stats "$@" | awk '{ print $1 }'; }

# --- process memory --------------------------------------------------------------------

# proc_kb PID FIELD: a /proc/PID/status field (VmRSS, VmHWM) in kB.
proc_kb() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status" 2>/dev/null; }

# x-cache URL: the X-Cache header of one GET.
x_cache() {
    curl -s -o /dev/null -D - --max-time 5 "$1" | tr -d '\r' |
        awk -F': ' 'tolower($1) == "x-cache" { print $2 }'
}

# warm URL EXPECT...: GET URL until X-Cache is one of EXPECT (up to 50 tries).
warm() {
    local url=$1 got i e
    shift
    for ((i = 0; i < 50; i++)); do
        got=$(x_cache "$url")
        for e in "$@"; do
            [[ $got == "$e" ]] && return 0
        done
        sleep 0.1
    done
    die "warming $url: X-Cache stayed '$got' (wanted one of: $*)"
}

# --- additions for bench/stampede.sh ---------------------------------------------------

# cell_dec DECIMALS V...: "median (min–max)" with DECIMALS decimals; a lone value when all
# values are equal.
cell_dec() {
    local dec=$1
    shift
    local med min max
    read -r med min max < <(stats "$@")
    if [[ $med == nan ]]; then
        printf '–'
    elif LC_ALL=C awk -v a="$min" -v b="$max" 'BEGIN { exit !(a == b) }'; then
        LC_ALL=C printf "%.${dec}f" "$med"
    else
        LC_ALL=C printf "%.${dec}f (%.${dec}f–%.${dec}f)" "$med" "$min" "$max"
    fi
}

# start_varnish NAME PORT TEMPLATE KEY=VALUE...: render the VCL TEMPLATE into
# $BENCH_TMP/varnish-NAME and run varnishd in the foreground (-F) with its own working dir
# (-n), no jail, no management port, malloc storage. Sets LAST_PID
# (the manager; TERM to it stops the cache child too).
start_varnish() {
    local name=$1 port=$2 tmpl=$3
    shift 3
    local dir="$BENCH_TMP/varnish-$name"
    mkdir -p "$dir"
    render_template "$tmpl" "$dir/default.vcl" "$@"
    start_bg "$dir/varnishd.log" varnishd -F -j none -n "$dir/n" -a "127.0.0.1:$port" -T none \
        -f "$dir/default.vcl" -s malloc,256m
}

# start_redis NAME PORT: a throwaway redis-server on 127.0.0.1:PORT, no persistence. Waits
# until it answers PING. Sets LAST_PID.
start_redis() {
    local name=$1 port=$2 dir="$BENCH_TMP/redis-$1" deadline
    mkdir -p "$dir"
    start_bg "$dir/redis.log" redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" \
        --save "" --appendonly no --daemonize no
    local pid=$LAST_PID
    deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || die "redis-server ($name, PID $pid) exited; see $dir/redis.log"
        [[ $(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null) == PONG ]] && return 0
        sleep 0.1
    done
    die "redis-server ($name) did not answer PING on port $port within 15 s"
}
