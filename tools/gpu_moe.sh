#!/usr/bin/env bash
# The expert-parallel MoE layer on a machine of 2 or more GPUs, in one go:
# build the C++ executor, run its multi-device tests (NCCL and the copy
# engine's `cuda` transport) and goldens, bench_moe.py --check, then
# bench_moe.py itself, then one traced forward per form (trace_moe.py) drawn
# as timelines. Logs and results under $2 (default $OUT/moe); $1 the parts,
# a comma list of build, tests, unit, bench, before, profile, trace (default
# build,tests,bench: calls made in quick succession keep the machine and its
# build). `unit`: the one-process GPU tests of the layer's ops (shape,
# index and grouped ops, autodiff, goldens with the one-GPU graph replay).
# `before`: the same bench_moe.py run on an older checkout, $HOSTIR_BEFORE
# (default .before, e.g. `git archive <rev> | tar -x -C .before`), built
# first, its results under $2/before: before and after in one lease.
# `profile`: where a walked exact layer's steady forward+backward spends
# its device time, op by op and by operand shape (profile_calls.py --case
# moe, 8192 tokens a rank, 64 experts, capacity factor 2, on the copy
# engine where there are 2 GPUs or more), into $2/profile_exact_ring.log.
#   bash tools/gpu_moe.sh [parts] [out-dir] [bench_moe.py arguments...]
set -u
parts=${1:-build,tests,bench}; shift || true
out=${1:-${OUT:-/tmp}/moe}; shift || true
has() { [[ ",$parts," == *",$1,"* ]]; }
mkdir -p "$out"
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
export PYTHONPATH=$PWD/python:$PWD/tests/python
step() {  # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" setsid "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s"
}
has build && step build 400 env MAX_JOBS=16 python3 setup.py build_ext --inplace
if has tests; then
step goldens 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_moe_goldens.py tests/python/test_index_ops.py
for transport in nccl cuda; do
  extra=(); [ "$transport" = cuda ] && extra=(env HOSTIR_TEST_TRANSPORT=cuda)
  step "tests_$transport" 300 "${extra[@]}" torchrun --standalone --nproc-per-node "$n" --no-python \
    python3 -m pytest -q -p no:cacheprovider --timeout=240 \
    tests/python/multidevice/test_moe.py tests/python/multidevice/test_nvfuser_rs_matmul.py
done
step bench_check 300 python3 tools/bench_moe.py --check --out-dir "$out/check"
fi
if has unit; then
step unit 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_shape_ops.py tests/python/test_index_ops.py \
  tests/python/test_autodiff.py tests/python/test_moe_goldens.py tests/python/test_summed_products.py
fi
has bench && step bench 560 python3 tools/bench_moe.py --out-dir "$out" --time-limit 540 "$@"
if has before; then
  before=$(cd "${HOSTIR_BEFORE:-.before}" && pwd)
  (cd "$before" && step build_before 400 env MAX_JOBS=16 python3 setup.py build_ext --inplace)
  mkdir -p "$out/before"
  step bench_before 560 env PYTHONPATH="$before/python:$before/tests/python" \
    python3 "$before/tools/bench_moe.py" --out-dir "$out/before" --time-limit 540 "$@"
fi
if has profile; then
  schedule=(); [ "$n" -gt 1 ] && schedule=(--schedule ring:transport=cuda)
  step profile_exact_ring 240 torchrun --standalone --nproc-per-node "$n" tools/profile_calls.py --case moe \
    --form exact_ring --tokens 8192 --experts 64 --capacity-factor 2 --iters 5 --top 45 --runtime --shapes \
    ${schedule[@]+"${schedule[@]}"}
fi
if has trace; then
  step trace 240 torchrun --standalone --nproc-per-node "$n" tools/trace_moe.py "$out/trace"
  for form in "$out"/trace/*/; do
    name=$(basename "$form")
    step "plot_$name" 120 python3 tools/plot_timeline.py "$form" -o "$out/timeline_moe_$name.png"
  done
fi
tail -n 3 "$out"/*.log
