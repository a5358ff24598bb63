"""Host time before the first device op of a prepared single-device call.

Times, on the offloaded stack of `hostir.offload` run with its sequential
program (each weight copied on the compute stream, then the layer), the
host (CPU wall-clock) microseconds from the call `module(x)` to the start
of the program's first transfer (the first device op: the copy of layer
0's weight), and the whole call, against the same work written by hand
(copy each weight, then `linear` and `gelu`): the hand-written loop's
first op is its first copy, so its prologue is ~0.

The first transfer is seen by a measuring hook put in front of the Python
evaluator's `Transfer` handler for this script only (the library has no
such hook): it records `time.perf_counter()` at its first op of each call.
Every timed call repeats the signature of the first, so it is a prepared
call (`hostir.runtime.prepared`). On CUDA, the device is synchronized
before each timed call, not inside it, so the numbers are host time.

Three variants: ``hostir`` as it runs; ``hostir, nothing kept`` with what
a prepared call keeps between calls to start sooner (the stack's detached
weights, `OffloadedStack.host_tensors`, and the evaluator's extents per
shape, `HostIrEvaluator.bound_extents`) dropped before every timed call,
so that it redoes that work as every call did before they were kept; and
the hand-written loop. (On a checkout without them the two hostir rows
time the same thing.)

The variants are interleaved: each round times every variant `--iters`
times, and the medians over all rounds are reported, so that a noisy host
moves every variant alike.

Run from the repository root:

    PYTHONPATH=python python3 tools/bench_prologue.py
    PYTHONPATH=python python3 tools/bench_prologue.py --device cpu --features 256 --rows 4

It prints a markdown table and writes `prologue_<device-type>.md` and
`.json` under `$OUT` when it is set, else `benchmarks/results/`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import hostir
from hostir import ir
from hostir.runtime import evaluator


class _FirstTransfer:
    """The measuring hook: the time of the first Transfer of each call."""

    def __init__(self):
        self.at: float | None = None
        self._handler = evaluator._HANDLERS[ir.Transfer]
        evaluator._HANDLERS[ir.Transfer] = self._seen

    def _seen(self, frame, e):
        if self.at is None:
            self.at = time.perf_counter()
        self._handler(frame, e)

    def remove(self) -> None:
        evaluator._HANDLERS[ir.Transfer] = self._handler


def _stack(layers: int, features: int, dtype: torch.dtype) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(features, features, bias=False, dtype=dtype), nn.GELU()]
    return nn.Sequential(*mods)


def _hand_written(stack: nn.Sequential, device: torch.device):
    """The sequential loop by hand: copy each weight, then the layer."""
    weights = [m.weight.detach().to("cpu") for m in stack if isinstance(m, nn.Linear)]
    if device.type == "cuda":
        weights = [w.pin_memory() for w in weights]

    def run(x):
        for w in weights:
            on_device = torch.empty_like(w, device=device)
            on_device.copy_(w, non_blocking=True)
            x = torch.nn.functional.gelu(torch.nn.functional.linear(x, on_device))
        return x

    return run


def _forget(stack) -> None:
    """Drop what the stack and its programs' evaluators keep between calls."""
    if hasattr(stack, "_host_kept"):
        stack._host_kept = None
    for fd in stack._fusions.values():
        for program in fd.executor._programs.values():
            kept = getattr(program.evaluator, "bound_extents", None)
            if kept is not None:
                kept.clear()


def _time(seq, x, hook, sync, forget: bool) -> tuple[float, float]:
    """Host µs of one call: to its first transfer, and whole."""
    if forget:
        _forget(seq)
    sync()
    hook.at = None
    start = time.perf_counter()
    seq(x)
    end = time.perf_counter()
    return (hook.at - start) * 1e6, (end - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--features", type=int, default=None, help="default: 8192 on CUDA, 256 on the CPU")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 1024])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    features = args.features or (8192 if cuda else 256)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(0)
    stack = _stack(args.layers, features, dtype)
    hand = _hand_written(stack, device)
    seq = hostir.offload(copy.deepcopy(stack), device, hoist="sequential")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    hook = _FirstTransfer()
    rows = []
    try:
        with torch.no_grad():
            for m in args.rows:
                x = torch.randn(m, features, dtype=dtype, device=device)
                torch.testing.assert_close(seq(x), hand(x), rtol=2e-2, atol=2e-2)
                for _ in range(5):
                    seq(x)
                    hand(x)
                sync()
                first, call_h, first_f, call_f, call_e = [], [], [], [], []
                for _ in range(args.rounds):
                    for _ in range(args.iters):
                        a, b = _time(seq, x, hook, sync, False)
                        first.append(a)
                        call_h.append(b)
                    for _ in range(args.iters):
                        a, b = _time(seq, x, hook, sync, True)
                        first_f.append(a)
                        call_f.append(b)
                    for _ in range(args.iters):
                        sync()
                        start = time.perf_counter()
                        hand(x)
                        call_e.append((time.perf_counter() - start) * 1e6)
                rows.append({
                    "rows": m,
                    "hostir_first_transfer_us": statistics.median(first),
                    "hostir_call_host_us": statistics.median(call_h),
                    "nothing_kept_first_transfer_us": statistics.median(first_f),
                    "nothing_kept_call_host_us": statistics.median(call_f),
                    "hand_written_call_host_us": statistics.median(call_e),
                    "calls": len(first),
                })
    finally:
        hook.remove()
    head = (
        f"# Host time before the first device op: offloaded stack, sequential program\n\n"
        f"{args.layers} x Linear({features}, {features}, bias=False) + GELU, {dtype}, on {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}; host {platform.processor() or platform.machine()}; "
        f"medians of {args.rounds} rounds x {args.iters} calls, host µs (CPU wall-clock)\n"
    )
    lines = [
        head,
        "| M | hostir: call -> first transfer | nothing kept: call -> first transfer | hostir: whole call "
        "| nothing kept: whole call | hand-written: whole call |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['hostir_first_transfer_us']:.1f} | {r['nothing_kept_first_transfer_us']:.1f} | "
            f"{r['hostir_call_host_us']:.1f} | {r['nothing_kept_call_host_us']:.1f} | "
            f"{r['hand_written_call_host_us']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir or os.environ.get("OUT") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prologue_{device.type}.md").write_text(text)
    meta = {"device": str(device), "layers": args.layers, "features": features, "dtype": str(dtype),
            "iters": args.iters, "rounds": args.rounds, "torch": torch.__version__}
    (out / f"prologue_{device.type}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
