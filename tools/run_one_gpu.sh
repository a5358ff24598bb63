#!/usr/bin/env bash
# Every check and benchmark that one GPU can run, in one command: builds
# hostir._C against the machine's torch, then
#   1. every test marked cuda (tools/gpu_check.py --part single),
#   2. the offload tests marked cuda and tools/bench_offload.py
#      (tools/run_offload_gpu.sh),
#   3. the training checks: one rank on CUDA, and two ranks sharing the GPU
#      on the `cuda` copy-engine transport (tools/check_training_gpu.py),
#   4. tools/bench_training.py at world size 1,
#   5. tools/bench_host_overhead.py, and its --multidevice mode with two
#      ranks sharing the GPU on the `cuda` transport (host µs per
#      steady-state multi-device execute, the protections shown firing).
# Each step's log and results go under $OUT/<step>/ (default
# /tmp/hostir-one-gpu); the exit status is 1 when any step failed.
#
#   OUT=/tmp/out bash tools/run_one_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hostir-one-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HOSTIR_MASTER_ADDR=127.0.0.1 HOSTIR_TIMEOUT=${HOSTIR_TIMEOUT:-120}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

status=0
step() {  # step NAME SECONDS COMMAND...: run with OUT=$OUT/NAME, remember a failure
    local name=$1 limit=$2; shift 2
    mkdir -p "$OUT/$name"
    echo "== $name" | tee -a "$OUT/summary.txt"
    OUT="$OUT/$name" HOSTIR_MASTER_PORT=$(free_port) timeout -k 5 "$limit" "$@" >"$OUT/$name/log.txt" 2>&1
    local rc=$?
    tail -n 12 "$OUT/$name/log.txt" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || { echo "   exit $rc" | tee -a "$OUT/summary.txt"; status=1; }
}

python3 - <<'PY' | tee "$OUT/summary.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PY
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1
echo "build: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"

step cuda_tests 300 sh -c 'python3 tools/gpu_check.py --part single --out "$OUT"'
step offload 400 bash tools/run_offload_gpu.sh --iters 11
step training_one_rank 200 sh -c 'python3 tools/check_training_gpu.py --out "$OUT"'
step training_two_ranks 200 sh -c 'torchrun --standalone --nproc-per-node 2 tools/check_training_gpu.py --out "$OUT"'
step bench_training 300 sh -c 'python3 tools/bench_training.py --out-dir "$OUT"'
step host_overhead 200 sh -c 'python3 tools/bench_host_overhead.py --out-dir "$OUT"'
step host_overhead_multidevice 300 sh -c 'torchrun --standalone --nproc-per-node 2 tools/bench_host_overhead.py --multidevice --device cuda --out-dir "$OUT"'
exit $status
