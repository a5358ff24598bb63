#!/usr/bin/env bash
# The overlap work on a machine with 2 GPUs (or more; NRANKS=2 by default):
#   1. tests/python/multidevice/test_decompositions.py under torchrun, NCCL
#   2. the same with the rings on the copy-engine transport (HOSTIR_TEST_TRANSPORT=cuda)
#   3. tools/check_cuda_transport.py: the cuda transport eager, back to back
#      and replayed from CUDA graphs
#   4. tools/bench_overlap.py: AG+matmul at the issue's shape with the M sweep,
#      then matmul+reduce-scatter; results and the sweep plot under $OUT
# Logs go to $OUT (default /tmp/hostir-overlap). Needs python3 with torch,
# pytest, pytest-timeout; hostir runs from the tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hostir-overlap}
NRANKS=${NRANKS:-2}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HOSTIR_TIMEOUT=${HOSTIR_TIMEOUT:-60}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'; }
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember failure
    local name=$1 limit=$2; shift 2
    echo "== $name" | tee -a "$OUT/summary.txt"
    HOSTIR_MASTER_PORT=$(free_port) timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || { echo "   exit $rc" | tee -a "$OUT/summary.txt"; status=1; }
}
python3 - <<'PY' | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
TESTS=(-m pytest -q -p no:cacheprovider --color=no tests/python/multidevice/test_decompositions.py --timeout=240)
step decompositions_nccl 300 torchrun --standalone --nproc-per-node "$NRANKS" "${TESTS[@]}"
HOSTIR_TEST_TRANSPORT=cuda step decompositions_cuda 300 torchrun --standalone --nproc-per-node "$NRANKS" "${TESTS[@]}"
step check_cuda_transport 300 torchrun --standalone --nproc-per-node "$NRANKS" tools/check_cuda_transport.py --out "$OUT"
step bench_ag 900 torchrun --standalone --nproc-per-node "$NRANKS" tools/bench_overlap.py \
    --M 8192 --K 8192 --N 4096 --sweep 2048,4096,8192,16384,32768 --out-dir "$OUT" --tag "h200x$NRANKS"
step bench_rs 600 torchrun --standalone --nproc-per-node "$NRANKS" tools/bench_overlap.py \
    --problem rs --M 16384 --K 4096 --N 8192 --out-dir "$OUT" --tag "h200x${NRANKS}_rs"
exit $status
