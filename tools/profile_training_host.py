"""Where a training step's host time goes, on the CPU or a GPU.

Runs the rows of `tools/bench_training_host.py` (``eager``, ``hostir
fusion`` and ``hostir.parallel``, as in `tools/bench_training.py`) on the
CPU or a GPU at small shapes, so that the device keeps up and each
step's time is its host time, and reports the host µs per step of every
row (steps issued back to back, one synchronization at the end of each
round). With ``--loop SECONDS`` it then runs only ``--row``'s steps for
that long, for a sampling profiler attached from outside, such as

    py-spy record --native -f raw -o steps.txt -- \\
        python3 tools/profile_training_host.py --device cuda --row hostir.parallel --loop 10

and ``--summarize steps.txt`` prints, from such a raw file, the share of the
samples inside the loop that each function (with what it calls) takes.

    PYTHONPATH=python python3 tools/profile_training_host.py --device cuda --kind attn_proj
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_training_host import steps_for  # noqa: E402

import hostir  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(path: str, marker: str = "loop (profile_training_host.py", top: int = 60) -> None:
    """The share of the samples inside `--loop` each function takes (with
    its callees), from py-spy's raw output."""
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in open(path):
        stack, count = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        if not any(f.startswith(marker) for f in frames):
            continue
        n = int(count)
        total += n
        for name in {re.sub(r":\d+\)", ")", f) for f in frames}:
            inclusive[name] += n
    print(f"{total} samples in the loop")
    for name, n in inclusive.most_common(top):
        print(f"{100 * n / total:5.1f}%  {name[:160]}")


def loop(step, seconds: float, device: torch.device) -> int:
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            step()
        sync(device)
        n += 20
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kind", default="attn_proj", choices=["attn_proj", "mlp"])
    ap.add_argument("--shape", default="256,512,64", help="hidden,intermediate,tokens")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--row", default="hostir.parallel")
    ap.add_argument("--loop", type=float, default=0.0, help="then run --row's steps this many seconds")
    ap.add_argument("--summarize", default=None, help="print the shares in a py-spy raw file and exit")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    h, i, t = (int(v) for v in args.shape.split(","))
    steps = steps_for(args.kind, h, i, t, hostir.DeviceMesh(range(1)).to_torch(device.type), dtype, device)
    for step in steps.values():
        for _ in range(5):
            step()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(device)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e6)
    eager = statistics.median(times["eager"])
    print(f"{args.kind} on {device} ({dtype}, hidden {h}, intermediate {i}, tokens {t}): µs per step")
    for name, ts in times.items():
        print(f"  {name:16s} median {statistics.median(ts):8.1f}  min {min(ts):8.1f}  "
              f"x eager {statistics.median(ts) / eager:5.2f}")
    if args.loop:
        n = loop(steps[args.row], args.loop, device)
        print(f"looped {n} steps of {args.row}")


if __name__ == "__main__":
    main()
