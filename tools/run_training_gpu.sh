#!/usr/bin/env bash
# Training through hostir on one GPU (H100 or H200), in order:
#   1. tools/check_training_gpu.py, one rank on CUDA: gradcheck (float64) of
#      the transpose rules, and LlamaForCausalLM through hostir.parallel on a
#      1-rank mesh against the unsharded model (logits, loss, gradients,
#      AdamW steps)
#   2. the same script under torchrun, two ranks sharing the GPU: gloo for
#      the process group, the rings on the `cuda` copy-engine transport; the
#      AG+matmul and matmul+ReduceScatter layers and a sequence-parallel
#      rowwise Linear (the GEMM+RS ring), forward and backward
#   3. tools/bench_training.py at world size 1: the Llama MLP block and the
#      attention projections (bf16, hidden 8192), hostir vs eager torch and
#      torch TP; target hostir <= 1.05x eager
#   4. the CPU parity tests (gloo, 2 ranks under torchrun): gradcheck of every
#      communication and the Llama plans
# Logs and results go to $OUT (default /tmp/hostir-training).
#
#   OUT=/tmp/out bash tools/run_training_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hostir-training}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HOSTIR_TIMEOUT=${HOSTIR_TIMEOUT:-120}
export HOSTIR_MASTER_ADDR=127.0.0.1
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember failure
    local name=$1 limit=$2; shift 2
    echo "== $name" | tee -a "$OUT/summary.txt"
    HOSTIR_MASTER_PORT=$(free_port) timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 8 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || { echo "   exit $rc" | tee -a "$OUT/summary.txt"; status=1; }
}
python3 - <<'PY' | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
step check_one_rank 300 python3 tools/check_training_gpu.py --out "$OUT"
step check_two_ranks_shared_gpu 300 torchrun --standalone --nproc-per-node 2 tools/check_training_gpu.py --out "$OUT"
step bench_training 600 python3 tools/bench_training.py --out-dir "$OUT"
CUDA_VISIBLE_DEVICES= step parity_cpu_gloo 600 torchrun --standalone --nproc-per-node 2 -m pytest -q -p no:cacheprovider --color=no \
    tests/python/multidevice/test_autodiff.py tests/python/multidevice/test_llama_tp.py --timeout=300
exit $status
