#!/usr/bin/env bash
# The one test command: installs what the tests need, then runs every quality gate and the
# whole test suite, then builds the container image and runs it (scripts/image-check.sh).
# `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Real Redis for the integration tests (never mocked).
if ! command -v redis-server >/dev/null 2>&1; then
    echo "== installing redis-server"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq redis-server >/dev/null
fi
# The redis-server package may start a system instance on 6379; tests never use it (each
# test starts its own server on a free port), so it is left alone.
# redis-cli builds and reshards the test clusters (tests/it/cluster.rs); openssl makes the
# certificates of the TLS test (tests/it/redis_tls.rs); faketime brings libfaketime, which the
# harness preloads to skew one instance's wall clock (tests/it/flash_sale.rs).
for tool in redis-cli:redis-tools openssl:openssl faketime:faketime; do
    if ! command -v "${tool%%:*}" >/dev/null 2>&1; then
        echo "== installing ${tool#*:}"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${tool#*:}" >/dev/null
    fi
done

# The lock services serialized writes may use instead of Redis, real in their tests
# (src/coord/locks, tests/it/lock_etcd.rs, tests/it/lock_zookeeper.rs): etcd, and ZooKeeper with the
# JRE it runs on. The packages may start system instances on 2379 and 2181; the tests start
# their own on free loopback ports, so those are left alone. protoc builds etcd's gRPC API
# (the etcd-client crate compiles etcd's .proto files).
for tool in etcd:etcd-server /usr/share/java/zookeeper.jar:zookeeper java:default-jre-headless protoc:protobuf-compiler; do
    path="${tool%%:*}"
    if ! { [ -e "$path" ] || command -v "$path" >/dev/null 2>&1; }; then
        echo "== installing ${tool#*:}"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${tool#*:}" >/dev/null
    fi
done

# Real MariaDB for the MySQL lock service's tests (tests/it/common/mariadb.rs starts its own
# servers on free loopback ports, data in temporary directories; a system instance the
# package may start is left alone).
if [ ! -x /usr/sbin/mariadbd ] || [ ! -x /usr/bin/mariadb-install-db ]; then
    echo "== installing mariadb-server"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq mariadb-server >/dev/null
fi

# Real Prometheus and promtool for tests/it/dashboards.rs (every dashboard panel and alert
# expression in dashboards/ is evaluated by a real Prometheus).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "== installing prometheus"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq prometheus >/dev/null
fi
# Likewise the prometheus package may start a system instance on 9090; the test runs its own
# on a free loopback port.

# Node.js for tests/it/cache_tests.rs, which runs the public HTTP-cache test suite (the npm
# package http-cache-tests: its origin server, its client and its scoring are node programs).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "== installing nodejs and npm"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq nodejs npm >/dev/null
fi

# Debian's chromium for tests/it/status_page.rs, which opens the admin listener's status page in
# a headless browser (its script, its charts, JavaScript off, a screenshot).
if ! command -v chromium >/dev/null 2>&1; then
    echo "== installing chromium"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium >/dev/null
fi

# A one-shot build gains nothing from incremental compilation, which would add several GB of
# state to the target directory. A developer who wants it back can export CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The build needs about 3 GB of free disk from empty; say up front how much there is, so that a
# full disk is recognised as such rather than as a compiler failure.
target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
echo "== disk free where the build goes ($target_dir): $(df -h --output=avail "$target_dir" | tail -1 | tr -d ' ')"

# The HTTP-cache test suite, pinned, installed under the target directory (nothing from npm is
# checked in); tests/it/cache_tests.rs looks for it there. Skipped when that version is in place.
cache_tests_version=0.4.5
cache_tests_prefix="$target_dir/cache-tests"
cache_tests_package="$cache_tests_prefix/node_modules/http-cache-tests"
installed="$(node -p 'require(process.argv[1]).version' "$(realpath -m "$cache_tests_package")/package.json" 2>/dev/null || true)"
if [ "$installed" != "$cache_tests_version" ] || [ ! -d "$cache_tests_prefix/node_modules/node-fetch" ]; then
    echo "== installing http-cache-tests@$cache_tests_version into $cache_tests_prefix"
    mkdir -p "$cache_tests_prefix"
    npm install --prefix "$cache_tests_prefix" --omit=dev --no-audit --no-fund --loglevel=error \
        "http-cache-tests@$cache_tests_version"
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --workspace --all-targets -- -D warnings"
# --workspace: the demo (demo/) too; plain cargo commands mean the cacheguard package only.
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== cargo test"
# A test that fails is run once more on its own, and the command fails only if it fails
# again: a few wall-clock tests (fault injection, latency bounds) can miss their bounds when
# another heavy test shares the 2 cores with them. Each one rerun is named here, so a flaky
# test is seen, not hidden; a build error, a crash or a second failure still fails the command.
test_log="$target_dir/cargo-test.log"
if ! cargo test --all-targets --locked --no-fail-fast 2>&1 | tee "$test_log"; then
    # A test run in a process of its own fails there and in its caller: once each.
    failed="$(sed -n -E 's/^test (.*) \.\.\. FAILED$/\1/p' "$test_log" | sort -u)"
    if [ -z "$failed" ]; then
        echo "cargo test failed without a failed test to rerun (build error or crash)" >&2
        exit 1
    fi
    for name in $failed; do
        echo "== rerunning once, alone: $name"
        cargo test --all-targets --locked -- --exact "$name"
    done
    echo "== passed on their rerun (flaky under load): $(echo "$failed" | tr '\n' ' ')"
fi

echo "== demo smoke run"
cargo run --locked -p cacheguard-demo -- --exit

echo "== image build check (the Dockerfile's proxy binary gets no tokio test-util)"
# It builds what the Dockerfile builds (the proxy and the demo, in one invocation), in the dev
# profile: after the demo's run above, that is the proxy binary alone.
scripts/check-image-build.sh

echo "== container config check (config/docker.toml, the image's default config)"
# The image listens for admin on 0.0.0.0, so it is run with CACHEGUARD_ADMIN_TOKEN (the
# compose file always sets one); without a token the config is refused, by design. The
# binary is the one the image build check has just built, with the features the image's
# build resolves (a `cargo run --bin cacheguard` would resolve them for the proxy alone and
# compile cacheguard once more).
proxy="$target_dir/debug/cacheguard"
CACHEGUARD_ADMIN_TOKEN=check-only-token "$proxy" --check-config config/docker.toml
if env -u CACHEGUARD_ADMIN_TOKEN "$proxy" --check-config config/docker.toml 2>/dev/null; then
    echo "config/docker.toml was accepted without an admin token" >&2
    exit 1
fi

echo "== image check (the image built from the Dockerfile and run: alone, in the compose stack, as the Kubernetes example's Pod)"
# Podman and stand-ins for the base images where no Docker daemon and no registry are there
# (scripts/image-check.sh says which); a release build in a container, several minutes the
# first time on 2 cores, seconds when only the runtime stage changed.
scripts/image-check.sh
