#!/usr/bin/env bash
# The C++ core's unary ops and layouts on one GPU, in one command: builds
# hostir._C against the machine's torch, runs the C++-against-Python tests
# on CUDA (every unary kind, preallocated outputs, stream loops, the
# one-rank parallel Linears; tests/python/test_cpp_parity.py and the flat
# program's bit-for-bit tests), and, when BEFORE names another tree (one
# with its own hostir._C built, or pass BUILD=1), compares host overhead
# before/after in one run (tools/compare_host_overhead.py).
#
#   OUT=/tmp/out bash tools/check_cpp_core_gpu.sh
#   OUT=/tmp/out BEFORE=/path/to/main BUILD=1 bash tools/check_cpp_core_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/cpp_core_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
python3 setup.py build_ext --inplace >"$OUT/build.txt" 2>&1 || { tail -n 30 "$OUT/build.txt"; exit 1; }
python3 -m pytest -q -p no:cacheprovider tests/python/test_cpp_parity.py tests/python/test_flat_program.py \
    tests/python/test_unary_ops.py 2>&1 | tee "$OUT/parity.txt" | tail -n 15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ -n "${BEFORE:-}" ]; then
    build=()
    [ "${BUILD:-0}" = 1 ] && build=(--build)
    python3 tools/compare_host_overhead.py --before "$BEFORE" --after . --rounds 4 --out-dir "$OUT" "${build[@]}" \
        2>&1 | tee "$OUT/host_overhead.txt" | tail -n 30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
