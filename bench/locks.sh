#!/usr/bin/env bash
# Lock services benchmark, in one run on this machine: what a serialized write costs on each
# lock backend, next to the shared Redis's lock (the default).
#
#   origin   nginx answering PUT /items/... with 200 at once (bench/origin.conf.tmpl)
#   Redis    one redis-server: the shared Redis of every instance (L2, events) and the
#            default lock; the other backends change only the route's `serialize.lock`
#   mysql    MariaDB (Debian's mariadb-server), a data directory made here, a lock table
#            created by cacheguard at start
#   redlock  three more redis-servers, independent masters
#   etcd     one etcd member (Debian's etcd-server), its data directory made here
#   zookeeper  one standalone ZooKeeper (Debian's zookeeper on its JRE), data made here
#   cacheguard  release build; per backend, two instances (shared mode) whose route
#            `PUT /items/s/{id}` is serialized (`serialize.lock` = the backend), and
#            `PUT /items/p/{id}` is not
#   load     wrk (bench/locks: PUT with a small JSON body)
#
# Two numbers per backend, REPS rounds, the backends interleaved within each round:
#
#   handoffs/s   both instances loaded at once on ONE resource (`wrk -t1 -c4` each, same
#                path): every answered write is one grant, so the sum of the two rates is
#                the rate at which the lock changes hands (within an instance the local
#                queue hands over; between instances the backend does: the Redis lock wakes
#                waiters by event, etcd by a watch on the key, ZooKeeper by a watch on the
#                predecessor's node, MySQL and Redlock waiters poll)
#   overhead     one instance, one connection, a new resource per write (`wrk -t1 -c1`):
#                p50 of a serialized write minus p50 of the same write unserialized
#
# usage: bash bench/locks.sh
# env:   REPS=3 DURATION=8 BASE_PORT=29400 (uses BASE_PORT+1 .. +15)
#        BACKENDS="redis mysql redlock etcd zookeeper"
#        CACHEGUARD_BIN=path (skip `cargo build --release` and use this binary)
#        KEEP_TMP=1 (keep the scratch dir)
#
# Writes bench/results/locks-<UTC timestamp>/ (wrk outputs, cacheguard logs, raw.tsv,
# summary.md) and prints the markdown summary on stdout. Every process it starts is stopped
# on exit, by PID.

set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bench_defaults REPS=3 DURATION=8 BASE_PORT=29400 BACKENDS="redis mysql redlock etcd zookeeper"
require_positive REPS DURATION
bench_init
require_tools nginx wrk redis-server redis-cli curl
[[ -x /usr/sbin/mariadbd && -x /usr/bin/mariadb-install-db ]] ||
    die "MariaDB is not installed (apt-get install mariadb-server, as scripts/test.sh does)"
if [[ ! -x /usr/bin/etcd || ! -f /usr/share/java/zookeeper.jar ]] || ! command -v java >/dev/null; then
    die "etcd or ZooKeeper is not installed (apt-get install etcd-server zookeeper default-jre-headless, as scripts/test.sh does)"
fi
build_cacheguard
raise_fd_limit

OUT=${RESULTS_DIR:-$ROOT/bench/results/locks-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
bench_ports ORIGIN_PORT REDIS_PORT MYSQL_PORT RL1 RL2 RL3 CG1 CG1_ADMIN CG2 CG2_ADMIN - - \
    ETCD_PORT ETCD_PEER_PORT ZK_PORT
require_free_ports "${BENCH_PORTS[@]}"

# --- servers -----------------------------------------------------------------------------

start_nginx origin bench/origin.conf.tmpl WORKERS=1 PORT="$ORIGIN_PORT" STATIC_BODY='{"ok":true}'
wait_http "http://127.0.0.1:$ORIGIN_PORT/items/1" "$LAST_PID" "nginx origin"
start_redis shared "$REDIS_PORT"
for port in $RL1 $RL2 $RL3; do
    start_redis "master-$port" "$port"
done

# start_mariadb: a data directory in BENCH_TMP, mariadbd on MYSQL_PORT, the database `locks`
# and the user `cacheguard` (every right on it).
start_mariadb() {
    local dir=$BENCH_TMP/mariadb deadline user=()
    [[ $(id -u) == 0 ]] && user=(--user=root)
    mkdir -p "$dir"
    mariadb-install-db --no-defaults --datadir="$dir/data" --auth-root-authentication-method=normal \
        --skip-test-db "${user[@]}" >"$dir/install.log" 2>&1 || die "mariadb-install-db failed; see $dir/install.log"
    start_bg "$dir/stdout.log" /usr/sbin/mariadbd --no-defaults "${user[@]}" --datadir="$dir/data" \
        --port="$MYSQL_PORT" --bind-address=127.0.0.1 --socket="$dir/sock" --pid-file="$dir/pid" \
        --log-error="$dir/error.log" --skip-name-resolve
    deadline=$((SECONDS + 30))
    until mariadb --no-defaults -h127.0.0.1 -P"$MYSQL_PORT" -uroot -e 'SELECT 1' >/dev/null 2>&1; do
        kill -0 "$LAST_PID" 2>/dev/null || die "mariadbd exited; see $dir/error.log"
        ((SECONDS < deadline)) || die "mariadbd did not answer within 30 s"
        sleep 0.2
    done
    mariadb --no-defaults -h127.0.0.1 -P"$MYSQL_PORT" -uroot -e "CREATE DATABASE locks;
        CREATE USER 'cacheguard'@'%' IDENTIFIED BY 'bench'; GRANT ALL ON locks.* TO 'cacheguard'@'%';"
}
start_mariadb
MARIADB_VERSION=$(/usr/sbin/mariadbd --version | awk '{print $3}')

# start_etcd: one member on ETCD_PORT, its data in BENCH_TMP.
start_etcd() {
    local dir=$BENCH_TMP/etcd deadline
    mkdir -p "$dir"
    start_bg "$dir/etcd.log" /usr/bin/etcd --name bench --data-dir "$dir/data" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "bench=http://127.0.0.1:$ETCD_PEER_PORT"
    deadline=$((SECONDS + 30))
    until curl -fsS "http://127.0.0.1:$ETCD_PORT/health" >/dev/null 2>&1; do
        kill -0 "$LAST_PID" 2>/dev/null || die "etcd exited; see $dir/etcd.log"
        ((SECONDS < deadline)) || die "etcd did not answer within 30 s"
        sleep 0.2
    done
}
start_etcd
ETCD_VERSION=$(/usr/bin/etcd --version | awk '/etcd Version/ {print $3}')

# zk_ruok: whether ZooKeeper on ZK_PORT answers its `ruok` command.
zk_ruok() {
    local answer=""
    exec 3<>"/dev/tcp/127.0.0.1/$ZK_PORT" 2>/dev/null || return 1
    printf ruok >&3
    read -r -t 2 answer <&3 || true
    exec 3<&-
    [[ $answer == imok ]]
}

# start_zookeeper: a standalone server on ZK_PORT, its data in BENCH_TMP.
start_zookeeper() {
    local dir=$BENCH_TMP/zookeeper deadline
    mkdir -p "$dir/data"
    printf 'tickTime=500\ndataDir=%s\nclientPort=%s\nclientPortAddress=127.0.0.1\nadmin.enableServer=false\nmaxClientCnxns=0\n4lw.commands.whitelist=ruok\n' \
        "$dir/data" "$ZK_PORT" >"$dir/zoo.cfg"
    start_bg "$dir/zookeeper.log" java -Xms32m -Xmx256m -XX:+UseSerialGC \
        -Dzookeeper.admin.enableServer=false -cp /usr/share/java/zookeeper.jar \
        org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg"
    deadline=$((SECONDS + 60))
    until zk_ruok; do
        kill -0 "$LAST_PID" 2>/dev/null || die "zookeeper exited; see $dir/zookeeper.log"
        ((SECONDS < deadline)) || die "zookeeper did not answer within 60 s"
        sleep 0.3
    done
}
start_zookeeper

# --- cacheguard ----------------------------------------------------------------------------

# config BACKEND PORT ADMIN: the TOML of one instance serializing on BACKEND.
config() {
    local backend=$1 port=$2 admin=$3 lock=""
    case $backend in
    mysql) lock=", lock = \"db\"" ;;
    redlock) lock=", lock = \"rl\"" ;;
    etcd) lock=", lock = \"etcd\"" ;;
    zookeeper) lock=", lock = \"zk\"" ;;
    esac
    cat <<EOF
[server]
listen = "127.0.0.1:$port"
[upstream]
url = "http://127.0.0.1:$ORIGIN_PORT"
max_concurrency = 1024
[admin]
listen = "127.0.0.1:$admin"
[redis]
url = "redis://127.0.0.1:$REDIS_PORT"
[journal]
path = "$BENCH_TMP/journal-$backend-$port"
[locks.db]
backend = "mysql"
url = "mysql://cacheguard:bench@127.0.0.1:$MYSQL_PORT/locks"
[locks.rl]
backend = "redlock"
urls = ["redis://127.0.0.1:$RL1", "redis://127.0.0.1:$RL2", "redis://127.0.0.1:$RL3"]
[locks.etcd]
backend = "etcd"
endpoints = ["http://127.0.0.1:$ETCD_PORT"]
[locks.zk]
backend = "zookeeper"
connect = "127.0.0.1:$ZK_PORT"

[[routes]]
name = "serialized"
match = "/items/s/{id}"
methods = ["PUT"]
serialize = { key = "/items/s/{id}", fence_header = "fencing-token"$lock }

[[routes]]
name = "plain"
match = "/items/p/{id}"
methods = ["PUT"]
EOF
}

# start_pair BACKEND: two instances serializing on BACKEND (cg-a, cg-b).
start_pair() {
    local backend=$1
    config "$backend" "$CG1" "$CG1_ADMIN" >"$OUT/cg-$backend-a.toml"
    config "$backend" "$CG2" "$CG2_ADMIN" >"$OUT/cg-$backend-b.toml"
    launch_cacheguard cg-a "$OUT/cg-$backend-a.toml" "$CG1" "$CG1_ADMIN" "$OUT/cg-$backend-a.log"
    launch_cacheguard cg-b "$OUT/cg-$backend-b.toml" "$CG2" "$CG2_ADMIN" "$OUT/cg-$backend-b.log"
    wait_bus "cg-a" "${ADMIN_OF[cg-a]}" "$BENCH_TMP/bus-a"
    wait_bus "cg-b" "${ADMIN_OF[cg-b]}" "$BENCH_TMP/bus-b"
}

stop_pair() {
    stop_pid "${PID_OF[cg-a]}"
    stop_pid "${PID_OF[cg-b]}"
}

# --- load ----------------------------------------------------------------------------------

cat >"$BENCH_TMP/put.lua" <<'EOF'
-- PUT with a small JSON body to the URL's path (one resource).
wrk.method = "PUT"
wrk.body = '{"v":1}'
wrk.headers["Content-Type"] = "application/json"
EOF
cat >"$BENCH_TMP/put_distinct.lua" <<'EOF'
-- PUT to a new resource each time: <url path><thread>-<n>.
wrk.method = "PUT"
wrk.body = '{"v":1}'
wrk.headers["Content-Type"] = "application/json"
local prefix, n = nil, 0
function setup(thread) thread:set("tid", tostring(math.random(1, 1e9))) end
function init() prefix = wrk.path .. tid .. "-" end
function request() n = n + 1; return wrk.format(nil, prefix .. n) end
EOF

# handoffs BACKEND REP: both instances on one resource at once; prints "rps non2xx".
handoffs() {
    local backend=$1 rep=$2 pa pb
    local path="/items/s/h$rep-$backend"
    wrk_start "$OUT/handoff-$backend-$rep-a.txt" -t1 -c4 -d"${DURATION}s" --latency \
        -s "$BENCH_TMP/put.lua" "${URL_OF[cg-a]}$path"
    pa=$LAST_PID
    wrk_start "$OUT/handoff-$backend-$rep-b.txt" -t1 -c4 -d"${DURATION}s" --latency \
        -s "$BENCH_TMP/put.lua" "${URL_OF[cg-b]}$path"
    pb=$LAST_PID
    wrk_finish "$OUT/handoff-$backend-$rep-a.txt" "$pa" "handoffs $backend a"
    wrk_finish "$OUT/handoff-$backend-$rep-b.txt" "$pb" "handoffs $backend b"
    local a b
    a=$(wrk_parse "$OUT/handoff-$backend-$rep-a.txt")
    b=$(wrk_parse "$OUT/handoff-$backend-$rep-b.txt")
    awk -v a="$a" -v b="$b" 'BEGIN { split(a, x, " "); split(b, y, " ");
        printf "%.1f %d\n", x[1] + y[1], x[7] + y[7] }'
}

# latency BACKEND REP KIND(s|p): one connection, a new resource per write; prints "p50 p99".
latency() {
    local backend=$1 rep=$2 kind=$3 file
    file="$OUT/latency-$backend-$rep-$kind.txt"
    wrk_once "$file" "latency $backend $kind" -t1 -c1 -d"${DURATION}s" --latency \
        -s "$BENCH_TMP/put_distinct.lua" "${URL_OF[cg-a]}/items/$kind/r$rep-"
    wrk_parse "$file" | awk '{ printf "%.3f %.3f %d\n", $2, $3, $7 }'
}

printf 'rep\tbackend\thandoffs_per_s\thandoff_non2xx\tser_p50_ms\tser_p99_ms\tplain_p50_ms\tplain_p99_ms\toverhead_p50_ms\n' >"$OUT/raw.tsv"
for rep in $(seq 1 "$REPS"); do
    for backend in $BACKENDS; do
        log "rep $rep: $backend"
        start_pair "$backend"
        read -r rps non2xx < <(handoffs "$backend" "$rep")
        read -r sp50 sp99 _ < <(latency "$backend" "$rep" s)
        read -r pp50 pp99 _ < <(latency "$backend" "$rep" p)
        stop_pair
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$backend" "$rps" "$non2xx" \
            "$sp50" "$sp99" "$pp50" "$pp99" "$(awk -v s="$sp50" -v p="$pp50" 'BEGIN { printf "%.3f", s - p }')" \
            >>"$OUT/raw.tsv"
    done
done

# --- summary -------------------------------------------------------------------------------

# spread: "median (min–max)" of the numbers on stdin.
spread() {
    sort -n | awk '{ v[NR] = $1 } END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        if (NR == 1) print m; else printf "%s (%s–%s)\n", m, v[1], v[NR] }'
}
{
    echo "## Lock services: handoffs on one resource and uncontended write overhead"
    echo
    echo "$(date -u +%Y-%m-%d), $(nproc) cores, cacheguard release build, shared mode (one redis-server),"
    echo "nginx origin answering at once, MariaDB $MARIADB_VERSION, Redlock over 3 local redis-servers,"
    echo "etcd $ETCD_VERSION (one member), ZooKeeper (standalone, Debian's package);"
    echo "$REPS rounds of ${DURATION} s per measurement, backends interleaved; median (min–max)."
    echo
    echo "| backend | handoffs/s on one resource (2 instances) | non-2xx | serialized write p50 / p99 | unserialized p50 / p99 | overhead (p50) |"
    echo "|---|---:|---:|---:|---:|---:|"
    for backend in $BACKENDS; do
        col() { awk -F'\t' -v b="$backend" -v c="$1" 'NR > 1 && $2 == b { print $c }' "$OUT/raw.tsv" | spread; }
        printf '| %s | %s | %s | %s / %s ms | %s / %s ms | %s ms |\n' "$backend" "$(col 3)" "$(col 4)" \
            "$(col 5)" "$(col 6)" "$(col 7)" "$(col 8)" "$(col 9)"
    done
} >"$OUT/summary.md"
cat "$OUT/summary.md"
log "results in $OUT"
