#!/usr/bin/env bash
# One run of tools/bench_offload.py on one GPU, every variant (resident, copy
# alone, sequential, prefetch, accelerate's cpu_offload, hostir eager, from a
# CUDA graph, and hostir's sequential program forced) over the M sweep
# 1, 512, 1024, 2048, 4096, 8192, 16384, 11 timed runs each: offload_<device>.md,
# .json and .png under $OUT (default benchmarks/results), the log beside them.
# Under a minute on an H100 (46 s with 11 rounds, 56 s with 21).
# Extra arguments go to the bench.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 580 python3 tools/bench_offload.py --iters 11 --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench_offload.log"
