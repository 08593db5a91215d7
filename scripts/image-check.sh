#!/usr/bin/env bash
# Builds the container image from the repository's Dockerfile, unmodified, and runs it the way
# README tells users to: the image alone, the compose stack, and the Kubernetes example's
# config. Run by the test command (scripts/test.sh) after the tests; fails on the first thing
# that does not work as documented.
#
# Usage: scripts/image-check.sh
#
# Engine: docker where a Docker daemon answers (`docker info`), else podman (Debian's podman,
# runc and mmdebstrap are installed when missing). With podman every container runs with
# runc (crun refuses hybrid cgroups) and with open-files and processes limits of 1024 (the
# defaults are above what a sandbox may grant); both are set in a containers.conf of this
# run's own (CONTAINERS_CONF), so podman-compose gets them too.
#
# Base images: used as they are when present, pulled when they can be. Where the registry
# cannot be reached, stand-ins are made under the same names from Debian's own packages:
#   debian:<DEBIAN_RELEASE>-slim    `mmdebstrap --variant=minbase`, with slim's dpkg excludes;
#   rust:<RUST_VERSION>-<release>   that, plus gcc, libc6-dev, pkg-config and ca-certificates,
#                                   the toolchain the tests use (this machine's, copied in, not
#                                   downloaded; it must be RUST_VERSION), cargo on PATH and
#                                   CARGO_HOME=/usr/local/cargo as in the official image, and
#                                   this Cargo.lock's crates vendored into the image (source
#                                   replacement in $CARGO_HOME/config.toml), so that the build's
#                                   `cargo build --locked` downloads nothing;
#   redis:7                         redis-server (Debian's 7.0), protected mode off as in the
#                                   official image;
#   prom/prometheus:<version>       Debian's prometheus (2.x; the alert rules are checked
#                                   against it by the tests too), busybox-like wget for the
#                                   compose healthcheck.
# Grafana has no Debian package: without its image it is left out of the compose run (said
# so on the way). Stand-ins carry the label io.cacheguard.stand-in.
#
# What is checked (each a failure of the test command):
#   - the image builds; the shipped proxy binary has no tokio `test-util` (the string of
#     `time::pause()`'s refusal, linked only with that feature, is absent from the image's
#     proxy and present in cacheguard's unit-test binary, which `cargo test` builds with it
#     and which pauses time: the control shows the probe still works);
#   - `--check-config` of the shipped config: accepted with CACHEGUARD_ADMIN_TOKEN, refused
#     (naming admin.token) without;
#   - the image's own entrypoint and command, as its own user (uid 10001, not root), on the
#     host network with a real redis-server and the demo API (the image's
#     `cacheguard-demo --origin-only`): /healthz answers, the HEALTHCHECK passes, logs are
#     JSON, a request is a MISS then a HIT, the entry is in Redis, the journal on a fresh
#     volume is made by uid 10001, and `stop` (SIGTERM) drains and exits 0 within the grace;
#   - the compose stack (podman-compose, pinned, or docker compose): Redis, the demo API, both
#     sidecars and Prometheus come up and pass their healthchecks, a MISS on one sidecar is a
#     HIT-L2 on the other, Prometheus scrapes both and has loaded every alert rule;
#   - the Kubernetes example: valid against the Kubernetes schemas (kubernetes-validate,
#     pinned), and its embedded config passes `--check-config` in the container as the Pod
#     runs it (uid 10001, read-only root filesystem, no capabilities).
#
# Work files, the Python tools and the stand-ins' build contexts live under
# $CARGO_TARGET_DIR/image-check (default target/). The images stay in the engine's storage and
# the Dockerfile's cache mounts (cargo's target directory) in its build cache, so a second
# run rebuilds only what changed. Everything this run starts is removed when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."

podman_compose_version=1.6.0
kubernetes_validate_version=1.37.0

image=cacheguard:local # the name docker-compose.yml gives the image it builds
prefix=cacheguard-image-check
work="$(realpath -m "${CARGO_TARGET_DIR:-target}")/image-check"
mkdir -p "$work"

started=$SECONDS
step() { echo "== image check ($((SECONDS - started)) s): $*"; }
fail() {
    echo "image-check: $*" >&2
    exit 1
}
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# `wait_until SECONDS WHAT COMMAND...`: runs COMMAND every half second until it succeeds.
wait_until() {
    local limit=$1 what=$2
    shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || fail "$what: not within ${limit} s"
        sleep 0.5
    done
}
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# `x_cache URL`: the X-Cache header of a GET.
x_cache() {
    curl -fsS --max-time 5 -o /dev/null -D - "$1" | tr -d '\r' |
        sed -n 's/^[Xx]-[Cc]ache: *//p'
}

# ---- the engine -----------------------------------------------------------------------------
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    engine=docker
else
    engine=podman
    missing=()
    # dnsname: on podman's CNI backend, the compose stack's containers find each other by
    # service name (demo-api, redis) only through this plugin, which podman only recommends.
    for tool in podman:podman runc:runc mmdebstrap:mmdebstrap \
        /usr/lib/cni/dnsname:golang-github-containernetworking-plugin-dnsname; do
        command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        step "installing ${missing[*]}"
        apt_install "${missing[@]}"
    fi
    cat >"$work/containers.conf" <<'EOF'
# scripts/image-check.sh: crun refuses this kind of machine's hybrid cgroups, and the default
# ulimits of a container are above what its sandbox grants.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
EOF
    export CONTAINERS_CONF="$work/containers.conf"
fi
# Podman without systemd says, on each start of a container that has a healthcheck, that it
# cannot schedule it; this script runs healthchecks itself (below).
ctr() { "$engine" "$@" 2> >(grep -v 'unable to get systemd connection' >&2); }
step "engine: $(ctr --version)"

# Every container, volume and network this run makes is named "$prefix-…" and removed at exit.
host_redis_pid=
cleanup() {
    local status=$?
    set +e
    [ -z "${compose_project:-}" ] || compose_down 5
    # Twice: a container that shares another's network namespace holds it until removed.
    for _ in 1 2; do
        ctr ps -a --format '{{.Names}}' | grep "^$prefix-" | xargs -r "$engine" rm -f -v >/dev/null 2>&1
    done
    ctr volume ls --format '{{.Name}}' | grep "^$prefix-" | xargs -r "$engine" volume rm -f >/dev/null 2>&1
    [ -z "$host_redis_pid" ] || kill "$host_redis_pid" 2>/dev/null
    exit "$status"
}
trap cleanup EXIT

# A container's logs, for a failure's message.
logs_of() { ctr logs --tail 30 "$1" 2>&1 | sed 's/^/    /' >&2; }

# Runs the image's HEALTHCHECK (or a compose service's) once, now: podman runs healthchecks
# from systemd timers, which a machine without systemd does not have; docker runs them itself.
healthcheck() {
    if [ "$engine" = podman ]; then
        podman healthcheck run "$1"
    else
        local status
        for _ in $(seq 60); do
            status="$(docker inspect -f '{{.State.Health.Status}}' "$1")"
            [ "$status" = healthy ] && return 0
            [ "$status" = unhealthy ] && return 1
            sleep 1
        done
        return 1
    fi
}

# ---- the base images ------------------------------------------------------------------------
# `dockerfile_arg NAME`: the default of `ARG NAME=…` in the Dockerfile.
dockerfile_arg() {
    sed -n "s/^ARG $1=\\(.*\\)\$/\\1/p" Dockerfile | sed -n 1p | grep . ||
        fail "the Dockerfile has no ARG $1 with a default"
}
rust_version="$(dockerfile_arg RUST_VERSION)"
debian_release="$(dockerfile_arg DEBIAN_RELEASE)"
stand_in_label=io.cacheguard.stand-in

# `stand_in NAME MAKER`: NAME as it is when present; else pulled; else MAKER makes it.
# MAKER also runs when NAME is a stand-in already, so that a stand-in follows its inputs (the
# engine's layer cache makes that seconds when nothing changed).
stand_in() {
    local name=$1 maker=$2
    if ctr image inspect "$name" >/dev/null 2>&1; then
        case "$(ctr image inspect -f "{{index .Config.Labels \"$stand_in_label\"}}" "$name")" in
            "" | "<no value>") return 0 ;; # the real image
        esac
    elif timeout 300 "$engine" pull -q "$name" >/dev/null 2>&1; then
        return 0
    else
        echo "   $name cannot be pulled here: making a stand-in from Debian packages"
    fi
    "$maker" "$name"
}

# `build_stand_in NAME CONTEXT [BUILD OPTION...]`: builds CONTEXT/Containerfile as NAME,
# quietly unless it fails.
build_stand_in() {
    local log
    log="$work/build-$(tr -c 'a-z0-9.\n-' - <<<"$1").log"
    if ! nice -n 10 "$engine" build ${engine_build_flags[@]+"${engine_build_flags[@]}"} "${@:3}" \
        --label "$stand_in_label=$1" -t "$1" -f "$2/Containerfile" "$2" >"$log" 2>&1; then
        tail -20 "$log" >&2
        fail "could not build the stand-in $1 (log: $log)"
    fi
}
# HEALTHCHECK is part of Docker's image format only; podman's default (OCI) drops it.
engine_build_flags=()
[ "$engine" = docker ] || engine_build_flags=(--format docker)

debian_image="docker.io/library/debian:$debian_release-slim"
make_debian() {
    # Made once: any slim root filesystem of the release will do.
    ! ctr image inspect "$1" >/dev/null 2>&1 || return 0
    local rootfs="$work/debian-rootfs.tar"
    # dpkg excludes as in the official slim images (documentation, man pages, translations);
    # they stay in the image's dpkg config, so that later installs are as slim.
    if ! nice -n 10 mmdebstrap --variant=minbase --quiet \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$debian_release" "$rootfs" >"$work/mmdebstrap.log" 2>&1; then
        tail -20 "$work/mmdebstrap.log" >&2
        fail "mmdebstrap could not make a $debian_release root filesystem"
    fi
    ctr import --quiet --change 'CMD ["bash"]' --change "LABEL $stand_in_label=$1" \
        "$rootfs" "$1" >/dev/null
    rm -f "$rootfs"
}

rust_image="docker.io/library/rust:$rust_version-$debian_release"
make_rust() {
    local name=$1 context="$work/rust-stand-in"
    local sysroot host inputs
    # Remade only when what goes into it changed (copying the toolchain and vendoring the
    # crates take a minute or two): the toolchain, Cargo.lock, this recipe, the Debian image.
    inputs="$({
        rustc -vV
        cat Cargo.lock
        declare -f make_rust
        ctr image inspect -f '{{.Id}}' "$debian_image"
    } | sha256sum | cut -d' ' -f1)"
    if [ "$(ctr image inspect -f "{{index .Config.Labels \"$stand_in_label.inputs\"}}" "$name" 2>/dev/null)" = "$inputs" ]; then
        return 0
    fi
    sysroot="$(rustc --print sysroot)"
    host="$(rustc -vV | sed -n 's/^host: //p')"
    local toolchain="$rust_version-$host"
    rm -rf "$context"
    mkdir -p "$context/toolchain"
    # The toolchain as rustup installed it, without its documentation; hard links where the
    # file system allows (the engine copies the context into the image anyway).
    for part in bin lib libexec etc; do
        [ -e "$sysroot/$part" ] || continue
        cp -al "$sysroot/$part" "$context/toolchain/" 2>/dev/null || cp -a "$sysroot/$part" "$context/toolchain/"
    done
    # Every crate of Cargo.lock, for every platform (cargo resolves the whole lock file); from
    # the local registry cache where the tests' builds put them.
    if ! cargo vendor --locked --quiet --versioned-dirs "$context/vendor" >/dev/null 2>"$work/vendor.log"; then
        cat "$work/vendor.log" >&2
        fail "cargo vendor failed"
    fi
    cat >"$context/cargo-config.toml" <<'EOF'
# image-check stand-in: crates.io's packages from the directory vendored into the image.
[source.crates-io]
replace-with = "vendored"

[source.vendored]
directory = "/usr/local/cargo/vendor"
EOF
    cat >"$context/Containerfile" <<EOF
FROM $debian_image
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        gcc libc6-dev pkg-config ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup \\
    CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    RUST_VERSION=$rust_version
COPY toolchain /usr/local/rustup/toolchains/$toolchain
RUN mkdir -p /usr/local/cargo/bin \\
    && for tool in cargo rustc rustdoc; do \\
        ln -s /usr/local/rustup/toolchains/$toolchain/bin/\$tool /usr/local/cargo/bin/\$tool; \\
    done \\
    && cargo --version && rustc --version
COPY vendor /usr/local/cargo/vendor
COPY cargo-config.toml /usr/local/cargo/config.toml
EOF
    build_stand_in "$name" "$context" --label "$stand_in_label.inputs=$inputs"
    rm -rf "$context"
}

step "base images"
installed_rust="$(rustc --version | cut -d' ' -f2)"
[ "$installed_rust" = "$rust_version" ] ||
    fail "the Dockerfile builds with Rust $rust_version, the tests with $installed_rust" \
        "(rust-toolchain.toml): keep the two the same"
stand_in "$debian_image" make_debian
stand_in "$rust_image" make_rust

# ---- the image ------------------------------------------------------------------------------
# Buildah before 1.29 (podman before 4.4, Debian 12's podman) keeps only the last
# `sharing=locked` cache mount of a RUN in its list to release: the locks of the others are
# never released, and the next RUN that mounts one of those caches waits forever.
version_below() { [ "$1" != "$2" ] && [ "$(printf '%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }
if [ "$engine" = podman ] && version_below "$(podman info --format '{{.Host.BuildahVersion}}')" 1.29; then
    while IFS= read -r run; do
        if grep -oE -- '--mount=[^ ]*' <<<"$run" | grep 'type=cache' | head -n -1 | grep 'sharing=locked' >/dev/null; then
            fail "podman $(podman version --format '{{.Client.Version}}') cannot build this Dockerfile:" \
                "a RUN has a sharing=locked cache mount before another cache mount, and its buildah" \
                "(before 1.29) never releases that lock, so a later RUN waits forever. Make the" \
                "locked mount the last of its RUN (one per RUN), or use podman 4.4 or later."
        fi
    done < <(sed -e '/^[[:space:]]*#/d' Dockerfile | sed -e ':join' -e '/\\$/{N; s/\\\n/ /; b join}' |
        grep -E '^[[:space:]]*RUN[[:space:]]')
fi

step "building $image from the Dockerfile (a release build: minutes the first time)"
build_started=$SECONDS
build_log="$work/image-build.log"
previous_image="$(ctr image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
if [ "$engine" = docker ]; then
    build=(env DOCKER_BUILDKIT=1 docker build)
else
    build=(podman build --format docker)
fi
if ! nice -n 10 "${build[@]}" -t "$image" -f Dockerfile . >"$build_log" 2>&1; then
    tail -30 "$build_log" >&2
    fail "the image does not build (log: $build_log)"
fi
# The image this build replaced, untagged now: removed, so that runs do not pile up images.
if [ -n "$previous_image" ] && [ "$previous_image" != "$(ctr image inspect -f '{{.Id}}' "$image")" ]; then
    ctr rmi "$previous_image" >/dev/null 2>&1 || true
fi
build_finished=$SECONDS
echo "   built in $((build_finished - build_started)) s (cargo in the container:" \
    "$(sed -n 's/.*Finished \(.*\)/\1/p' "$build_log" | tail -1 | grep . || echo "nothing to rebuild"))"

# The shipped proxy is built without tokio's test-util. The control: cacheguard's unit-test
# binary, built with it (the test command's `cargo test` has built it already; run alone,
# this builds it), must hold the probe's string, else tokio changed and the probe with it.
# shellcheck disable=SC2016 # backquotes of the message itself
pause_refusal='requires the `current_thread` Tokio runtime'
control="$(cargo test --locked --lib --no-run --message-format=json 2>"$work/control-build.log" |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)"
[ -n "$control" ] || {
    tail -20 "$work/control-build.log" >&2
    fail "could not build cacheguard's unit-test binary (the control of the test-util probe)"
}
grep -qaF "$pause_refusal" "$control" ||
    fail "the probe for tokio's test-util no longer finds it in cacheguard's unit-test binary" \
        "($control, built with it): tokio changed; update the probe"
in_image() { ctr run --rm --network none --entrypoint "$1" "$image" "${@:2}"; }
if in_image grep -qaF "$pause_refusal" /usr/local/bin/cacheguard; then
    fail "the image's proxy binary is built with tokio's test-util (see scripts/check-image-build.sh)"
fi
echo "   the image's proxy has no tokio test-util (probe: absent there, present in $(basename "$control"))"

# ---- the image alone ------------------------------------------------------------------------
step "--check-config of the shipped config"
in_image /usr/local/bin/cacheguard -h >/dev/null
ctr run --rm -e CACHEGUARD_ADMIN_TOKEN=image-check "$image" \
    --check-config /etc/cacheguard/cacheguard.toml >/dev/null ||
    fail "the image's config is refused with CACHEGUARD_ADMIN_TOKEN set"
if refusal="$(ctr run --rm "$image" --check-config /etc/cacheguard/cacheguard.toml 2>&1)"; then
    fail "the image's config (admin on 0.0.0.0) is accepted without an admin token"
fi
grep -q 'admin.token' <<<"$refusal" ||
    fail "the image's config is refused without a token, but not for the token: $refusal"

step "the image as users run it: host network, a real redis-server, the demo API"
command -v redis-server >/dev/null 2>&1 || apt_install redis-server
redis_port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$work/redis.log" &
host_redis_pid=$!
wait_until 10 "redis-server on $redis_port" redis-cli -p "$redis_port" ping

demo_port="$(free_port)"
# Item reads take this long at the origin: long enough to stop cacheguard with one in flight.
db_delay_ms=2000
ctr run -d --name "$prefix-demo" --network host --entrypoint /usr/local/bin/cacheguard-demo \
    "$image" --origin-only --listen "127.0.0.1:$demo_port" --items 10000 --db-delay-ms "$db_delay_ms" >/dev/null
wait_until 60 "the demo API (cacheguard-demo --origin-only)" \
    curl -fsS --max-time 2 -o /dev/null "http://127.0.0.1:$demo_port/stats"

# The config's admin listener is 0.0.0.0:9091 (the HEALTHCHECK's port): on the host network
# it needs that port of the host.
port_free 9091 || fail "port 9091 is in use: the image's admin listener needs it on the host network"
proxy_port="$(free_port)"
ctr volume create "$prefix-journal" >/dev/null
container="$prefix-cacheguard"
ctr run -d --name "$container" --network host \
    -v "$prefix-journal:/var/lib/cacheguard" \
    -e CACHEGUARD_LISTEN="127.0.0.1:$proxy_port" \
    -e CACHEGUARD_UPSTREAM="http://127.0.0.1:$demo_port" \
    -e CACHEGUARD_REDIS_URL="redis://127.0.0.1:$redis_port" \
    -e CACHEGUARD_ADMIN_TOKEN=image-check \
    "$image" >/dev/null
admin=http://127.0.0.1:9091
if ! (wait_until 60 "cacheguard's /readyz" curl -fsS --max-time 2 -o /dev/null "$admin/readyz"); then
    logs_of "$container"
    fail "the container does not come up"
fi
curl -fsS --max-time 2 "$admin/healthz" >/dev/null || fail "/healthz does not answer"
healthcheck "$container" >/dev/null || {
    logs_of "$container"
    fail "the image's HEALTHCHECK fails on a running container"
}

pid="$(ctr inspect -f '{{.State.Pid}}' "$container")"
uid="$(stat -c %u "/proc/$pid")"
[ "$uid" = 10001 ] || fail "cacheguard runs as uid $uid, not the image's user 10001"
first_line="$(ctr logs "$container" 2>&1 | sed -n 1p)"
python3 -c 'import json, sys; json.loads(sys.argv[1])' "$first_line" 2>/dev/null ||
    fail "the container's log is not JSON (the CMD's --log-format json)"

item="http://127.0.0.1:$proxy_port/api/items/7"
first="$(x_cache "$item")" || fail "GET /api/items/7 through the container failed"
second="$(x_cache "$item")"
[ "$first" = MISS ] || fail "the first GET /api/items/7 is \"$first\", not MISS"
case "$second" in HIT-L1 | HIT-L2) ;; *) fail "the second GET /api/items/7 is \"$second\", not a HIT" ;; esac
[ "$(redis-cli -p "$redis_port" dbsize)" -gt 0 ] || fail "nothing was written to Redis (shared mode)"
echo "   GET /api/items/7: $first, then $second; Redis holds $(redis-cli -p "$redis_port" dbsize) keys"

# The volume was empty: the journal in it was made by the container's user.
volume="$(ctr volume inspect -f '{{.Mountpoint}}' "$prefix-journal")"
journal_owner="$(stat -c %u "$volume/cacheguard.journal" 2>/dev/null)" ||
    fail "no journal in the volume at /var/lib/cacheguard"
[ "$journal_owner" = 10001 ] || fail "the journal belongs to uid $journal_owner, not 10001"

step "SIGTERM (stop) with a request in flight: it is answered, and cacheguard exits 0 in time"
grace=15 # docker-compose.yml's stop_grace_period; server.shutdown_grace is 10 s
curl -sS --max-time "$grace" -o /dev/null -w '%{http_code}' "http://127.0.0.1:$proxy_port/api/items/8" \
    >"$work/in-flight" 2>&1 &
in_flight=$!
origin_busy() { curl -fsS --max-time 2 "$admin/metrics" | grep -E '^cacheguard_origin_in_flight(\{[^}]*\})? [1-9]' >/dev/null; }
wait_until 10 "the request for /api/items/8 at the origin" origin_busy
stop_started=$SECONDS
ctr stop -t "$grace" "$container" >/dev/null
stop_took=$((SECONDS - stop_started))
wait "$in_flight" || true
[ "$(cat "$work/in-flight")" = 200 ] ||
    fail "the request in flight when cacheguard was stopped was not answered: $(cat "$work/in-flight")"
exit_code="$(ctr inspect -f '{{.State.ExitCode}}' "$container")"
if [ "$exit_code" != 0 ] || [ "$stop_took" -ge "$grace" ]; then
    logs_of "$container"
    fail "stopped after ${stop_took} s with exit code $exit_code (wanted 0 within ${grace} s)"
fi
echo "   the request in flight was answered 200; exited 0 after ${stop_took} s"
ctr rm -f -v "$prefix-demo" "$container" >/dev/null
kill "$host_redis_pid"
host_redis_pid=

# ---- Python tools (pinned) ------------------------------------------------------------------
venv="$work/venv"
python_tools=("podman-compose==$podman_compose_version" "kubernetes-validate==$kubernetes_validate_version")
tools_in_place() {
    local frozen tool
    frozen="$("$venv/bin/python" -m pip freeze 2>/dev/null)" || return 1
    for tool in "${python_tools[@]}"; do grep -qxF "$tool" <<<"$frozen" || return 1; done
}
if ! tools_in_place; then
    step "installing ${python_tools[*]} into $venv"
    python3 -m venv "$venv" 2>/dev/null || {
        apt_install python3-venv
        python3 -m venv "$venv"
    }
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${python_tools[@]}"
fi
# `yaml_query FILE EXPRESSION`: prints EXPRESSION, Python over the YAML document(s) `docs`.
yaml_query() {
    "$venv/bin/python" -c 'import sys, yaml
docs = list(yaml.safe_load_all(open(sys.argv[1])))
result = eval(sys.argv[2])
print("\n".join(map(str, result)) if isinstance(result, list) else result)' "$1" "$2"
}

# ---- the compose stack ----------------------------------------------------------------------
make_redis() {
    local context="$work/redis-stand-in"
    mkdir -p "$context"
    # The official image's redis-server is built with protected mode off: the container's
    # network is the boundary. Debian's has it on, which refuses every client but loopback.
    cat >"$context/docker-entrypoint.sh" <<'SH'
#!/bin/sh
if [ "$1" = redis-server ]; then
    shift
    exec redis-server "$@" --protected-mode no
fi
exec "$@"
SH
    chmod +x "$context/docker-entrypoint.sh"
    cat >"$context/Containerfile" <<CONTAINERFILE
FROM $debian_image
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \\
    && rm -rf /var/lib/apt/lists/* \\
    && install -d -o redis -g redis /data
COPY docker-entrypoint.sh /usr/local/bin/
WORKDIR /data
USER redis
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
CONTAINERFILE
    build_stand_in "$1" "$context"
}
make_prometheus() {
    local context="$work/prometheus-stand-in"
    mkdir -p "$context"
    # As the official image: /bin/prometheus (/bin is /usr/bin) as nobody, data in /prometheus; wget for healthchecks.
    cat >"$context/Containerfile" <<CONTAINERFILE
FROM $debian_image
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \\
    && rm -rf /var/lib/apt/lists/* \\
    && install -d -o nobody -g nogroup /prometheus
WORKDIR /prometheus
USER nobody
EXPOSE 9090
VOLUME ["/prometheus"]
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
CONTAINERFILE
    build_stand_in "$1" "$context"
}

step "the compose stack (docker-compose.yml)"
compose_project=$prefix
if [ "$engine" = docker ]; then
    compose=(docker compose -p "$compose_project" -f docker-compose.yml)
else
    compose=("$venv/bin/podman-compose" -p "$compose_project" -f docker-compose.yml)
fi
# `compose_down GRACE`: stops the stack and removes its containers and volumes, the
# anonymous ones (the image's VOLUME) included, which `down -v` leaves behind.
compose_down() {
    local volumes
    volumes="$(ctr ps -aq --filter "label=com.docker.compose.project=$compose_project" |
        xargs -r "$engine" inspect -f '{{range .Mounts}}{{if eq .Type "volume"}}{{.Name}} {{end}}{{end}}' 2>/dev/null)"
    timeout 120 "${compose[@]}" down -v --timeout "$1" >/dev/null 2>&1
    # shellcheck disable=SC2086 # one name a word
    [ -z "${volumes// /}" ] || "$engine" volume rm -f $volumes >/dev/null 2>&1
}
# Every service whose image is there (or is a stand-in); the others are left out, said so.
services=()
while read -r service service_image; do
    case "$service_image" in
        "$image") services+=("$service") ;;
        redis:*) stand_in "docker.io/library/$service_image" make_redis && services+=("$service") ;;
        prom/prometheus:*) stand_in "docker.io/$service_image" make_prometheus && services+=("$service") ;;
        *)
            if ctr image inspect "$service_image" >/dev/null 2>&1 ||
                timeout 300 "$engine" pull -q "$service_image" >/dev/null 2>&1; then
                services+=("$service")
            else
                echo "   $service ($service_image) is left out: its image cannot be pulled here and" \
                    "no Debian package stands in for it"
            fi
            ;;
    esac
done < <(yaml_query docker-compose.yml '[name + " " + s["image"] for name, s in docs[0]["services"].items()]')
for port in $(yaml_query docker-compose.yml "[p.split(':')[-2] for name in '${services[*]}'.split() for p in docs[0]['services'][name].get('ports', [])]"); do
    port_free "$port" || fail "port $port is in use: the compose stack publishes it"
done
[ "${#services[@]}" -gt 0 ] || fail "no services read from docker-compose.yml"
echo "   services: ${services[*]}"
# The image was built above from the same Dockerfile and context as the file's `build:`.
if ! timeout 600 "${compose[@]}" up -d --no-build "${services[@]}" >"$work/compose-up.log" 2>&1; then
    tail -30 "$work/compose-up.log" >&2
    fail "podman-compose up failed (log: $work/compose-up.log)"
fi
container_of() {
    ctr ps -a --filter "label=com.docker.compose.project=$compose_project" \
        --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | sed -n 1p
}
for check in "demo-api http://127.0.0.1:9000/stats" \
    "cacheguard-a http://127.0.0.1:9091/readyz" "cacheguard-b http://127.0.0.1:9092/readyz" \
    "prometheus http://127.0.0.1:9090/-/ready"; do
    service=${check%% *}
    if ! (wait_until 90 "$service (${check#* })" curl -fsS --max-time 2 -o /dev/null "${check#* }"); then
        logs_of "$(container_of "$service")"
        fail "the compose service $service does not come up"
    fi
done
for service in "${services[@]}"; do
    [ "$(yaml_query docker-compose.yml "'healthcheck' in docs[0]['services']['$service']")" = True ] || continue
    healthcheck "$(container_of "$service")" >/dev/null || {
        logs_of "$(container_of "$service")"
        fail "the compose service $service fails its healthcheck"
    }
done
first="$(x_cache http://127.0.0.1:8081/api/items/7)" || fail "GET /api/items/7 on cacheguard-a failed"
other="$(x_cache http://127.0.0.1:8082/api/items/7)" || fail "GET /api/items/7 on cacheguard-b failed"
if [ "$first" != MISS ] || [ "$other" != HIT-L2 ]; then
    fail "GET /api/items/7: \"$first\" on cacheguard-a, then \"$other\" on cacheguard-b (wanted MISS, HIT-L2)"
fi
echo "   GET /api/items/7: MISS on cacheguard-a, then HIT-L2 on cacheguard-b"

prometheus_api() { curl -fsS --max-time 5 "http://127.0.0.1:9090/api/v1/$1"; }
targets_up() {
    prometheus_api targets | "$venv/bin/python" -c 'import json, sys
targets = [t for t in json.load(sys.stdin)["data"]["activeTargets"] if t["labels"]["job"] == "cacheguard"]
sys.exit(not (len(targets) == 2 and all(t["health"] == "up" for t in targets)))'
}
wait_until 60 "Prometheus scraping cacheguard-a and cacheguard-b" targets_up
rules_expected="$(yaml_query dashboards/alerts.yml 'sum(len(g["rules"]) for g in docs[0]["groups"])')"
rules_loaded="$(prometheus_api rules | "$venv/bin/python" -c 'import json, sys
groups = json.load(sys.stdin)["data"]["groups"]
rules = [r for g in groups for r in g["rules"]]
broken = [r["name"] for r in rules if r.get("health") == "err"]
print(len(rules) if not broken else "broken: " + " ".join(broken))')"
[ "$rules_loaded" = "$rules_expected" ] ||
    fail "Prometheus loaded $rules_loaded alert rules of the $rules_expected in dashboards/alerts.yml"
echo "   Prometheus scrapes both sidecars and has loaded all $rules_expected alert rules"
compose_down 15
compose_project=

# ---- the Kubernetes example -----------------------------------------------------------------
step "the Kubernetes example (examples/kubernetes/cacheguard-sidecar.yaml)"
manifest=examples/kubernetes/cacheguard-sidecar.yaml
"$venv/bin/kubernetes-validate" --strict --quiet "$manifest" ||
    fail "$manifest is not valid against the Kubernetes $kubernetes_validate_version schemas"
# Its Pod, run as a kubelet would but without a cluster (scripts/image-check-pod.py): each
# container with the manifest's security context, environment, volumes and arguments, on
# this image (the manifest names the tag you push); cacheguard in the app's network
# namespace, as containers of one Pod. Its Redis is not part of the example: cacheguard runs
# degraded without it, as it would in a namespace that has none.
pod() { "$venv/bin/python" scripts/image-check-pod.py "$manifest" "$work" "$prefix-pod" "$@"; }
# `pod_list VAR QUERY CONTAINER`: the query's lines into the array VAR.
pod_list() {
    local lines
    lines="$(pod "${@:2}")" || fail "cannot translate the Pod of $manifest"
    mapfile -t "$1" < <([ -z "$lines" ] || printf '%s\n' "$lines")
}
app_options=() app_args=() cacheguard_options=() cacheguard_args=() probes=() pre_stop=()
tmpfs_off=()
[ "$engine" = docker ] || tmpfs_off=(--read-only-tmpfs=false) # podman adds tmpfs on /tmp otherwise
pod_list app_options options app
pod_list app_args args app
pod_list cacheguard_options options cacheguard
pod_list cacheguard_args args cacheguard
config_path=
for ((i = 0; i < ${#cacheguard_args[@]}; i++)); do
    [ "${cacheguard_args[i]}" != --config ] || config_path="${cacheguard_args[i + 1]:-}"
done
[ -n "$config_path" ] || fail "the cacheguard container of $manifest has no --config argument"
if ! verdict="$(ctr run --rm --network none "${tmpfs_off[@]}" "${cacheguard_options[@]}" "$image" \
    --check-config "$config_path" 2>&1)"; then
    fail "the Kubernetes example's config is refused in the container as the Pod runs it: $verdict"
fi
ctr run -d --name "$prefix-pod-app" --network none "${tmpfs_off[@]}" "${app_options[@]}" \
    "$image" "${app_args[@]}" >/dev/null
ctr run -d --name "$prefix-pod-cacheguard" --network "container:$prefix-pod-app" "${tmpfs_off[@]}" \
    "${cacheguard_options[@]}" "$image" "${cacheguard_args[@]}" >/dev/null
for container in app cacheguard; do
    pod_list probes probes "$container"
    for probe in "${probes[@]}"; do
        mapfile -t probe_argv < <("$venv/bin/python" -c 'import json, sys; print("\n".join(json.loads(sys.argv[1])))' "$probe")
        if ! (wait_until 60 "the $container container's probe ${probe_argv[*]}" \
            ctr exec "$prefix-pod-$container" "${probe_argv[@]}"); then
            logs_of "$prefix-pod-$container"
            fail "the $container container of the Kubernetes example does not pass its probe"
        fi
    done
    pod_list pre_stop pre-stop "$container"
    if [ "${#pre_stop[@]}" -gt 0 ]; then
        program="$("$venv/bin/python" -c 'import json, sys; print(json.loads(sys.argv[1])[0])' "${pre_stop[0]}")"
        # shellcheck disable=SC2016 # expanded by the container's shell
        ctr exec "$prefix-pod-$container" sh -c 'command -v "$1"' sh "$program" >/dev/null ||
            fail "the $container container's preStop hook runs \"$program\", which its image lacks"
    fi
done
pod_item="$(ctr exec "$prefix-pod-cacheguard" curl -fsS --max-time 10 -o /dev/null -D - \
    http://127.0.0.1:8080/api/items/7 | tr -d '\r' | sed -n 's/^[Xx]-[Cc]ache: *//p')"
[ "$pod_item" = MISS ] || fail "GET /api/items/7 through the Pod's cacheguard is \"$pod_item\", not MISS"
grace="$(pod grace)"
stop_started=$SECONDS
ctr stop -t "$grace" "$prefix-pod-cacheguard" >/dev/null
exit_code="$(ctr inspect -f '{{.State.ExitCode}}' "$prefix-pod-cacheguard")"
[ "$exit_code" = 0 ] || fail "the Pod's cacheguard exited $exit_code on SIGTERM"
ctr rm -f -v "$prefix-pod-cacheguard" >/dev/null
ctr rm -f -v "$prefix-pod-app" >/dev/null
echo "   valid; its config checks and its Pod runs as the manifest says (probes pass, a request" \
    "is a MISS, SIGTERM exits 0 after $((SECONDS - stop_started)) s)"

step "passed (the image's build took $((build_finished - build_started)) s)"
