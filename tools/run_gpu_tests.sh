#!/usr/bin/env bash
# Runs the whole test suite on a machine with a CUDA GPU (the `cuda` tests
# run there, the CPU ones too), then the host-overhead benchmark on CUDA.
# Logs and results go to $OUT (default /tmp/hostir-gpu). Needs python3 with
# torch, pytest, pytest-timeout and hypothesis; hostir runs from the tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hostir-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 - <<'PY' | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY

status=0
timeout 540 python3 -m pytest -q -rs tests/python 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 -m pytest -q --collect-only -m cuda tests/python 2>/dev/null | tail -1 | sed 's/^/cuda tests: /' | tee -a "$OUT/env.txt"

timeout 240 python3 tools/bench_host_overhead.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
