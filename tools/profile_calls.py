"""Where the host time of a steady call goes: cProfile over prepared calls.

Under a launcher (`torchrun --nproc-per-node=2 tools/profile_calls.py`), or
on one process for `--case stream_loop`. Each case warms up, then profiles
`--iters` calls on every rank and prints rank 0's top functions by own time
and by cumulative time, with the median host µs per call without the
profiler (the device synchronized before each call, not inside it):

  tiny         the AG+matmul program at x piece [1, 4, 8] (what
               `bench_host_overhead.py --multidevice` times)
  ag           AG+matmul at --M rows per rank, --K, --N (bf16 on CUDA)
  rs           matmul+reduce-scatter at --M total rows, --K, --N
  stream_loop  one device: the stream loop of tiny elementwise ops the
               Python evaluator runs (`bench_host_overhead.py`)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_host_overhead import _sync, build_chain, time_runs  # noqa: E402


def _case(args):
    """(call, device, rank, comm) of the case."""
    from hostir import communicator, overlap

    if args.case == "stream_loop":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        fd = build_chain(16, stream_parallel=True)
        x = torch.randn(8, 8, device=device)
        return (lambda: fd.execute([x], number_of_streams=4, evaluator="python")), device, 0, None
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    comm = communicator.get(backend=backend)
    rank, world = comm.rank, comm.world_size
    device = comm.device if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    kwargs = {"backend": backend, "device": device, "check_ranks": args.check_ranks}
    if args.schedule:
        kwargs["schedule"] = args.schedule
    torch.manual_seed(0)
    if args.case in ("tiny", "ag"):
        m, K, N = (1, 4, 8) if args.case == "tiny" else (args.M, args.K, args.N)
        dtype = torch.float32 if args.case == "tiny" else dtype
        X, W = torch.randn(world, m, K, device=device, dtype=dtype), torch.randn(K, N, device=device, dtype=dtype)
        (x, w), _ = overlap.allgather_matmul_inputs(X, W, rank)
        fd = overlap.allgather_matmul(world, dtype)
        return (lambda: fd.execute([x, w], **kwargs)), device, rank, comm
    A = torch.randn(args.M, args.K, device=device, dtype=dtype)
    B = torch.randn(args.K, args.N, device=device, dtype=dtype)
    (a, b), _ = overlap.matmul_reduce_scatter_inputs(A, B, world, rank)
    fd = overlap.matmul_reduce_scatter(world, dtype)
    return (lambda: fd.execute([a, b], **kwargs)), device, rank, comm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("tiny", "ag", "rs", "stream_loop"), default="tiny")
    p.add_argument("--schedule", default=None, help="execute(schedule=...); default: the planner's choice")
    p.add_argument("--check-ranks", default="always")
    p.add_argument("--M", type=int, default=2048)
    p.add_argument("--K", type=int, default=8192)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--runtime",
        action="store_true",
        help="also torch's profiler over --iters calls: the host time of each CUDA runtime and driver "
        "call (a launch, a copy, an event, a wait that blocks) and of each op, per call",
    )
    args = p.parse_args(argv)
    call, device, rank, comm = _case(args)
    plain = time_runs(call, device, args.iters, warmup=20)
    profile = cProfile.Profile()
    for _ in range(args.iters):
        _sync(device)
        profile.enable()
        call()
        profile.disable()
    _sync(device)
    runtime = _runtime_table(call, device, args) if args.runtime else None
    if comm is not None:
        comm.barrier()
    if rank != 0:
        return 0
    print(f"# {args.case} (schedule {args.schedule or 'auto'}, check_ranks={args.check_ranks}) on {device}")
    print(f"host µs per call without the profiler (median of {args.iters}): {plain:.1f}")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats(key).print_stats(args.top)
        print(f"\n## by {key}, {args.iters} calls\n")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
    if runtime is not None:
        print(f"\n## torch profiler, {args.iters} calls: host time by op and CUDA runtime call\n")
        print(runtime)
    return 0


def _runtime_table(call, device, args) -> str:
    """Torch's profiler over `args.iters` calls on the C++ executor (the
    device synchronized before each, outside the call): host time per op
    and per CUDA runtime or driver call, by own time. A call that blocks the host on the device
    (an event or stream synchronization, a copy that is not asynchronous)
    stands out here, where cProfile sees only the C++ run as a whole."""
    import os

    from torch.profiler import ProfilerActivity, profile, schedule

    # Under a profiler `auto` runs the Python evaluator (its ranges); the
    # C++ executor, the runner of a steady call, is asked for by name. The
    # warm-up calls plan and lower it again outside the profiled ones.
    os.environ["HOSTIR_EVALUATOR"] = "cpp"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    warmup = 5
    tables: list[str] = []

    def ready(prof) -> None:
        tables.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))

    plan = schedule(wait=0, warmup=warmup, active=args.iters, repeat=1)
    with profile(activities=activities, schedule=plan, on_trace_ready=ready) as prof:
        for _ in range(warmup + args.iters):
            _sync(device)
            call()
            prof.step()
        _sync(device)
    return "\n".join(tables) or "(the profiler recorded nothing)"


if __name__ == "__main__":
    sys.exit(main())
