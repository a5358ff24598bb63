"""Where the time of one offloaded call goes: torch's profiler on one GPU.

Profiles single calls of `bench_offload`'s stack (LAYERS x HIDDEN² bf16
Linear + GELU, weights in pinned host memory) for each variant named, at
each M, and prints per variant: the device time of each kind of work
(host-to-device copies, GEMMs, elementwise kernels, device-to-device
copies), the device's idle time between the first and last of them, the
host time of the call, and the 25 host ops that took longest. Where the
sequential program is slower than the hand-written one, the idle time and
the extra kinds of work say why.

    PYTHONPATH=python python3 tools/profile_offload.py --m 1 16384
    PYTHONPATH=python python3 tools/profile_offload.py --variants "hand sequential" "hostir sequential" --m 1

Where a variant is slower than another but the profiler shows the same
device work, the time is the host's before the call's first device op
(the device idles, then works alike). Three options tell that apart:

* ``--rounds N --hide-start MS``: the interleaved rounds again with a sleep
  kernel of MS queued before each call, which keeps the device busy while
  the host prepares the call; a difference that vanishes was host time
  before the first device op.
* ``--host-start N``: the host time from the call to its first
  host-to-device copy, from the profiler's CPU events alone, and the last
  call's events up to that copy.
* ``--stages N``: unprofiled stamps of hostir's sequential stack: at the
  call, at `fd.execute`, at the C++ executor's `run` and at its return.

``--cpp`` profiles hostir's calls on the C++ executor, as they run
unprofiled (a watching profiler otherwise makes them take the Python
evaluator), and ``--no-profile`` skips the profiled calls.

Writes profile_offload.txt under $OUT when it is set, else benchmarks/results.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import sys
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hostir  # noqa: E402
from bench_offload import DTYPE, HandWritten, build_stack  # noqa: E402

KINDS = (
    ("H2D copy", ("Memcpy HtoD",)),
    ("D2H copy", ("Memcpy DtoH",)),
    ("D2D copy", ("Memcpy DtoD",)),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90", "xmma")),
    ("memset", ("Memset",)),
)


def kind_of(name: str) -> str:
    for kind, marks in KINDS:
        if any(m.lower() in name.lower() for m in marks):
            return kind
    return "other kernel"


def device_summary(prof) -> list[str]:
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    if not events:
        return ["  no device work recorded"]
    events.sort(key=lambda e: e.time_range.start)
    calls = [e for e in prof.events() if e.name == "call"]
    start = ""
    if calls:
        start = f", first device op {(events[0].time_range.start - calls[0].time_range.start) / 1e3:.3f} ms after the call began"
    by_kind: dict[str, list[float]] = {}
    for e in events:
        by_kind.setdefault(kind_of(e.name), []).append(e.time_range.elapsed_us())
    span = events[-1].time_range.end - events[0].time_range.start
    # Idle: the span less the union of the busy intervals (streams overlap).
    busy, end = 0.0, None
    for e in events:
        s, t = e.time_range.start, e.time_range.end
        if end is None or s >= end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    lines = [f"  device span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms{start}"]
    for kind, times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {kind:<13} {len(times):4d} x, {sum(times) / 1e3:8.3f} ms")
    return lines


def sleep_cycles(ms: float) -> tuple[int, float]:
    """Cycles of `torch.cuda._sleep` that keep the device busy about `ms`,
    and the measured device time of that sleep (the median of 9)."""
    cycles = 1_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # the first call loads the kernel
    torch.cuda.synchronize()
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    cycles = int(cycles * ms / a.elapsed_time(b))
    times = []
    for _ in range(9):
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return cycles, sorted(times)[len(times) // 2]


def rounds(calls, names, x, n, hide_ms: float = 0.0) -> list[str]:
    """Medians over `n` rounds, each running every variant once in turn:
    wall (host clock from the call to the end of its device work), device
    (CUDA events recorded on the current stream before and after the call),
    host (the call's own host time) and the gap wall - device: how long the
    device waited for the call to start its work, plus the events' cost.

    With `hide_ms`, a sleep kernel of about that long is queued right after
    the start event, before the call, and its own time is taken off the
    device time: the call's host time before its first device op is then
    hidden under the sleep, so what is left is the device work alone. A
    difference between variants that goes away with it was host time before
    the first device op."""
    import statistics

    cycles, slept = sleep_cycles(hide_ms) if hide_ms else (0, 0.0)
    for name in names:
        for _ in range(2):
            calls[name](x)
    torch.cuda.synchronize()
    got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for r in range(n):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            a.record()
            if cycles:
                torch.cuda._sleep(cycles)
            calls[name](x)
            b.record()
            host = (time.perf_counter() - start) * 1e3
            b.synchronize()
            wall = (time.perf_counter() - start) * 1e3
            got[name].append((wall - slept, a.elapsed_time(b) - slept, host))
    hidden = f", a {slept:.3f} ms sleep queued before each call and taken off" if cycles else ""
    lines = [f"\n## M={x.shape[0]}: {n} interleaved rounds{hidden}, medians (ms)"]
    for name, ts in got.items():
        wall, dev, host = (statistics.median(t[k] for t in ts) for k in range(3))
        lines.append(f"  {name:<18} wall {wall:8.3f}  device {dev:8.3f}  host {host:7.3f}  wall - device {wall - dev:6.3f}")
    return lines


def host_start(calls, names, x, n, cpp: bool) -> list[str]:
    """The host time from each call's start to the start of its first
    host-to-device copy (`aten::copy_`) and of its first op of any kind,
    from the profiler's CPU events alone (no device tracing): medians over
    `n` calls per variant, in turns."""
    import statistics

    got: dict[str, list[tuple[float, float, str]]] = {name: [] for name in names}
    seen: dict[str, list[str]] = {}
    for r in range(n):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof, unwatched(cpp):
                with torch.profiler.record_function("call"):
                    calls[name](x)
            events = sorted(prof.events(), key=lambda e: e.time_range.start)
            (call,) = [e for e in events if e.name == "call"]
            ops = [e for e in events if e.name.startswith("aten::") and e.time_range.start >= call.time_range.start]
            copy_ = next(e for e in ops if e.name == "aten::copy_")
            got[name].append(
                ((copy_.time_range.start - call.time_range.start) / 1e3, (ops[0].time_range.start - call.time_range.start) / 1e3, ops[0].name)
            )
            seen[name] = [
                f"    {(e.time_range.start - call.time_range.start) / 1e3:7.3f} {e.name} ({e.time_range.elapsed_us():.0f} us)"
                for e in events
                if e.name != "call" and call.time_range.start <= e.time_range.start <= copy_.time_range.end
            ]
    lines = [f"\n## M={x.shape[0]}: host time from the call to its first copy, {n} calls each (CPU events only), medians (ms)"]
    for name, ts in got.items():
        to_copy = statistics.median(t[0] for t in ts)
        to_first = statistics.median(t[1] for t in ts)
        lines.append(f"  {name:<28} first copy {to_copy:7.3f}  first op {to_first:7.3f} ({ts[-1][2]})")
    for name, shown in seen.items():
        lines += [f"  {name}, the last call's events up to its first copy (ms from the call):", *shown]
    return lines


def stages(stack, x, hand, n) -> list[str]:
    """Where the host time of a prepared hostir call goes, unprofiled:
    perf_counter stamps at the call, at `fd.execute`, at the C++
    executor's `run` and at its return (the medians of `n` calls), and the
    hand-written loop's whole host time for comparison. Each stamp is a
    Python wrapper (about 0.2 µs)."""
    import statistics

    fd = stack.fusion(x.dim())
    stack(x)
    (program,) = fd.executor._programs.values()
    evaluator = program.evaluator
    real_execute, real_executor = fd.execute, evaluator._executor
    stamps: dict[str, float] = {}

    class Timed:
        def run(self, *args):
            stamps["C++ run"] = time.perf_counter()
            try:
                return real_executor.run(*args)
            finally:
                stamps["C++ return"] = time.perf_counter()

    def execute(*args, **kwargs):
        stamps["fd.execute"] = time.perf_counter()
        return real_execute(*args, **kwargs)

    got: dict[str, list[float]] = {}
    fd.execute, evaluator._executor = execute, Timed()
    try:
        for _ in range(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            stack(x)
            end = time.perf_counter()
            for name, t in stamps.items():
                got.setdefault(name, []).append((t - start) * 1e6)
            got.setdefault("call returns", []).append((end - start) * 1e6)
            torch.cuda.synchronize()
            start = time.perf_counter()
            hand(x)
            got.setdefault("hand-written loop returns", []).append((time.perf_counter() - start) * 1e6)
    finally:
        del fd.execute
        evaluator._executor = real_executor
    lines = [f"\n## M={x.shape[0]}: host µs from the call (unprofiled, medians of {n})"]
    lines += [f"  {name:<26} {statistics.median(ts):8.1f}" for name, ts in got.items()]
    return lines


@contextlib.contextmanager
def unwatched(hide: bool):
    """With `hide`, hostir does not see the profiler (it would otherwise run
    the call on the Python evaluator, whose ranges the profiler shows), so
    that the profile is of the C++ executor's run, as unprofiled calls run."""
    if not hide:
        yield
        return
    enabled = torch.autograd._profiler_enabled
    torch.autograd._profiler_enabled = lambda: False
    try:
        yield
    finally:
        torch.autograd._profiler_enabled = enabled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16384])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=["hand sequential", "hostir sequential", "hand prefetch", "hostir"])
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time the variants in this many interleaved rounds: host clock to the end of the "
                         "device work, device events around the call, and the host time of the call alone")
    ap.add_argument("--hide-start", type=float, default=0.0, metavar="MS",
                    help="with --rounds, also time rounds with a sleep of MS queued before each call, which "
                         "hides the host time before the call's first device op")
    ap.add_argument("--no-profile", action="store_true", help="the rounds only, no profiled calls")
    ap.add_argument("--cpp", action="store_true",
                    help="profile hostir's calls as they run unprofiled (the C++ executor), not on the Python "
                         "evaluator that a watching profiler makes them take")
    ap.add_argument("--host-start", type=int, default=0, metavar="N",
                    help="also time, from N calls of each variant under the profiler's CPU events alone, the host "
                         "time from the call to its first host-to-device copy")
    ap.add_argument("--stages", type=int, default=0, metavar="N",
                    help="also time, unprofiled, the stages of N calls of hostir's sequential stack")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    cpu_stack = build_stack(args.layers, args.hidden)
    # One set of pinned weights for every variant (see bench_offload).
    pinned_stack = copy.deepcopy(cpu_stack)
    stacks = {
        "hostir": hostir.offload(pinned_stack, device),
        "hostir sequential": hostir.offload(pinned_stack, device, hoist="sequential"),
        "hostir hoisted": hostir.offload(pinned_stack, device, hoist="hoist"),
        "hostir in chunks": hostir.offload(pinned_stack, device, hoist="hoist:chunks=4"),
    }
    pinned = [m.weight.detach() for m in stacks["hostir"].layers if isinstance(m, nn.Linear)]
    hand = HandWritten(pinned, device)
    calls = {
        "hand sequential": hand.sequential,
        "hand sequential, allocating": hand.sequential_allocating,
        "hand prefetch": hand.prefetch,
        "hostir": stacks["hostir"],
        "hostir sequential": stacks["hostir sequential"],
        "hostir hoisted": stacks["hostir hoisted"],
        "hostir in chunks": stacks["hostir in chunks"],
    }
    out = [f"# profile_offload: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
           f"{args.layers} x {args.hidden}² {str(DTYPE).removeprefix('torch.')}"]
    stacks["hostir graph"] = hostir.offload(pinned_stack, device, cuda_graph=True)
    calls["hostir graph"] = stacks["hostir graph"]
    with torch.no_grad():
        for m in args.m:
            x = torch.randn(m, args.hidden, device=device, dtype=DTYPE)
            if args.rounds:
                out += rounds(calls, args.variants, x, args.rounds)
                print("\n".join(out[-len(args.variants) - 1:]), flush=True)
                if args.hide_start:
                    out += rounds(calls, args.variants, x, args.rounds, args.hide_start)
                    print("\n".join(out[-len(args.variants) - 1:]), flush=True)
            if args.stages:
                out += stages(stacks["hostir sequential"], x, hand.sequential, args.stages)
                print("\n".join(out[-7:]), flush=True)
            if args.host_start:
                out += host_start(calls, args.variants, x, args.host_start, args.cpp)
                print("\n".join(out[-len(args.variants) - 1 :]), flush=True)
            if args.no_profile:
                continue
            for name in args.variants:
                fn = calls[name]
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, unwatched(args.cpp):
                    start = time.perf_counter()
                    with torch.profiler.record_function("call"):
                        fn(x)
                    host = (time.perf_counter() - start) * 1e3
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - start) * 1e3
                out.append(f"\n## M={m} {name}: host {host:.3f} ms, call + sync {wall:.3f} ms (under the profiler)")
                if name.startswith("hostir"):
                    out.append(f"  runner: {stacks[name].fusion(x.dim()).last_runner}")
                out += device_summary(prof)
                out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
                print("\n".join(out[-3:]), flush=True)
    text = "\n".join(out) + "\n"
    path = pathlib.Path(args.out_dir) / "profile_offload.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
