#!/usr/bin/env bash
# On a GPU machine: build hostir._C against its CUDA torch (timed), run the
# cuda tests of both evaluators and the C++ executor's tests, then the
# host-overhead benchmark (Python evaluator, C++ executor, CUDA-graph replay,
# eager). Logs and results go to $OUT (default /tmp/hostir-cpp-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hostir-cpp-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 - <<'PY' | tee "$OUT/env.txt"
import os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "cpus", os.cpu_count())
PY
rm -rf build python/hostir/_C*.so
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-8} python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1
echo "build: exit $? in $(( $(date +%s) - start )) s (MAX_JOBS=${MAX_JOBS:-8})" | tee -a "$OUT/env.txt"
python3 -c 'from hostir import cpp; print("cpp executor available:", cpp.available(), cpp.reason())' | tee -a "$OUT/env.txt"

status=0
# The whole log, verbose: a crash (faulthandler) names the test it happened in.
timeout 200 python3 -m pytest -v -rs -p no:cacheprovider tests/python/test_flat_program.py tests/python/test_evaluator.py tests/python/test_stream_lowering.py tests/python/test_prepared.py >"$OUT/pytest.log" 2>&1
rc=$?; tail -15 "$OUT/pytest.log"
[ "$rc" -eq 0 ] || status=1
timeout 200 python3 tools/bench_host_overhead.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
