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
  moe          one expert-parallel MoE layer (`hostir.moe.MoELayer`, the
               shapes of `bench_moe.py`: hidden 4096, ffn 1536, top 8,
               bf16 on CUDA), `--form` padded, exact or exact_ring, at
               `--tokens` per rank, `--experts`, `--capacity-factor`;
               `--mode fwd+bwd` runs its backward too (autograd, as a
               training step calls it)

Optional tables after the profiles: `--syncs` (what in one call makes the
host wait for the device: torch's synchronizing calls, with where they were
made, and the caching allocator's retries and frees to the driver, which
synchronize too), `--runtime` (torch's profiler: host
time per op and CUDA runtime call), `--launches` (per call, when its first
launch leaves the host and its first kernel starts on the device, and one
call event by event), `--waits` (per rank, each call's entry against the
first rank's, one host clock, and how long its step's collect waited;
`--barrier` meets the ranks before each call, as `bench_overlap.py` does).
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
    if args.case == "moe":
        return _moe_case(args, backend)
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


def _moe_case(args, backend: str):
    """One MoE layer's call on this rank (see the module's doc): the
    routing (softmax of random scores, top-k, renormalized, as
    `bench_moe.route`) made once, outside the call."""
    from hostir import DeviceMesh, communicator
    from hostir.moe import MoELayer

    comm = communicator.get(backend=backend)
    rank, world = comm.rank, comm.world_size
    cuda = backend == "nccl"
    device = comm.device if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    T, H, F, E, k = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    gen = torch.Generator(device=device).manual_seed(rank)

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = normal(T, H).requires_grad_()
    probs = torch.softmax((x.detach() @ normal(E, H, scale=H**-0.5).t()).float(), dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).requires_grad_()
    gate_up = normal(E // world, 2 * F, H, scale=H**-0.5).requires_grad_()
    down = normal(E // world, H, F, scale=F**-0.5).requires_grad_()
    grad = normal(T, H)
    kwargs = {"backend": backend, "check_ranks": args.check_ranks}
    if args.schedule:
        kwargs["schedule"] = args.schedule
    form = {"padded": {}, "exact": {"exact": True}, "exact_ring": {"exact": True, "overlap": True}}[args.form]
    layer = MoELayer(DeviceMesh(range(world)), E, capacity_factor=args.capacity_factor, **form, **kwargs)
    params = (x, weights, gate_up, down)

    def call():
        if args.mode == "fwd":
            with torch.no_grad():
                return layer(x, indices, weights, gate_up, down)
        for p in params:
            p.grad = None
        out = layer(x, indices, weights, gate_up, down)
        torch.autograd.backward(out, grad)
        return out

    return call, device, rank, comm


def _sync_table(call, device) -> str:
    """One call under torch's synchronization debugging (each synchronizing
    call torch makes, with the frames of its caller in hostir and torch's
    Python), and the caching allocator's counters over that call: a retry
    (an allocation that freed the cache and tried again) or a free to the
    driver synchronizes the device too. The C++ executor's own
    synchronizations show in `--runtime`, not here."""
    import traceback
    import warnings

    if device.type != "cuda":
        return "(no CUDA device: nothing synchronizes)"
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    call()
    _sync(device)
    before = torch.cuda.memory_stats(device)
    sites: dict[str, int] = {}

    def seen(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))
        if "prototype feature" in str(message):
            return
        text = f"{str(message).splitlines()[0][:80]} at {where}"
        sites[text] = sites.get(text, 0) + 1

    shown = warnings.showwarning
    warnings.showwarning = seen
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = shown
    _sync(device)
    after = torch.cuda.memory_stats(device)
    out = ["| allocator counter, one call | count |", "|---|---:|"]
    out += [f"| {key} | {after.get(key, 0) - before.get(key, 0)} |" for key in keys]
    out += ["", f"peak allocated: {after.get('allocated_bytes.all.peak', 0) / 2**30:.2f} GiB", ""]
    if not sites:
        out.append("torch made no synchronizing call")
    else:
        out += ["| synchronizing call (where) | times |", "|---|---:|"]
        out += [f"| {text} | {n} |" for text, n in sorted(sites.items(), key=lambda kv: -kv[1])]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("tiny", "ag", "rs", "stream_loop", "moe"), default="tiny")
    p.add_argument("--form", choices=("padded", "exact", "exact_ring"), default="exact_ring", help="moe: the form")
    p.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd", help="moe: the forward alone or both")
    p.add_argument("--tokens", type=int, default=8192, help="moe: tokens per rank")
    p.add_argument("--hidden", type=int, default=4096, help="moe")
    p.add_argument("--ffn", type=int, default=1536, help="moe")
    p.add_argument("--experts", type=int, default=64, help="moe: experts in all")
    p.add_argument("--topk", type=int, default=8, help="moe")
    p.add_argument("--capacity-factor", type=float, default=2.0, help="moe")
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
    p.add_argument(
        "--launches",
        action="store_true",
        help="also where in a call its device work starts: per call, the host µs from the call's entry to its "
        "first launch and the device µs to its first kernel (medians), and one call's ops, runtime calls and "
        "kernels in order (torch's profiler, C++ executor)",
    )
    p.add_argument(
        "--shapes",
        action="store_true",
        help="with --runtime: also a table of the ops apart by their operands' shapes, by device time",
    )
    p.add_argument(
        "--syncs",
        action="store_true",
        help="also what in one call makes the host wait for the device: torch's synchronizing calls and where "
        "they were made, and the caching allocator's retries and frees to the driver",
    )
    p.add_argument(
        "--waits",
        action="store_true",
        help="also, per call and rank, when it entered (against rank 0's entry, one host clock) and how long "
        "it waited to collect the ranks' steps (check_ranks=always through the mailbox), medians per rank",
    )
    p.add_argument(
        "--barrier",
        action="store_true",
        help="with --waits: the ranks meet at a barrier after the device is synchronized, before each call "
        "(as bench_overlap.py times them)",
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
    syncs = _sync_table(call, device) if args.syncs else None
    runtime = _runtime_table(call, device, args) if args.runtime else None
    launches = _launch_table(call, device, args) if args.launches else None
    waits = _wait_table(call, device, comm, args) if args.waits and comm is not None else None
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
    if syncs is not None:
        print("\n## what makes one call wait for the device\n")
        print(syncs)
    if runtime is not None:
        print(f"\n## torch profiler, {args.iters} calls: host time by op and CUDA runtime call\n")
        print(runtime)
    if waits is not None:
        print(f"\n## entries and step waits, {args.iters} calls\n")
        print(waits)
    if launches is not None:
        print(f"\n## where a call's device work starts, {args.iters} calls (torch's profiler)\n")
        print(launches)
    return 0


def _runtime_table(call, device, args) -> str:
    """Torch's profiler over `args.iters` calls on the C++ executor (the
    device synchronized before each, outside the call): host time per op
    and per CUDA runtime or driver call, by own time (and on a GPU, a
    second table by device time). A call that blocks the host on the device
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
        averages = prof.key_averages()
        tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if device.type == "cuda":
            tables.append("\nBy device time (kernels and the ops that launched them):\n")
            tables.append(averages.table(sort_by="self_device_time_total", row_limit=args.top))
        if args.shapes:
            tables.append("\nBy device time, the ops apart by their operands' shapes:\n")
            by_shape = prof.key_averages(group_by_input_shape=True)
            key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            tables.append(by_shape.table(sort_by=key, row_limit=args.top, max_name_column_width=40))

    plan = schedule(wait=0, warmup=warmup, active=args.iters, repeat=1)
    with profile(activities=activities, schedule=plan, on_trace_ready=ready, record_shapes=args.shapes) as prof:
        for _ in range(warmup + args.iters):
            _sync(device)
            call()
            prof.step()
        _sync(device)
    return "\n".join(tables) or "(the profiler recorded nothing)"


def _wait_table(call, device, comm, args) -> str:
    """Every rank's entry time of each call (time.perf_counter: one
    monotonic clock for the processes of one host) and the time its step's
    collect took, gathered to every rank; medians per rank of the entry's
    lag behind the first rank to enter, of the wait, and of the entry to
    the collect's start."""
    import statistics
    import time

    from hostir import mailbox

    spans: list[tuple[float, float]] = []
    plain = mailbox.Mailbox.collect

    def timed(self, k, n):
        start = time.perf_counter()
        try:
            return plain(self, k, n)
        finally:
            spans.append((start, time.perf_counter()))

    entries: list[float] = []
    mailbox.Mailbox.collect = timed
    try:
        for _ in range(args.iters):
            _sync(device)
            if args.barrier:
                comm.barrier()
            entries.append(time.perf_counter())
            before = len(spans)
            call()
            if len(spans) == before:
                spans.append((float("nan"), float("nan")))
            elif len(spans) > before + 1:
                del spans[before + 1 :]
        _sync(device)
    finally:
        mailbox.Mailbox.collect = plain
    mine = torch.tensor([[e, s, t] for e, (s, t) in zip(entries, spans)], dtype=torch.float64)
    words = comm.all_gather_words(mine.view(torch.int64).view(-1)).view(torch.float64)
    rows = words.view(comm.world_size, args.iters, 3)
    first = rows[:, :, 0].min(dim=0).values
    out = [
        "| rank | entry after the first (µs) | entry to collect (µs) | collect waits (µs) |",
        "|---:|---:|---:|---:|",
    ]
    for r in range(comm.world_size):
        lag = ((rows[r, :, 0] - first) * 1e6).tolist()
        reach = ((rows[r, :, 1] - rows[r, :, 0]) * 1e6).tolist()
        wait = ((rows[r, :, 2] - rows[r, :, 1]) * 1e6).tolist()
        out.append(
            f"| {r} | {statistics.median(lag):.1f} | {statistics.median(reach):.1f} | {statistics.median(wait):.1f} |"
        )
    return "\n".join(out)


def _launch_table(call, device, args) -> str:
    """Per profiled call (each inside a `record_function` range): the host
    µs from its entry to its first launch (a kernel, copy or memory
    operation), and the µs from its entry to its first kernel's start on
    the device, to its last kernel's end, and to its return on the host
    (medians, with the profiler's own cost in them); then the call at the
    median first-kernel time, event by event. The host and device clocks
    of torch's trace are aligned."""
    import json
    import os
    import statistics
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ["HOSTIR_EVALUATOR"] = "cpp"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(5):
        call()
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(args.iters):
            _sync(device)
            with record_function("hostir_call"):
                call()
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    calls = sorted(
        (e for e in events if e["name"] == "hostir_call" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"]
    )
    if not calls:
        return "(the profiler recorded no call)"
    device_cats = ("kernel", "gpu_memcpy", "gpu_memset")
    launch_words = ("Launch", "Memcpy", "Memset", "StreamWriteValue", "StreamWaitValue", "EventRecord")
    rows = []
    for i, c in enumerate(calls):
        start, end = c["ts"], c["ts"] + c["dur"]
        stop = calls[i + 1]["ts"] if i + 1 < len(calls) else float("inf")
        host = [e for e in events if start <= e["ts"] <= end and e.get("cat") in ("cuda_runtime", "cuda_driver")]
        launches = [e for e in host if any(w in e["name"] for w in launch_words)]
        work = [e for e in events if e.get("cat") in device_cats and start <= e["ts"] < stop]
        rows.append(
            {
                "first_launch": (min(e["ts"] for e in launches) - start) if launches else float("nan"),
                "first_kernel": (min(e["ts"] for e in work) - start) if work else float("nan"),
                "last_end": (max(e["ts"] + e["dur"] for e in work) - start) if work else float("nan"),
                "host": c["dur"],
                "call": c,
                "stop": stop,
            }
        )
    out = ["| µs from the call's entry (median of %d) | |" % len(rows), "|---|---:|"]
    for key, label in (
        ("first_launch", "first launch on the host"),
        ("first_kernel", "first kernel starts"),
        ("last_end", "last kernel ends"),
        ("host", "call returns"),
    ):
        out.append(f"| {label} | {statistics.median(r[key] for r in rows):.1f} |")
    median = sorted(rows, key=lambda r: r["first_kernel"])[len(rows) // 2]
    start, end, stop = median["call"]["ts"], median["call"]["ts"] + median["call"]["dur"], median["stop"]
    shown = [
        e
        for e in events
        if e is not median["call"]
        and (
            (start <= e["ts"] <= end and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"))
            or (e.get("cat") in device_cats and start <= e["ts"] < stop)
        )
    ]
    out += [
        "",
        "One call, event by event (start and duration in µs; device rows marked *):",
        "",
        "| start | dur | event |",
        "|---:|---:|---|",
    ]
    for e in sorted(shown, key=lambda e: e["ts"]):
        mark = "*" if e.get("cat") in device_cats else ""
        out.append(f"| {e['ts'] - start:.1f} | {e['dur']:.1f} | {mark}{e['name'][:90]} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
