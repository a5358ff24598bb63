#!/usr/bin/env bash
# Runs the tests of nvFuser users' programs written in hostir's API on a
# machine with one CUDA GPU: the reference pull request's loop separation,
# torch's matmul broadcasting and the split-weight linear, broadcast_in_dim
# and expand, IfThenElse on both evaluators, views, and the error checks
# (their `cuda` cases run there, the CPU ones too). Logs go to $OUT
# (default benchmarks/results/parity-gpu). Needs python3 with torch, pytest
# and hypothesis; hostir runs from the tree (its C++ extension built).
#
#   OUT=/tmp/out bash tools/run_parity_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/parity-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 - <<'PY' | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
from hostir import cpp
print("hostir._C", "built" if cpp.available() else f"missing: {cpp.reason()}")
PY

timeout 500 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/python/test_seed_loops.py \
    tests/python/test_torch_forms.py \
    tests/python/test_broadcast_ops.py \
    tests/python/test_if_then_else.py \
    tests/python/test_unannotated.py \
    tests/python/test_views.py \
    tests/python/test_no_internal_errors.py \
    tests/python/test_shape_ops.py \
    2>&1 | tee "$OUT/pytest.log"
exit "${PIPESTATUS[0]}"
