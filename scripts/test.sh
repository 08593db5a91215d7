#!/usr/bin/env bash
# The one test command: installs what the tests need, then runs every quality gate and the
# whole test suite. `.ci/run` calls exactly this.
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
# redis-cli builds and reshards the test clusters (tests/cluster.rs); openssl makes the
# certificates of the TLS test (tests/redis_tls.rs).
for tool in redis-cli:redis-tools openssl:openssl; do
    if ! command -v "${tool%%:*}" >/dev/null 2>&1; then
        echo "== installing ${tool#*:}"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${tool#*:}" >/dev/null
    fi
done

# Real Prometheus and promtool for tests/dashboards.rs (every dashboard panel and alert
# expression in dashboards/ is evaluated by a real Prometheus).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "== installing prometheus"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq prometheus >/dev/null
fi
# Likewise the prometheus package may start a system instance on 9090; the test runs its own
# on a free loopback port.

# A one-shot build gains nothing from incremental compilation, which would add several GB of
# state to the target directory. A developer who wants it back can export CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The build needs about 3 GB of free disk from empty; say up front how much there is, so that a
# full disk is recognised as such rather than as a compiler failure.
target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
echo "== disk free where the build goes ($target_dir): $(df -h --output=avail "$target_dir" | tail -1 | tr -d ' ')"

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --all-targets --locked

echo "== container config check (config/docker.toml, the image's default config)"
cargo run --locked --quiet --bin cacheguard -- --check-config config/docker.toml

echo "== demo smoke run"
cargo run --locked --example demo -- --exit
