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

Writes profile_offload.txt under $OUT when it is set, else benchmarks/results.
"""

from __future__ import annotations

import argparse
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
    lines = [f"  device span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms"]
    for kind, times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {kind:<13} {len(times):4d} x, {sum(times) / 1e3:8.3f} ms")
    return lines


def rounds(calls, names, x, n) -> list[str]:
    """Medians over `n` rounds, each running every variant once in turn:
    wall (host clock from the call to the end of its device work), device
    (CUDA events recorded on the current stream before and after the call),
    host (the call's own host time) and the gap wall - device: how long the
    device waited for the call to start its work, plus the events' cost."""
    import statistics

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
            calls[name](x)
            b.record()
            host = (time.perf_counter() - start) * 1e3
            b.synchronize()
            wall = (time.perf_counter() - start) * 1e3
            got[name].append((wall, a.elapsed_time(b), host))
    lines = [f"\n## M={x.shape[0]}: {n} interleaved rounds, medians (ms)"]
    for name, ts in got.items():
        wall, dev, host = (statistics.median(t[k] for t in ts) for k in range(3))
        lines.append(f"  {name:<18} wall {wall:8.3f}  device {dev:8.3f}  host {host:7.3f}  wall - device {wall - dev:6.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16384])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=["hand sequential", "hostir sequential", "hand prefetch", "hostir"])
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time the variants in this many interleaved rounds: host clock to the end of the "
                         "device work, device events around the call, and the host time of the call alone")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    cpu_stack = build_stack(args.layers, args.hidden)
    stacks = {
        "hostir": hostir.offload(copy.deepcopy(cpu_stack), device),
        "hostir sequential": hostir.offload(copy.deepcopy(cpu_stack), device, hoist="sequential"),
    }
    pinned = [m.weight.detach() for m in stacks["hostir"].layers if isinstance(m, nn.Linear)]
    hand = HandWritten(pinned, device)
    calls = {
        "hand sequential": hand.sequential,
        "hand prefetch": hand.prefetch,
        "hostir": stacks["hostir"],
        "hostir sequential": stacks["hostir sequential"],
    }
    out = [f"# profile_offload: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
           f"{args.layers} x {args.hidden}² {str(DTYPE).removeprefix('torch.')}"]
    stacks["hostir graph"] = hostir.offload(copy.deepcopy(cpu_stack), device, cuda_graph=True)
    calls["hostir graph"] = stacks["hostir graph"]
    with torch.no_grad():
        for m in args.m:
            x = torch.randn(m, args.hidden, device=device, dtype=DTYPE)
            if args.rounds:
                out += rounds(calls, args.variants, x, args.rounds)
                print("\n".join(out[-len(args.variants) - 1:]), flush=True)
            for name in args.variants:
                fn = calls[name]
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    start = time.perf_counter()
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
