#!/usr/bin/env bash
# Big keys: the full-size run of tests/it/big_keys.rs. One cacheguard in shared mode fills
# 100,000 distinct keys of one route through a real redis-server, then every `cg:` key is
# measured (`MEMORY USAGE`, and ZCARD/SCARD/HLEN/LLEN/XLEN for collections) and the largest
# and the most populated are printed; the run fails if one is over 1 MB or 10k members. A
# pattern purge over the sharded route index is checked at the end.
#
# Debug build (the suite's), about 4 minutes on 2 cores.
#
# usage: bash bench/big_keys.sh
# env:   CG_BIG_KEYS_FILLS=100000 (keys filled)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CG_BIG_KEYS_FILLS="${CG_BIG_KEYS_FILLS:-100000}"
cargo test --test it big_keys:: -- --nocapture 2>&1 | grep -E "keys;|test result|panicked|assert"
