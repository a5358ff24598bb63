#!/usr/bin/env bash
# Host µs per steady-state multi-device execute on one GPU, two ranks sharing
# it on the `cuda` copy-engine transport (tools/bench_host_overhead.py
# --multidevice), twice: with the steps of check_ranks="always" on the gloo
# control group (HOSTIR_MAILBOX=0) and through the shared-memory mailbox
# (the default on one host). Writes host_overhead_multidevice_cuda_np2.md and
# .json under $OUT/steps_gloo and $OUT/steps_mailbox (default
# benchmarks/results), each run's log beside them. A minute or two.
# Extra arguments go to the bench.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
for steps in gloo mailbox; do
    dir="$OUT/steps_$steps"
    mkdir -p "$dir"
    mailbox=1
    [ "$steps" = gloo ] && mailbox=0
    HOSTIR_MAILBOX=$mailbox timeout 280 torchrun --standalone --nproc-per-node 2 \
        tools/bench_host_overhead.py --multidevice --device cuda --out-dir "$dir" "$@" 2>&1 | tee "$dir/bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
