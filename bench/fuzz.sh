#!/usr/bin/env bash
# Fuzz run: the bounded fuzz tests of tests/it/fuzz.rs (release build), for minutes instead of the
# suite's seconds:
#
#   requests  an embedded cacheguard (item route + write route) in front of the in-process test
#             origin, both on loopback; random bytes, mutated valid requests and hand-made
#             malformed ones (no/two/invalid Host, bad chunk sizes, CL+TE, bad Content-Length,
#             broken request lines, CONNECT/TRACE, heads over max_header_bytes, ...) on raw
#             connections, valid requests interleaved. Checks: every connection answered or
#             closed within 2 s, certainly-malformed requests get a 4xx or a close and never
#             reach the origin, valid requests and /healthz answer 200 throughout.
#   config    Config::from_toml in process, then `cacheguard --check-config` on random and
#             mutated TOML: no panic or crash, exit 0 or 1, every problem `file:line: key: msg`.
#
# Each test runs for FUZZ_SECS and prints a summary (counts per request family and answer
# class; accepted/rejected configs) and, on failure, every finding grouped by rule with the
# bytes of a few cases and the seed to replay them. The whole output is kept in a log.
#
# usage: bash bench/fuzz.sh [TEST_FILTER]   (e.g. `requests` or `config`; default both)
# env:   FUZZ_SECS=300 (time budget of each test)
#        FUZZ_SEED=<u64 or 0x hex> (replay a run; default from the clock, printed)
#        FUZZ_CASES=<n> (cap on cases per test; default 2000 per second of budget)
#        FUZZ_CASE=<n> (run only case n of FUZZ_SEED, printed in full)
#        FUZZ_LOG=path (default bench/results/fuzz-<UTC time>.log)
set -euo pipefail

# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_init

export CG_FUZZ_SECS=${FUZZ_SECS:-300}
if [[ -n ${FUZZ_SEED:-} ]]; then export CG_FUZZ_SEED=$FUZZ_SEED; fi
if [[ -n ${FUZZ_CASES:-} ]]; then export CG_FUZZ_CASES=$FUZZ_CASES; fi
if [[ -n ${FUZZ_CASE:-} ]]; then export CG_FUZZ_CASE=$FUZZ_CASE; fi

mkdir -p "$ROOT/bench/results"
LOG=${FUZZ_LOG:-$ROOT/bench/results/fuzz-$(date -u +%Y%m%dT%H%M%SZ).log}

log "building (release) and fuzzing for ${CG_FUZZ_SECS}s per test; log: $LOG"
# The fuzz tests are the module `fuzz` of the one test binary; libtest's filters select any
# test that matches one of them, so the tests of that module matching TEST_FILTER are listed
# first and run by their exact names.
mapfile -t TESTS < <(cargo test --release --test it -- --list --format=terse 2>/dev/null |
    sed -n 's/: test$//p' | grep '^fuzz::' | grep -F -- "${1:-}")
((${#TESTS[@]} > 0)) || die "no test of tests/it/fuzz.rs matches '${1:-}'"
status=0
CG_FUZZ_SECS=$CG_FUZZ_SECS cargo test --release --test it -- --nocapture --exact "${TESTS[@]}" 2>&1 |
    tee "$LOG" || status=$?

echo
log "summaries:"
grep -E '^fuzz (requests|config)( summary)?:|^  family +cases|^  [a-z0-9/-]+ +[0-9]+ ' "$LOG" || true
if ((status != 0)); then
    log "FAILED (exit $status): findings (whole inputs under target/tmp/fuzz-failures/):"
    grep -E '^\[[a-z0-9_-]+\] [0-9]+ cases:|^    [0-9]+ × |^    case [0-9]+ \(' "$LOG" | cut -c1-300 || true
    exit "$status"
fi
log "no findings"
