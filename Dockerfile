# syntax=docker/dockerfile:1
#
# cacheguard image: the proxy (`cacheguard`, the entrypoint) and the demo
# (`cacheguard-demo`, whose `--origin-only` mode is the SQLite-backed demo API that
# docker-compose.yml runs as the origin).
#
#   docker build -t cacheguard:local .
#   docker run --rm -p 8080:8080 -p 127.0.0.1:9091:9091 \
#       -v "$PWD/my-cacheguard.toml:/etc/cacheguard/cacheguard.toml:ro" \
#       -e CACHEGUARD_ADMIN_TOKEN="$TOKEN" -v cacheguard-journal:/var/lib/cacheguard \
#       cacheguard:local
#
# Needs BuildKit (the default builder of Docker 23 and later) for the cache mounts.

ARG RUST_VERSION=1.95.0
ARG DEBIAN_RELEASE=bookworm

# ---- build -------------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
# protoc: the etcd lock service's client compiles etcd's gRPC definitions at build time; they
# import protobuf's well-known types (google/protobuf/descriptor.proto...), which are in
# libprotobuf-dev, a package protoc only recommends.
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# rust-toolchain.toml is deliberately not copied: it pins the same 1.95.0 this image has, but
# also asks rustup for clippy and rustfmt, which a release build does not need.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY demo ./demo
COPY config ./config
# The proxy and the demo in one cargo invocation, so that every dependency is compiled once.
# The demo is a package of its own with normal dependencies only, so the proxy's tokio gets
# none of the dev-dependencies' features (`test-util` would make every `Instant::now()` take
# a mutex); scripts/check-image-build.sh (run by the test command) fails on any build here
# that gives the proxy `test-util`. The target dir is a cache mount, so the binaries are
# copied out of it in the step that builds them.
# Builds running at once share the caches: cargo locks the target dir itself, but its lock
# on the registry is in $CARGO_HOME, outside the mount, so that mount is `sharing=locked`.
# One locked mount per RUN, and the last: podman before 4.4 (buildah before 1.29) releases
# only the last locked mount of a RUN, and the next RUN waits forever for the others.
# The demo's SQLite is bundled: the image's gcc compiles it.
RUN --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    cargo build --release --locked -p cacheguard -p cacheguard-demo \
    && install -D -m 0755 target/release/cacheguard target/release/cacheguard-demo -t /out

# ---- runtime -----------------------------------------------------------------------------
# debian-slim rather than distroless: the HEALTHCHECK needs an HTTP client in the image
# (cacheguard has no self-check subcommand, and distroless has neither a shell nor curl),
# and the glibc here is the one the build stage linked against.
FROM debian:${DEBIAN_RELEASE}-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 cacheguard \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /var/lib/cacheguard --shell /usr/sbin/nologin cacheguard \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/cacheguard \
    && install -d -m 0755 /etc/cacheguard /usr/share/doc/cacheguard

COPY --from=build /out/cacheguard /out/cacheguard-demo /usr/local/bin/
# The default config is config/docker.toml: shared mode, the demo's routes, upstream
# demo-api:9000 and redis:6379 (the services of docker-compose.yml). Its deployment-specific
# values can be overridden with CACHEGUARD_LISTEN, CACHEGUARD_UPSTREAM, CACHEGUARD_REDIS_URL
# and CACHEGUARD_ADMIN_TOKEN; for your own routes (or embedded mode: a file without [redis])
# mount your config over it.
COPY config/docker.toml /etc/cacheguard/cacheguard.toml
# Every key, documented.
COPY config/cacheguard.toml /usr/share/doc/cacheguard/cacheguard.example.toml
# Fails the build if a binary does not run on this base or the shipped config does not load
# (checked as it is run: with an admin token, which its 0.0.0.0 admin listener requires).
RUN CACHEGUARD_ADMIN_TOKEN=build-check cacheguard --check-config /etc/cacheguard/cacheguard.toml \
    && cacheguard --version \
    && cacheguard-demo --help > /dev/null

LABEL org.opencontainers.image.title="cacheguard" \
      org.opencontainers.image.description="A cache-protection sidecar: a caching reverse proxy in front of a database-backed API" \
      org.opencontainers.image.licenses="Apache-2.0"

USER 10001:10001
WORKDIR /var/lib/cacheguard
# The retry journal ([journal] path = /var/lib/cacheguard/cacheguard.journal): one per
# instance, never shared.
VOLUME ["/var/lib/cacheguard"]
# 8080: the proxy (server.listen). 9091: the admin listener (/metrics, /healthz, /readyz,
# /admin/*); keep it private.
EXPOSE 8080 9091
# Liveness of the admin listener. Valid for any config whose admin.listen is 0.0.0.0:9091 or
# 127.0.0.1:9091 (the default); other configs override it (compose `healthcheck:`).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["curl", "-fsS", "--max-time", "2", "-o", "/dev/null", "http://127.0.0.1:9091/healthz"]
# cacheguard drains on SIGTERM (server.shutdown_grace, default 10 s) and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/cacheguard"]
CMD ["--config", "/etc/cacheguard/cacheguard.toml", "--log-format", "json"]
