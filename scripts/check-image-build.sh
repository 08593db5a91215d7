#!/usr/bin/env bash
# Checks that the proxy binary the Dockerfile ships is built without tokio's `test-util`.
#
# Usage: scripts/check-image-build.sh [DOCKERFILE]   (default: the repository's Dockerfile)
#
# Why: tokio's `test-util` (paused time, for the unit tests) is a dev-dependency feature, and
# cargo resolves features once per invocation: a `cargo build` that selects anything built
# with cacheguard's dev-dependencies (an example, `--tests`, `--all-targets`) unifies
# `test-util` into the proxy's tokio, and every `Instant::now()` then takes a mutex. The
# Dockerfile builds the proxy and the demo in one invocation, which is right only because the
# demo is a package of its own (demo/, normal dependencies only): this keeps it so.
#
# How: every `cargo build` of the Dockerfile's RUN instructions is run here with the same
# target selection and `--message-format=json`, and cargo says what it built. For each one
# that builds the `cacheguard` binary, the `features` of tokio's `compiler-artifact` record
# must not contain "test-util". Cargo's own resolution is what is checked, so any way of
# re-unifying the builds (an `--example`, `--all-targets`, `--tests` next to the binary) fails.
# `--release` is dropped: the profile takes no part in feature resolution, and the dev-profile
# units are the ones `cargo run` and `cargo test` have built already (seconds here, where a
# release build takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

dockerfile="${1:-Dockerfile}"
[ -r "$dockerfile" ] || { echo "check-image-build: cannot read $dockerfile" >&2; exit 1; }

# The Dockerfile's instructions, one per line: continuation lines joined, comments dropped.
instructions() {
    sed -e '/^[[:space:]]*#/d' "$dockerfile" | sed -e ':join' -e '/\\$/{N; s/\\\n/ /; b join}'
}

builds=0
proxy_builds=0
failed=0
while IFS= read -r run; do
    # Each command of a RUN instruction (`&&`-separated) that is a `cargo build`.
    while IFS= read -r command; do
        case "$command" in
            *"cargo build"*) ;;
            *) continue ;;
        esac
        read -ra args <<< "${command#*cargo build}"
        selection=()
        for arg in "${args[@]}"; do
            [ "$arg" = "--release" ] || selection+=("$arg")
        done
        builds=$((builds + 1))
        echo "== cargo build ${args[*]} (as the Dockerfile runs it; checked without --release)"
        if ! json="$(cargo build "${selection[@]}" --message-format=json)"; then
            echo "check-image-build: the build failed" >&2
            exit 1
        fi
        artifacts="$(grep '"reason":"compiler-artifact"' <<< "$json" || true)"
        if ! grep -E '"target":\{[^}]*"kind":\["bin"\][^}]*"name":"cacheguard"' <<< "$artifacts" > /dev/null; then
            echo "   does not build the proxy binary"
            continue
        fi
        proxy_builds=$((proxy_builds + 1))
        tokio="$(grep -E '"package_id":"[^"]*#tokio@[^"]*"' <<< "$artifacts" || true)"
        if [ -z "$tokio" ]; then
            echo "check-image-build: no tokio artifact in the proxy's build" >&2
            exit 1
        fi
        features="$(grep -o '"features":\[[^]]*\]' <<< "$tokio" | sort -u)"
        echo "   builds the proxy; its tokio: $features"
        if grep -q '"test-util"' <<< "$features"; then
            echo "check-image-build: $dockerfile builds the proxy with tokio's test-util: build" \
                 "only packages' binaries with it (\`cargo build --release --locked -p cacheguard" \
                 "-p cacheguard-demo\`), no example, test or other dev-dependency target" >&2
            failed=1
        fi
    done < <(sed -e 's/[[:space:]]*&&[[:space:]]*/\n/g' <<< "$run")
done < <(instructions | grep -E '^[[:space:]]*RUN[[:space:]]')

if [ "$builds" = 0 ] || [ "$proxy_builds" = 0 ]; then
    echo "check-image-build: found no cargo build of the proxy binary in $dockerfile" >&2
    exit 1
fi
exit "$failed"
