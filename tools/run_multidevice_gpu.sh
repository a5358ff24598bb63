#!/usr/bin/env bash
# Runs the multi-device checks on one machine with 2 GPUs (NCCL), in order:
#   1. nvidia-smi -L
#   2. python / torch / CUDA / NCCL / launcher versions
#   3. pip install -e . (offline, no deps), only if `import hostir` fails
#   4. tests/python/multidevice under torchrun (2 ranks)
#   5. the same under Open MPI's mpirun (2 ranks)
#   6. examples/sequence_parallel_matmul.py under torchrun and mpirun
#   7. tools/bench_overlap.py under torchrun at two shapes, results copied to $OUT
# Each step writes $OUT/<step>.log and runs under `timeout`, capped so that
# the whole script ends within 9 minutes whatever hangs; a summary of every
# step is printed last and written to $OUT/summary.txt. Leftover test and
# benchmark processes are killed after every launcher step and at exit.
# Exit status: 0 if every step passed.
#
#   OUT=/tmp/out bash tools/run_multidevice_gpu.sh
#
# MPIRUN overrides the launcher path (default /usr/bin/mpirun, Open MPI 4.1).
# Installs nothing from a registry. Sets no NCCL variable (NVLink multicast
# stays as the machine has it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

export PYTHONUNBUFFERED=1
# A collective that waits longer than this for a peer is an error, so a
# desynchronized test fails fast instead of eating the step's time.
export HOSTIR_TIMEOUT=60
# hostir's rendezvous gets a fresh port of its own per step (set below), so
# it never meets a port a killed step left behind nor torchrun's agent
# store; and a loopback address, so nothing depends on resolving the host name.
export HOSTIR_MASTER_ADDR=127.0.0.1

START=$SECONDS
DEADLINE=515  # seconds after start by which every step has ended (9 min = 540 s;
              # the rest is for cleanup and the summary)
KILL_GRACE=5  # after its timeout a step gets SIGTERM, then SIGKILL this much later
export MPIRUN=${MPIRUN:-/usr/bin/mpirun}  # Open MPI 4.1 on the GPU machine
BENCH_TAG=h200x2
BENCH_DIR=benchmarks/results
LEFTOVER_PATTERNS=(
    "pytest -q -p no:cacheprovider tests/python/multidevice"
    "tools/bench_overlap.py"
    "examples/sequence_parallel_matmul.py"
)

SUMMARY=()
FAILED=0

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

kill_leftovers() {
    # Ranks that outlive their launcher (a killed torchrun or mpirun) would
    # hold the GPUs and the ports of the next step.
    local pat found=0
    for pat in "${LEFTOVER_PATTERNS[@]}"; do
        pgrep -f -- "$pat" >/dev/null && found=1 && pkill -TERM -f -- "$pat"
    done
    ((found)) || return 0
    sleep 2
    for pat in "${LEFTOVER_PATTERNS[@]}"; do
        pkill -KILL -f -- "$pat"
    done
    echo "(killed leftover processes)"
}
trap kill_leftovers EXIT

record() {  # record NAME STATUS SECONDS
    SUMMARY+=("$(printf '%-16s %-26s %4ss  %s' "$1" "$2" "$3" "$OUT/$1.log")")
}

# step NAME WANT_SECONDS COMMAND...: run COMMAND under timeout, logging to
# $OUT/NAME.log; WANT_SECONDS is capped by the time left before DEADLINE.
step() {
    local name=$1 want=$2
    shift 2
    local log="$OUT/$name.log"
    local left=$((DEADLINE - (SECONDS - START) - KILL_GRACE))
    local limit=$((want < left ? want : left))
    if ((limit < 10)); then
        echo "=== $name: skipped, no time left" | tee "$log"
        record "$name" "SKIPPED (no time left)" 0
        FAILED=1
        return 1
    fi
    local cmd="$*"
    cmd=${cmd//$'\n'/ }
    ((${#cmd} > 200)) && cmd="${cmd:0:200}..."
    echo "=== $name (limit ${limit}s): $cmd" | tee "$log"
    local t0=$SECONDS rc status
    timeout -k "$KILL_GRACE" "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED (rc=$rc)" ;;
    esac
    ((rc == 0)) || FAILED=1
    record "$name" "$status" $((SECONDS - t0))
    echo "--- $name: $status in $((SECONDS - t0))s; last lines of $log:"
    tail -n "${TAIL_LINES:-6}" "$log" | strip_colors | sed 's/^/    /'
    return $rc
}

strip_colors() {  # pytest colors its output when mpirun gives it a terminal
    sed 's/\x1b\[[0-9;]*m//g'
}

pytest_summary() {  # the result lines pytest printed (one per rank)
    strip_colors <"$1" | grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran|^(=+ )?[0-9]+ errors?' |
        sed 's/^/    /' | tail -n 4
}

# ---------------------------------------------------------------- 1, 2

step nvidia_smi 20 nvidia-smi -L

VERSIONS='
import os, platform, shutil, subprocess, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print("  gpu", i, torch.cuda.get_device_name(i))
print("nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
for mod in ("pytest", "pytest_timeout", "hostir"):
    try:
        print(mod, getattr(__import__(mod), "__version__", "?"))
    except Exception as e:
        print(mod, "not importable:", e)
print("torchrun", shutil.which("torchrun"))
try:
    print(subprocess.run([os.environ["MPIRUN"], "--version"], capture_output=True, text=True).stdout.splitlines()[0])
except Exception as e:
    print("mpirun", os.environ["MPIRUN"], "not runnable:", e)
print("NCCL variables:", {k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
'
TAIL_LINES=20 step versions 60 python3 -c "$VERSIONS"

# ---------------------------------------------------------------- 3

# The machine starts bare: install the package from this tree if it is not
# importable, offline and without dependencies (torch is there already).
if python3 -c "import hostir" 2>/dev/null; then
    record install "ok (already importable)" 0
elif ! step install 90 python3 -m pip install --no-index -e . --no-deps --no-build-isolation ||
    ! python3 -c "import hostir" 2>>"$OUT/install.log"; then
    # Still runnable from the tree; the install failure stays in the summary.
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
    echo "install failed: running from the tree with PYTHONPATH=$PYTHONPATH" | tee -a "$OUT/install.log"
fi

# ---------------------------------------------------------------- 4, 5

PYTEST_ARGS=(-m pytest -q -p no:cacheprovider tests/python/multidevice)
if python3 -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_ARGS+=(--timeout 300)
else
    echo "pytest-timeout missing: running the tests without --timeout" | tee -a "$OUT/versions.log"
fi

# --standalone: torchrun's own rendezvous on a free port, not 29500.
HOSTIR_MASTER_PORT=$(free_port) step tests_torchrun 130 \
    torchrun --standalone --nproc-per-node 2 "${PYTEST_ARGS[@]}"
pytest_summary "$OUT/tests_torchrun.log"
kill_leftovers

# --bind-to none: Open MPI otherwise pins each rank to one core, which the
# Python host work and NCCL's proxy threads share. -x exports the variables
# explicitly (local ranks inherit them anyway).
# PATH and the interpreter's absolute path: mpirun starts ranks with a
# login-like environment where `python3` may be the system one, without torch.
MPI_ENV=(-x PYTHONUNBUFFERED -x HOSTIR_TIMEOUT -x HOSTIR_MASTER_ADDR -x HOSTIR_MASTER_PORT -x PATH)
[ -n "${PYTHONPATH:-}" ] && MPI_ENV+=(-x PYTHONPATH)
[ -n "${VIRTUAL_ENV:-}" ] && MPI_ENV+=(-x VIRTUAL_ENV)
PYTHON=$(command -v python3)
HOSTIR_MASTER_PORT=$(free_port) step tests_mpirun 130 \
    "$MPIRUN" --allow-run-as-root -np 2 --oversubscribe --bind-to none "${MPI_ENV[@]}" \
    "$PYTHON" "${PYTEST_ARGS[@]}"
pytest_summary "$OUT/tests_mpirun.log"
kill_leftovers

# The README's example, unchanged from CPU: NCCL on two GPUs, both launchers.
HOSTIR_MASTER_PORT=$(free_port) TAIL_LINES=3 step example_torchrun 60 \
    torchrun --standalone --nproc-per-node 2 examples/sequence_parallel_matmul.py
kill_leftovers
HOSTIR_MASTER_PORT=$(free_port) TAIL_LINES=3 step example_mpirun 60 \
    "$MPIRUN" --allow-run-as-root -np 2 --oversubscribe --bind-to none "${MPI_ENV[@]}" \
    "$PYTHON" examples/sequence_parallel_matmul.py
kill_leftovers

# ---------------------------------------------------------------- 6

mkdir -p "$BENCH_DIR"
# Two shapes: 16384 rows per rank's shard (the issue's shape read per rank),
# and 8192 (a gathered M of 16384: the shape PERF.md's anchors were taken at).
copied=0
for rows in 16384 8192; do
    tag="${BENCH_TAG}_m${rows}"
    MARKER=$(mktemp)  # results newer than this are this run's
    HOSTIR_MASTER_PORT=$(free_port) TAIL_LINES=16 step "bench_m$rows" 150 \
        torchrun --standalone --nproc-per-node 2 tools/bench_overlap.py --M "$rows" --out-dir "$BENCH_DIR" --tag "$tag"
    kill_leftovers
    # Copied even after a failure: the script rewrites its files after every
    # variant, so a cut-short run leaves the variants it finished.
    for f in "$BENCH_DIR/bench_overlap_$tag.md" "$BENCH_DIR/bench_overlap_$tag.json"; do
        if [ -f "$f" ] && [ "$f" -nt "$MARKER" ]; then
            cp "$f" "$OUT/" && copied=$((copied + 1))
        fi
    done
    rm -f "$MARKER"
done
((copied == 4)) || { echo "bench_overlap: result files missing (copied $copied of 4)"; FAILED=1; }

# ---------------------------------------------------------------- summary

{
    echo "=== summary ($((SECONDS - START))s in all; logs in $OUT)"
    printf '%s\n' "${SUMMARY[@]}"
    echo "tests under torchrun:"
    pytest_summary "$OUT/tests_torchrun.log"
    echo "tests under mpirun:"
    pytest_summary "$OUT/tests_mpirun.log"
    echo "bench results copied to $OUT: $copied of 4 files"
} | tee "$OUT/summary.txt"
exit $FAILED
