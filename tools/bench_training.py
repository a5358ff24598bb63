"""Forward+backward of Llama layers: hostir against eager torch and torch's TP.

Times one training step's forward and backward (no optimizer) of two
Llama-70B-shaped pieces, in bf16 by default:

* ``mlp``: ``down(silu(gate(x)) * up(x))``, hidden H, intermediate I;
* ``attn_proj``: the attention projections ``q(x), k(x), v(x)`` and
  ``o(q)`` (the attention core left out: its kernels are torch's either way).

Rows, each where it runs:

* ``eager``: the layers as ``nn.Linear`` modules, torch autograd;
* ``hostir fusion``: the whole piece as one FusionDefinition; `fd.execute`
  on inputs requiring grad records one node whose backward runs the derived
  backward program;
* ``hostir.parallel``: the modules parallelized with
  ``hostir.parallel.parallelize_module`` (colwise gate/up/q/k/v, rowwise
  down/o), each set of colwise siblings reading one input (q, k, v; gate,
  up) one program;
* ``hostir.parallel ungrouped``: the same with ``group_siblings=False``:
  every Linear a program of its own;
* ``torch TP``: the same plan through torch's ``parallelize_module`` (DTensor);
* ``torch async-TP``: torch's plan under ``torch.compile`` with symmetric
  memory's micro-pipelined TP (``torch._inductor.config._micro_pipeline_tp``
  and symmetric memory enabled for the group, as torch's docs set it up),
  which needs at least 2 ranks and CUDA; elsewhere the row is skipped and
  says why.

Two plans (``--plans``), each row above where it applies:

* ``tp``: the layers take the whole activation ``[tokens, H]``, colwise
  gate/up/q/k/v and rowwise down/o with torch's default layouts (an
  Allreduce completes the rowwise output);
* ``sp``: sequence parallelism as torchtitan plans it: the activation
  ``[1, tokens, H]`` sharded on the sequence, an RMSNorm before the layer
  under ``SequenceParallel``, gate/up/q/k/v ``ColwiseParallel(input_layouts=
  Shard(1))`` and down/o ``RowwiseParallel(output_layouts=Shard(1))``: the
  all-gather before each colwise GEMM and the reduce-scatter after the
  rowwise one are where torch's async-TP fuses AG+matmul and matmul+RS and
  where ``hostir.parallel`` runs its rings. The ``eager`` row is the whole
  layer, norm included, on one GPU; there is no ``hostir fusion`` row.

At world size 1 (plain ``python3``), the target is hostir ≤ 1.05× eager.
Under ``torchrun`` with more ranks, the TP rows shard over them (eager and
the fusion row stay single-GPU references on each rank).

    PYTHONPATH=python python3 tools/bench_training.py                 # H100/H200, bf16, H=8192
    PYTHONPATH=python python3 tools/bench_training.py --device cpu --hidden 256 --intermediate 512 --tokens 64 --dtype float32
    torchrun --standalone --nproc-per-node 2 tools/bench_training.py --plans tp,sp      # 2 GPUs
    mpirun -np 2 python3 tools/bench_training.py --cpu                                # 2 gloo ranks, small shapes

Each timing is the median over ``--iters`` steps after ``--warmup`` (CUDA
events on a GPU, wall clock on the CPU), the rows timed in interleaved
rounds (each round runs every row's step once, in turn), so that a GPU
slowing as it warms up does not favour the rows timed first; ``host ms`` is the median time the
host takes to issue a step's work (a step whose host ms reaches its fwd+bwd
ms is host-bound). Rank 0 prints a Markdown table and
writes ``bench_training_<tag>.md`` and ``.json`` under ``$OUT`` if set, else
``benchmarks/results`` (``--out-dir`` overrides both).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import time
import traceback

import torch
from torch import nn

import hostir
from hostir import FusionDefinition


PLANS = ("tp", "sp")
VARIANTS = ("eager", "hostir fusion", "hostir.parallel", "hostir.parallel ungrouped", "torch TP", "torch async-TP")


class MLP(nn.Module):
    def __init__(self, h, i, dtype, device, norm=False):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.norm = nn.RMSNorm(h, dtype=dtype, device=device) if norm else None
        self.gate, self.up, self.down = nn.Linear(h, i, **kw), nn.Linear(h, i, **kw), nn.Linear(i, h, **kw)

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        return (self.down(nn.functional.silu(self.gate(x)) * self.up(x)),)


class AttnProj(nn.Module):
    def __init__(self, h, kv, dtype, device, norm=False):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.norm = nn.RMSNorm(h, dtype=dtype, device=device) if norm else None
        self.q, self.k, self.v, self.o = (
            nn.Linear(h, h, **kw),
            nn.Linear(h, kv, **kw),
            nn.Linear(h, kv, **kw),
            nn.Linear(h, h, **kw),
        )

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        return self.o(self.q(x)), self.k(x), self.v(x)


def plan(kind, which="tp"):
    """torch's plan for `kind` ("mlp", "attn_proj"): `tp`, the default
    layouts; `sp`, torchtitan's sequence parallelism."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if which == "sp":
        col, row = (lambda: ColwiseParallel(input_layouts=Shard(1))), (lambda: RowwiseParallel(output_layouts=Shard(1)))
        first = {"norm": SequenceParallel()}
    else:
        col, row, first = ColwiseParallel, RowwiseParallel, {}
    if kind == "mlp":
        return {**first, "gate": col(), "up": col(), "down": row()}
    return {**first, "q": col(), "k": col(), "v": col(), "o": row()}


class Skipped(Exception):
    """A row that cannot run here; its message says why."""


def fusion_of(kind, dtype):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype)
        if kind == "mlp":
            g, u, d = (fd.define_tensor([-1, -1], dtype) for _ in range(3))
            fd.add_output(fd.ops.linear(fd.ops.mul(fd.ops.silu(fd.ops.linear(x, g)), fd.ops.linear(x, u)), d))
        else:
            q, k, v, o = (fd.define_tensor([-1, -1], dtype) for _ in range(4))
            fd.add_output(fd.ops.linear(fd.ops.linear(x, q), o))
            fd.add_output(fd.ops.linear(x, k))
            fd.add_output(fd.ops.linear(x, v))
    return fd


class Timer:
    """Times steps in interleaved rounds: each round runs every step once,
    in turn, starting one further along each round, so that a drift of the
    device's clocks (a GPU warms up and slows under a long run) or of the
    host's load hits every variant alike. Per step: the median ms (CUDA
    events around the step on a GPU) and the median host ms (the Python
    that issues the step's work: where it exceeds the device time, the step
    is host-bound)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def one(self, step) -> tuple[float, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            step()
            host = (time.perf_counter() - t0) * 1e3
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), host
        t0 = time.perf_counter()
        step()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms

    def rounds(self, steps: dict, warmup: int, iters: int) -> dict[str, tuple[float, float]]:
        """{name: (median ms, median host ms)} of `steps` ({name: step})."""
        names = list(steps)
        for _ in range(warmup):
            for name in names:
                steps[name]()
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(iters):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                got[name].append(self.one(steps[name]))
        return {
            name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for name, ts in got.items()
        }


def module_step(module, x, grads):
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        outs = module(x)
        torch.autograd.backward(outs, grads)

    return step


def bench_kind(kind, args, device, dtype, timer, world, rank, mesh, which="tp"):
    torch.manual_seed(0)
    h, i, t = args.hidden, args.intermediate, args.tokens
    kv = max(h // 8, 1)
    sp = which == "sp"
    if kind == "mlp":
        base = MLP(h, i, dtype, device, norm=sp)
    else:
        base = AttnProj(h, kv, dtype, device, norm=sp)
    # sp: [batch 1, sequence, H], sharded on the sequence.
    x = (torch.randn(*((1,) if sp else ()), t, h, device=device, dtype=dtype) / h**0.5).requires_grad_()
    for m in base.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=h**-0.5)
    outs = base(x)
    grads = [torch.randn_like(o) for o in outs]
    rows = {}
    steps = {}  # each row's step, timed in interleaved rounds (and profiled with --profile)

    def prepare(name, make_step):
        if args.variants and name not in args.variants:
            return
        try:
            steps[name] = make_step()
        except Skipped as why:
            rows[name] = {"ms": None, "skipped": str(why)}
            if rank == 0:
                print(f"{which} {kind}, {name}: skipped: {why}", flush=True)
        except Exception as err:  # a row that cannot run says why
            rows[name] = {"ms": None, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            if args.verbose:
                traceback.print_exc()

    def local_input():
        if not sp or world == 1:
            return x
        return x.detach().chunk(world, 1)[rank].contiguous().requires_grad_()

    def local_grads():
        # Colwise outputs (k, v) are local shards of the features; the
        # rowwise output is whole (tp) or this rank's piece of the sequence (sp).
        if world == 1:
            return grads
        return [(g.chunk(world, 1)[rank] if sp else g) if g.shape[-1] == h else g.chunk(world, -1)[rank] for g in grads]

    prepare("eager", lambda: module_step(base, x, grads))

    def fused():
        fd = fusion_of(kind, dtype)
        weights = [p.detach().clone().requires_grad_() for p in base.parameters()]
        ins = [x] + weights

        def step():
            x.grad = None
            for w in weights:
                w.grad = None
            outs = fd.execute(ins)
            torch.autograd.backward(outs, grads)

        step()  # a row whose first step fails is reported, not timed
        return step

    if not sp:
        prepare("hostir fusion", fused)

    def parallel(style_module):
        import copy

        m = copy.deepcopy(base)
        style_module(m, mesh, plan(kind, which))
        step = module_step(m, local_input(), [g.contiguous() for g in local_grads()])
        step()
        return step

    from hostir.parallel import parallelize_module as hostir_parallelize
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    prepare("hostir.parallel", lambda: parallel(hostir_parallelize))
    prepare("hostir.parallel ungrouped", lambda: parallel(functools.partial(hostir_parallelize, group_siblings=False)))
    prepare("torch TP", lambda: parallel(torch_parallelize))

    def async_tp():
        if world < 2 or device.type != "cuda":
            raise Skipped(f"torch async-TP needs at least 2 ranks on CUDA (here {world} on {device.type})")
        import copy

        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh.get_group().group_name)
        m = copy.deepcopy(base)
        torch_parallelize(m, mesh, plan(kind, which))
        compiled = torch.compile(m)
        step = module_step(compiled, local_input(), [g.contiguous() for g in local_grads()])
        step()
        return step

    prepare("torch async-TP", async_tp)
    for name, (ms, host_ms) in timer.rounds(steps, args.warmup, args.iters).items():
        rows[name] = {"ms": ms, "host_ms": host_ms}
        if args.profile:
            rows[name]["profile"] = profile(steps[name], device)
    rows = {name: rows[name] for name in VARIANTS if name in rows}
    eager = rows.get("eager", {}).get("ms")
    for r in rows.values():
        if r["ms"] is not None and eager:
            r["x_eager"] = r["ms"] / eager
    return rows


def profile(step, device) -> str:
    """One step under torch's profiler: the ops by host time, then by
    device time, and the host-device synchronizations it made."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with torch_profile(activities=activities, record_shapes=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages(group_by_input_shape=True)
    parts = [events.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        parts.append(events.table(sort_by="self_cuda_time_total", row_limit=30))
    syncs = [
        e for e in prof.key_averages() if "ynchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")
    ]
    parts.append("synchronizations: " + (", ".join(f"{e.key} x{e.count}" for e in syncs) or "none"))
    if device.type == "cuda":
        parts.append(device_timeline(prof))
    return "\n".join(parts)


def device_timeline(prof) -> str:
    """The step's device work in order: each kernel and copy with its
    stream, start (ms from the first) and duration, then each stream's busy
    time and the gaps of the stream that ran the most (where it waited for
    the host or another stream)."""
    work = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
            work.append((e.start_ns(), e.duration_ns(), e.device_resource_id(), e.name()))
    if not work:
        return "device timeline: no device events"
    work.sort()
    t0 = work[0][0]
    lines = ["device timeline (ms from the first kernel): start, duration, stream, name"]
    busy: dict[int, float] = {}
    for start, dur, stream, name in work:
        lines.append(f"  {(start - t0) / 1e6:9.3f} {dur / 1e6:8.3f}  s{stream:<4} {name[:90]}")
        busy[stream] = busy.get(stream, 0.0) + dur / 1e6
    end = max(s + d for s, d, _, _ in work)
    lines.append(f"span {(end - t0) / 1e6:.3f} ms; busy per stream: "
                 + ", ".join(f"s{k} {v:.3f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])))
    main = max(busy, key=busy.get)
    mine = [(s, d) for s, d, k, _ in work if k == main]
    gaps = [(b[0] - (a[0] + a[1])) / 1e6 for a, b in zip(mine, mine[1:]) if b[0] > a[0] + a[1]]
    lines.append(f"stream s{main}: {len(gaps)} gaps, {sum(gaps):.3f} ms idle between its first and last kernel; "
                 f"largest {', '.join(f'{g:.3f}' for g in sorted(gaps, reverse=True)[:8])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kinds", default="mlp,attn_proj")
    ap.add_argument("--plans", default="tp", help=f"comma list of {PLANS} (default: tp)")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="the small CPU form: gloo, float32, hidden 256, intermediate 512, tokens 64, 1 warm-up, 3 steps",
    )
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile one step of each row (torch profiler; written to bench_training_<tag>_profile.txt)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma list of the rows to run, of {list(VARIANTS)} (default: all)",
    )
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or set(args.variants) - set(VARIANTS):
        ap.error(f"--variants takes a comma list of {list(VARIANTS)}, got {args.variants!r}")
    plans = [p for p in args.plans.split(",") if p]
    if not plans or set(plans) - set(PLANS):
        ap.error(f"--plans takes a comma list of {PLANS}, got {args.plans!r}")
    if args.cpu:
        args.device, args.dtype, args.hidden, args.intermediate, args.tokens = "cpu", "float32", 256, 512, 64
        args.warmup, args.iters = 1, 3

    world, rank, local = hostir.world_size(), hostir.rank(), hostir.local_rank()
    if any(args.tokens % world for p in plans if p == "sp"):
        ap.error(f"--plans sp: --tokens {args.tokens} must divide by the {world} ranks")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    mesh = hostir.DeviceMesh(range(world)).to_torch(device.type)
    timer = Timer(device)
    results = {
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "tokens": args.tokens,
        "torch": torch.__version__,
        "plans": {},
    }
    for which in plans:
        results["plans"][which] = {
            kind: bench_kind(kind, args, device, dtype, timer, world, rank, mesh, which)
            for kind in args.kinds.split(",")
        }
    if rank != 0:
        return
    lines = [
        f"# bench_training: {results['device']}, world size {world}, {args.dtype}, tokens {args.tokens}, "
        f"hidden {args.hidden}, intermediate {args.intermediate}",
        "",
        "| plan | layer | variant | fwd+bwd ms | × eager | host ms | × torch TP | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for which, kinds in results["plans"].items():
        for kind, rows in kinds.items():
            tp = rows.get("torch TP", {}).get("ms")
            for name, r in rows.items():
                ms = "—" if r["ms"] is None else f"{r['ms']:.3f}"
                ratio = f"{r['x_eager']:.3f}" if "x_eager" in r else "—"
                host = "—" if r.get("host_ms") is None else f"{r['host_ms']:.3f}"
                x_tp = f"{r['ms'] / tp:.3f}" if r["ms"] and tp else "—"
                note = r.get("error") or (f"skipped: {r['skipped']}" if "skipped" in r else "")
                lines.append(f"| {which} | {kind} | {name} | {ms} | {ratio} | {host} | {x_tp} | {note} |")
    lines.append("")
    for which, kinds in results["plans"].items():
        for kind, rows in kinds.items():
            for name in ("hostir fusion", "hostir.parallel"):
                r = rows.get(name, {})
                if "x_eager" in r and world == 1:
                    verdict = "meets" if r["x_eager"] <= 1.05 else "misses"
                    lines.append(f"- {which} {kind}, {name}: {r['x_eager']:.3f}× eager, {verdict} the 1.05× target")
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(args.out_dir or os.environ.get("OUT") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{device.type}_ws{world}"
    (out / f"bench_training_{tag}.md").write_text(text)
    profiles = [
        f"## {which} {kind}, {name}\n{r.pop('profile')}"
        for which, kinds in results["plans"].items()
        for kind, rows in kinds.items()
        for name, r in rows.items()
        if "profile" in r
    ]
    if profiles:
        (out / f"bench_training_{tag}_profile.txt").write_text("\n\n".join(profiles) + "\n")
    (out / f"bench_training_{tag}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
