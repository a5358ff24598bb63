#!/usr/bin/env bash
# Weights streamed from host memory, on one GPU:
#   1. the tests marked cuda of transfers, hoisting and hostir.offload
#   2. tools/bench_offload.py: the 6 x 8192^2 bf16 Linear+GELU stack, M from
#      1 to 16384, every variant, results (.md, .json, .png) under $OUT
# Logs go to $OUT (default benchmarks/results). Extra arguments go to the
# bench (say --quick for a smoke run). Needs python3 with torch, pytest,
# pytest-timeout and hypothesis; accelerate and transformers where present;
# hostir runs from the tree, with or without its C++ extension.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember failure
    local name=$1 limit=$2; shift 2
    echo "== $name" | tee -a "$OUT/offload_summary.txt"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$OUT/$name.log" | tee -a "$OUT/offload_summary.txt"
    [ $rc -eq 0 ] || { echo "   exit $rc" | tee -a "$OUT/offload_summary.txt"; status=1; }
}
step offload_gpu_tests 300 python3 -m pytest -q -p no:cacheprovider --color=no -m cuda \
    tests/python/test_transfers.py tests/python/test_offload.py tests/python/test_hoist_transfers.py \
    tests/python/test_insert_deallocations.py --timeout=240
step bench_offload 600 python3 tools/bench_offload.py --out-dir "$OUT" "$@"
exit $status
