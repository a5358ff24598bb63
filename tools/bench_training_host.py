"""Host time of one training step at world size 1: hostir against eager torch.

`tools/bench_training.py` times the Llama pieces on a GPU, where the device
work is large and a slow host hides behind it only if each call's Python is
short. This script measures that Python alone: the same pieces (``mlp`` and
``attn_proj`` of `bench_training`) at tiny shapes on the CPU, one torch
thread, so that the arithmetic is negligible and the host cost of a
forward+backward step is what is timed. Rows, as in `bench_training`:
``eager`` (``nn.Linear`` modules), ``hostir fusion`` (one FusionDefinition
with autograd) and ``hostir.parallel`` (`hostir.parallel.parallelize_module`
on a one-rank mesh, every Linear a hostir program with DTensor parameters).

Each row's time is the median over rounds of the main thread's CPU time per
step (`time.thread_time`: what the host spends, whatever else the machine
runs), beside the wall-clock median and minimum (the rows interleaved round
by round, so that a busy machine slows them alike). Each row also counts
what one steady-state step does beyond the eager step:

* ``copies``: torch ops that copy tensor data (``copy_``, ``clone``,
  ``contiguous`` copies, ``_to_copy``), seen by a dispatch mode;
* ``collectives``: collectives handed to ``torch.distributed`` (``c10d``
  ops);
* ``plans``: calls of the machine model's per-signature choices
  (`planner.plan`), which a
  steady-state call should not make;
* ``dtensor``: DTensor conversions (``from_local``, ``to_local``) made by
  the step, forward and backward.

    PYTHONPATH=python python3 tools/bench_training_host.py
    PYTHONPATH=python python3 tools/bench_training_host.py --rounds 40 --steps 20

It prints a Markdown table and writes ``bench_training_host.md`` and
``.json`` under ``$OUT`` if set, else ``benchmarks/results`` (``--out-dir``
overrides both).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_training  # noqa: E402  (the pieces and the plan, shared)

import hostir  # noqa: E402
from hostir import planner  # noqa: E402

_COPIES = ("aten.copy_", "aten.clone", "aten._to_copy", "aten.contiguous")


class _Counts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the data copies and the collectives of a step's torch ops."""

    def __init__(self):
        super().__init__()
        self.copies = 0
        self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(_COPIES):
            self.copies += 1
        elif name.startswith("c10d."):
            self.collectives += 1
        return func(*args, **(kwargs or {}))


class _Probe:
    """Counts calls of functions by name while active (patched in place)."""

    def __init__(self, targets):
        self.targets = targets  # [(object, attribute name, counter key)]
        self.counts = collections.Counter()
        self._saved = []

    def __enter__(self):
        for owner, name, key in self.targets:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))

            def wrapped(*args, _original=original, _key=key, **kwargs):
                self.counts[_key] += 1
                return _original(*args, **kwargs)

            setattr(owner, name, wrapped)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _probe() -> _Probe:
    from torch.distributed.tensor import DTensor

    targets = [
        (planner, "plan", "plans"),
        (DTensor, "from_local", "dtensor"),
        (DTensor, "to_local", "dtensor"),
    ]
    return _Probe([(o, n, k) for o, n, k in targets if hasattr(o, n)])


def steps_for(kind: str, h: int, i: int, t: int, mesh, dtype=torch.float32, device=torch.device("cpu")) -> dict:
    """The steps of each row for one piece (hidden `h`, intermediate `i`,
    `t` tokens), with their inputs made; the hostir.parallel row on `mesh`."""
    torch.manual_seed(0)
    kv = max(h // 8, 1)
    base = bench_training.MLP(h, i, dtype, device) if kind == "mlp" else bench_training.AttnProj(h, kv, dtype, device)
    x = torch.randn(t, h, dtype=dtype, device=device).requires_grad_()
    grads = [torch.randn_like(o) for o in base(x)]
    steps = {"eager": bench_training.module_step(base, x, grads)}

    fd = bench_training.fusion_of(kind, dtype)
    weights = [p.detach().clone().requires_grad_() for p in base.parameters()]

    def fused():
        x.grad = None
        for w in weights:
            w.grad = None
        torch.autograd.backward(fd.execute([x] + weights), grads)

    steps["hostir fusion"] = fused
    from hostir.parallel import parallelize_module

    m = copy.deepcopy(base)
    parallelize_module(m, mesh, bench_training.plan(kind))
    steps["hostir.parallel"] = bench_training.module_step(m, x, grads)
    return steps


def measure(steps: dict, args) -> dict:
    """Median host µs per step of each row, the rows interleaved."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                step()
            cpu[name].append((time.thread_time() - c0) / args.steps * 1e6)
            times[name].append((time.perf_counter() - t0) / args.steps * 1e6)
    rows = {}
    for name, step in steps.items():
        with _Counts() as copies, _probe() as probe:
            step()
        rows[name] = {
            "cpu_us": statistics.median(cpu[name]),
            "median_us": statistics.median(times[name]),
            "min_us": min(times[name]),
            "copies": copies.copies,
            "collectives": copies.collectives,
            **{k: probe.counts.get(k, 0) for k in ("plans", "dtensor")},
        }
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--kinds", default="mlp,attn_proj")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if hostir.world_size() != 1:
        raise SystemExit("bench_training_host measures world size 1: run it with plain python")
    mesh = hostir.DeviceMesh(range(1)).to_torch("cpu")
    results = {"hidden": args.hidden, "intermediate": args.intermediate, "tokens": args.tokens,
               "torch": torch.__version__, "kinds": {}}
    for kind in args.kinds.split(","):
        results["kinds"][kind] = measure(steps_for(kind, args.hidden, args.intermediate, args.tokens, mesh), args)
    lines = [
        f"# bench_training_host: cpu, one thread, world size 1, float32, tokens {args.tokens}, "
        f"hidden {args.hidden}, intermediate {args.intermediate}",
        "",
        "| layer | variant | CPU µs/step | × eager | wall µs/step (median) | min | copies | collectives | plans | dtensor |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, rows in results["kinds"].items():
        eager = rows["eager"]["cpu_us"]
        for name, r in rows.items():
            lines.append(
                f"| {kind} | {name} | {r['cpu_us']:.0f} | {r['cpu_us'] / eager:.2f} | {r['median_us']:.0f} | "
                f"{r['min_us']:.0f} | "
                f"{r['copies']} | {r['collectives']} | {r['plans']} | {r['dtensor']} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(args.out_dir or os.environ.get("OUT") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_training_host.md").write_text(text)
    (out / "bench_training_host.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
