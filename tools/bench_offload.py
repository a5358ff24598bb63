"""Weights streamed from pinned host memory on one GPU, side by side in one run.

The stack: LAYERS layers of HIDDEN x HIDDEN bf16 Linear (no bias) + GELU,
whose weights live in host memory. For each M (rows of the input) it times:

- resident: every weight on the GPU (the compute bound);
- copy alone: the host-to-device copies of every weight, layer by layer,
  from pinned memory into device buffers made beforehand, as the programs
  copy them; timed on the device (CUDA events around the copies, nothing
  else: no allocation, no pinning), at each M beside the other variants
  so that it sees the same clocks. max(resident, copy alone) is then a
  true lower bound: no variant can beat it;
- sequential: copy a layer's weights (pinned), then compute the layer;
- accelerate: `accelerate.cpu_offload` (copies each weight from pageable
  memory before its layer), if accelerate is installed;
- prefetch: a hand-written two-stream prefetch with two weight buffers
  (layer l+1's weights copy on a side stream while layer l computes);
- hostir: `hostir.offload(stack)`, the machine model choosing hoisting or
  the sequential program for each M; eager and as a CUDA-graph replay;
- hostir sequential: hostir's sequential program forced at every M (each
  weight copied on the compute stream, then its layer), to set beside the
  hand-written sequential one (no target: hostir's choice is what counts).

Each time is the median of --iters rounds after --warmup; a round runs
every variant once, in turn (accelerate's in rounds of its own), so that the
copy engine's drift over the run hits every variant alike. Host clock around
one call and a device synchronize. Peak GPU memory is
`torch.cuda.max_memory_allocated()` during a variant's runs, less what was
allocated before the variant set itself up (the input included), so the
resident variant counts its weights and the others their device buffers.
Every variant's result is checked against the resident one.

Targets (PERF.md): hostir <= 1.10x max(resident, copy alone) at every M >=
2048; never slower than sequential; >= 5x faster than accelerate at M=8192;
peak GPU memory <= two layers' weights plus activations, the activations
being what the resident variant holds beyond its weights at that M (its
peak less its weights: activations and the GEMMs' workspace).

Writes offload_<device>.md, .json and .png under $OUT when it is set, else
benchmarks/results/ (or --out-dir). One GPU, one process:

    python tools/bench_offload.py            # the full sweep (about 5 minutes on an H100)
    python tools/bench_offload.py --quick    # a smoke run: small stack, two Ms
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import hostir  # noqa: E402
from hostir import cpp  # noqa: E402

DEFAULT_OUT_DIR = os.environ.get("OUT") or str(ROOT / "benchmarks" / "results")
DTYPE = torch.bfloat16
# hostir's sequential program, forced (not hostir's choice: no target).
FORCED_SEQUENTIAL = "hostir sequential"


@dataclasses.dataclass
class Row:
    m: int
    variant: str
    ms: float | None
    peak_bytes: int | None
    note: str = ""


def build_stack(layers: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden, bias=False), nn.GELU()]
    return nn.Sequential(*mods).to(DTYPE)


def timed_in_rounds(calls: list[tuple[str, Callable[[], object]]], iters: int, warmup: int) -> dict[str, float]:
    """The median ms of each call over `iters` rounds after `warmup`; a
    round runs every call once, in turn, starting one further along each
    round. Host clock around one call and a device synchronize."""
    for _ in range(warmup):
        for _, fn in calls:
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    for r in range(iters):
        for i in range(len(calls)):
            name, fn = calls[(r + i) % len(calls)]
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items() if ts}


@contextlib.contextmanager
def peak_memory(into: dict):
    """`into["bytes"]`: the peak allocated during the block, less what was
    allocated when it started."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    into["bytes"] = torch.cuda.max_memory_allocated() - base


class HandWritten:
    """The sequential and the two-stream prefetch baselines, over pinned
    weights, with two device buffers made once."""

    def __init__(self, weights: list[torch.Tensor], device):
        self.weights = weights
        self.device = device
        self.bufs = [torch.empty_like(weights[0], device=device) for _ in range(2)]
        self.side = torch.cuda.Stream(device)
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def free(self):
        self.bufs = []

    def sequential(self, x):
        for w in self.weights:
            self.bufs[0].copy_(w, non_blocking=True)
            x = torch.nn.functional.gelu(x @ self.bufs[0].t())
        return x

    def sequential_allocating(self, x):
        """`sequential` with a new device buffer per layer, from the caching
        allocator, as hostir's program allocates and frees its weights."""
        for w in self.weights:
            buf = torch.empty_like(w, device=self.device)
            buf.copy_(w, non_blocking=True)
            x = torch.nn.functional.gelu(x @ buf.t())
            del buf
        return x

    def prefetch(self, x):
        main = torch.cuda.current_stream(self.device)
        n = len(self.weights)
        ready = [torch.cuda.Event() for _ in range(n)]
        done = [torch.cuda.Event() for _ in range(n)]

        def load(i):
            with torch.cuda.stream(self.side):
                if i >= 2:
                    self.side.wait_event(done[i - 2])
                self.bufs[i % 2].copy_(self.weights[i], non_blocking=True)
                ready[i].record(self.side)

        self.side.wait_stream(main)
        load(0)
        for i in range(n):
            if i + 1 < n:
                load(i + 1)
            main.wait_event(ready[i])
            x = torch.nn.functional.gelu(x @ self.bufs[i % 2].t())
            done[i].record(main)
        return x

    def copy_alone_ms(self) -> float:
        """The device time of the H2D copies of every weight, layer by
        layer, from pinned memory into the two buffers made beforehand:
        CUDA events around the copies and nothing else."""
        start, end = self.events
        start.record()
        for i, w in enumerate(self.weights):
            self.bufs[i % 2].copy_(w, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def device_timed(run_once: Callable[[], float], iters: int, warmup: int) -> float:
    """The median of `run_once()`'s own device times (ms)."""
    for _ in range(warmup):
        run_once()
    torch.cuda.synchronize()
    times = sorted(run_once() for _ in range(iters))
    return times[len(times) // 2]


def run(args) -> tuple[list[Row], dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    layers, hidden = args.layers, args.hidden
    cpu_stack = build_stack(layers, hidden)
    resident = copy.deepcopy(cpu_stack).to(device)

    # Every hostir variant and the hand-written ones read the same pinned
    # weights: the copy engine's speed differs between pinned allocations
    # (their pages' placement), by up to 3-4% on one H100's host.
    pinned_stack = copy.deepcopy(cpu_stack)
    offloaded = hostir.offload(pinned_stack, device)
    offloaded_graph = hostir.offload(pinned_stack, device, cuda_graph=True)
    offloaded_sequential = hostir.offload(pinned_stack, device, hoist="sequential")
    pinned = [m.weight.detach() for m in offloaded.layers if isinstance(m, nn.Linear)]
    hand = HandWritten(pinned, device)

    accelerate_note = ""
    acc_stack = None
    try:
        import accelerate

        acc_stack = copy.deepcopy(cpu_stack)
        accelerate.cpu_offload(acc_stack, execution_device=device)
        accelerate_version = accelerate.__version__
    except Exception as err:  # noqa: BLE001 - report why the variant is missing
        accelerate_version = None
        accelerate_note = f"unavailable: {type(err).__name__}: {err}"

    weight_bytes = hidden * hidden * torch.finfo(DTYPE).bits // 8
    rows: list[Row] = []
    with torch.no_grad():
        for m in args.m:
            x = torch.randn(m, hidden, device=device, dtype=DTYPE)
            expected = resident(x)
            copy_ms = device_timed(hand.copy_alone_ms, args.iters, max(2, args.warmup))
            rows.append(Row(m, "copy alone", copy_ms, 2 * weight_bytes, f"{layers * weight_bytes / copy_ms / 1e6:.1f} GB/s"))
            variants: list[tuple[str, Callable[[], torch.Tensor], int]] = [
                # (name, call, device bytes held before the runs that belong to the variant)
                ("resident", lambda: resident(x), layers * weight_bytes),
                ("sequential", lambda: hand.sequential(x), 2 * weight_bytes),
                ("prefetch", lambda: hand.prefetch(x), 2 * weight_bytes),
                ("hostir", lambda: offloaded(x), 0),
                ("hostir graph", lambda: offloaded_graph(x), 0),
                # hostir's sequential program, forced: against the hand-written one.
                (FORCED_SEQUENTIAL, lambda: offloaded_sequential(x), 0),
            ]
            if acc_stack is not None:
                variants.insert(3, ("accelerate", lambda: acc_stack(x), 0))
            # Each variant's first call (a CUDA graph's capture included) and
            # one more run inside its own peak-memory window, checked against
            # the resident result; then every variant that ran is timed in
            # rounds, one run of each per round in turn, so that a drift of
            # the copy engine's or the host's speed hits all of them alike.
            ready: list[tuple[str, Callable[[], torch.Tensor]]] = []
            found: dict[str, tuple[float | None, int | None, str]] = {}
            for name, fn, held in variants:
                try:
                    memory: dict = {}
                    with peak_memory(memory):
                        got = fn()
                        torch.testing.assert_close(got.float(), expected.float(), rtol=5e-2, atol=5e-2)
                        del got
                        fn()
                    found[name] = (None, memory["bytes"] + held, "")
                    ready.append((name, fn))
                except Exception as err:  # noqa: BLE001 - one variant's failure is reported, the rest run
                    found[name] = (None, None, f"failed: {type(err).__name__}: {str(err).splitlines()[0]}")
            # accelerate's calls take ~10x the others': timed apart, fewer runs.
            times = timed_in_rounds([(n, f) for n, f in ready if n != "accelerate"], args.iters, args.warmup)
            times.update(timed_in_rounds([(n, f) for n, f in ready if n == "accelerate"], max(2, args.iters // 2), 1))
            for name, _, _ in variants:
                _, peak, note = found[name]
                ms = times.get(name)
                if name == "hostir" and note == "":
                    note = hostir_choice(offloaded, x)
                rows.append(Row(m, name, ms, peak, note))
                print(f"M={m:>6} {name:<13} {'-' if ms is None else f'{ms:9.3f} ms'}  "
                      f"peak {'-' if peak is None else f'{peak / 2**20:8.1f} MiB'}  {note}", flush=True)
            x = expected = None  # free this M's tensors before the next
    hand.free()
    env = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "accelerate": accelerate_version or accelerate_note,
        "hostir": hostir.__version__,
        "cpp_executor": cpp.available(),
        "python": platform.python_version(),
        "layers": layers,
        "hidden": hidden,
        "dtype": str(DTYPE).removeprefix("torch."),
        "weight_bytes": weight_bytes,
        "iters": args.iters,
        "warmup": args.warmup,
        "machine_model": dataclasses.asdict(hostir.machine.machine_model(device)),
    }
    return rows, env


def hostir_choice(offloaded, x) -> str:
    """What hostir runs for this input: sequential, hoisted or in chunks,
    and the machine model's numbers."""
    try:
        h = offloaded.hoisting(x)
    except Exception as err:  # noqa: BLE001 - a note, never a failure of the run
        return f"(choice unknown: {err})"
    if h is None:
        return ""
    how = h.mode if h.chunks == 1 else f"{h.mode} in {h.chunks} chunks"
    return f"{how}: {h.note}" if h.note else how


# ---------------------------------------------------------------- reporting


def by_m(rows: list[Row]) -> dict[int, dict[str, Row]]:
    found: dict[int, dict[str, Row]] = {}
    for r in rows:
        if r.m:
            found.setdefault(r.m, {})[r.variant] = r
    return found


def memory_limit(vs: dict[str, Row], env: dict) -> tuple[int, int] | None:
    """(limit, activations) at one M: two layers' weights plus the
    activations, measured as the resident variant's peak less its weights
    (activations and the GEMMs' workspace); None when resident did not run."""
    res = vs.get("resident")
    if res is None or res.peak_bytes is None:
        return None
    weight = env["weight_bytes"]
    activations = max(0, res.peak_bytes - env["layers"] * weight)
    return 2 * weight + activations, activations


def checks(rows: list[Row], env: dict) -> list[str]:
    lines = []
    for m, vs in sorted(by_m(rows).items()):
        h = vs.get("hostir")
        if h is None or h.ms is None:
            lines.append(f"- M={m}: hostir did not run ({h.note if h else 'missing'})")
            continue
        best = min((v.ms for k, v in vs.items() if k in ("hostir", "hostir graph") and v.ms is not None), default=h.ms)
        res = vs["resident"].ms
        bound = max(res, vs["copy alone"].ms)
        seq = vs["sequential"].ms
        graph = vs.get("hostir graph")
        parts = [f"hostir eager {h.ms:.2f} ms" + (f", graph {graph.ms:.2f} ms" if graph and graph.ms else "")]
        parts.append(f"best {best / bound:.3f}x the bound max(resident, copy)" + (" [target <= 1.10]" if m >= 2048 else ""))
        ok_bound = m < 2048 or best <= 1.10 * bound
        ok_seq = best <= seq
        parts.append(f"best {seq / best:.2f}x faster than sequential [target >= 1.00]")
        forced = vs.get(FORCED_SEQUENTIAL)
        if forced is not None and forced.ms is not None:
            parts.append(f"hostir's sequential program {forced.ms / seq:.3f}x the hand-written one")
        acc = vs.get("accelerate")
        ok_acc = True
        if acc is not None and acc.ms is not None:
            parts.append(f"{acc.ms / best:.1f}x faster than accelerate" + (" [target >= 5]" if m == 8192 else ""))
            ok_acc = m != 8192 or acc.ms >= 5 * best
        found = memory_limit(vs, env)
        if found is None:
            ok_mem = False
            parts.append("no memory limit (the resident variant did not run)")
        else:
            limit, activations = found
            ok_mem = h.peak_bytes is not None and h.peak_bytes <= limit
            peak = "-" if h.peak_bytes is None else f"{h.peak_bytes / 2**20:.1f}"
            parts.append(
                f"eager peak {peak} MiB (limit {limit / 2**20:.1f}: two layers' weights "
                f"+ the resident run's activations {activations / 2**20:.1f})"
            )
        met = "met" if ok_bound and ok_seq and ok_acc and ok_mem else "NOT met"
        lines.append(f"- M={m}: " + "; ".join(parts) + f" -> {met}")
    return lines


def markdown(rows: list[Row], env: dict) -> str:
    ms = sorted(by_m(rows))
    variants = []
    for r in rows:
        if r.m and r.variant not in variants:
            variants.append(r.variant)
    copies = [r for r in rows if r.variant == "copy alone" and r.ms is not None]
    head = "| variant | " + " | ".join(f"M={m}" for m in ms) + " |"
    lines = [
        f"# Weights streamed from pinned host memory: {env['layers']} x {env['hidden']}x{env['hidden']} "
        f"{env['dtype']} Linear+GELU",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), accelerate {env['accelerate']}, "
        f"hostir {env['hostir']} (C++ executor {'built' if env['cpp_executor'] else 'not built'}); "
        f"median of {env['iters']} rounds after {env['warmup']} warm-up, every variant once a round in turn.",
        "",
        "Copy alone: the H2D copies of all weights, layer by layer, from pinned memory into device buffers "
        "made beforehand (device time); "
        + ", ".join(f"M={r.m}: {r.ms:.2f} ms ({r.note})" for r in copies)
        + ".",
        "",
        "Time (ms):",
        "",
        head,
        "|---|" + "---|" * len(ms),
    ]
    table = by_m(rows)
    for v in variants:
        cells = []
        for m in ms:
            r = table[m].get(v)
            cells.append("-" if r is None or r.ms is None else f"{r.ms:.2f}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += ["", "Peak GPU memory (MiB, torch.cuda.max_memory_allocated):", "", head, "|---|" + "---|" * len(ms)]
    for v in variants:
        cells = []
        for m in ms:
            r = table[m].get(v)
            cells.append("-" if r is None or r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    notes = [f"- M={r.m} {r.variant}: {r.note}" for r in rows if r.m and r.note and r.variant != "copy alone"]
    lines += ["", "Targets:", "", *checks(rows, env), "", "Notes:", "", *notes, ""]
    return "\n".join(lines)


def plot(rows: list[Row], env: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # noqa: BLE001
        return f"no plot: {err}"
    table = by_m(rows)
    ms = sorted(table)
    fig, ax = plt.subplots(figsize=(8, 5))
    variants = list(dict.fromkeys(r.variant for r in rows if r.m))
    for v in variants:
        xs = [m for m in ms if table[m].get(v) and table[m][v].ms is not None]
        ax.plot(xs, [table[m][v].ms for m in xs], marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"{env['layers']} x {env['hidden']}^2 {env['dtype']} Linear+GELU, weights in host memory\n{env['device']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def write(rows: list[Row], env: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    safe = "".join(ch if ch.isalnum() else "_" for ch in env["device"]).strip("_")
    stem = os.path.join(out_dir, f"offload_{safe}")
    with open(stem + ".md", "w") as f:
        f.write(markdown(rows, env))
    with open(stem + ".json", "w") as f:
        json.dump({**env, "results": [dataclasses.asdict(r) for r in rows], "targets": checks(rows, env)}, f, indent=2)
    problem = plot(rows, env, stem + ".png")
    written = [stem + ".md", stem + ".json"]
    if problem is None:
        written.append(stem + ".png")
    else:
        print(problem)
    return written


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 layers of 2048, M in 1, 2048, 3 iterations")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="default: $OUT, else benchmarks/results")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.m, args.iters, args.warmup = 3, 2048, [1, 2048], 3, 1
    return args


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        print("bench_offload needs a CUDA device", file=sys.stderr)
        return 2
    args = parse_args(argv)
    rows, env = run(args)
    for path in write(rows, env, args.out_dir):
        print(f"wrote {path}")
    print("\n".join(checks(rows, env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
