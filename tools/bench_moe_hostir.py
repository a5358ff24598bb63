"""hostir's rows of `tools/bench_moe.py`: the layer as `hostir.moe.MoELayer`.

`bench_moe.py` calls `hostir_variants(args, ctx, check)` once per token
count, after its own torch baselines are built, and runs every `Variant` it
returns exactly as it runs the baselines: checked against `reference_local` under
`--check`, its forward output compared with `torchtitan`'s, then timed forward
(under `torch.no_grad()`) and forward+backward, with a "speedup vs
torchtitan" column.

The routing is the baselines' (`bench_moe.route`, in torch: softmax in
float32, top-k, renormalised); the experts run as hostir's program with the
capacity the baselines' padded rows use (`--capacity-factor`, else the
worst case), in each schedule:

* `hostir_seq`: the dispatch AllToAll, the experts as batched matmuls, the
  combine AllToAll (`schedule="sequential"`);
* `hostir_ring`: dispatch and combine as one ring over the source ranks on
  the program's backend (NCCL), each peer's tokens computed as they land;
* `hostir_ring_cuda` (GPUs): the same ring on the copy engine, each piece
  pushed into the peer's symmetric buffer;
* `hostir_auto`: the planner's choice (its head in the dump says which);
* `hostir_ring_cuda_graph` (GPUs, forward only): the copy-engine ring's
  program replayed from CUDA graphs (`hostir.runtime.graphs.capture`, one
  per call parity); the routing runs eagerly each call and is copied into
  the graphs' inputs;
* `hostir_exact`: the exact form (`MoELayer(exact=True)`): the per-expert
  counts exchanged first, the tokens and the results exchanged sized by
  them at run time, the experts as `torch._grouped_mm` over the real rows;
  nothing dropped (its bound is the worst case), sequential;
* `hostir_exact_ring`, `hostir_exact_ring_cuda` (GPUs): the exact form
  walked (`MoELayer(exact=True, overlap=True)`): the counts exchanged
  first, then a ring of whole pieces of B rows per peer (the packed
  bound: `--capacity-factor`'s `ceil(f * T * k / D)`, else every pair a
  rank has), the experts as grouped GEMMs over each piece's real rows;
  no host synchronization;
* `hostir_exact_ring_cuda_graph` (GPUs, forward only): that ring replayed
  from CUDA graphs.

The contract (the whole of it is in `bench_moe.py`'s module docstring):
`args` are `bench_moe.py`'s parsed arguments, `ctx` its `Context`; each
`Variant`'s callables take the rank's `Inputs` and return the output [T, H]
in `ctx.dtype`; every rank returns the same variants in the same order.
"""

from __future__ import annotations


class GraphedLayer:
    """A `MoELayer`'s program replayed from CUDA graphs: captured on the
    first call for a set of inputs (`graphs.capture`, which runs it eagerly
    twice first), then each call routes eagerly, copies the routing into
    the graphs' input buffers and replays."""

    def __init__(self, ctx, layer, schedule: str) -> None:
        self.ctx, self.layer, self.schedule = ctx, layer, schedule
        self.key = None
        self.replay = None
        self.buffers = None

    def __call__(self, inp):
        import torch
        from bench_moe import route

        from hostir.runtime import graphs

        weights, indices = route(inp.x, inp.router, self.ctx.topk)
        key = tuple(t.data_ptr() for t in inp.params())
        if key != self.key:
            self.release()
            torch.cuda.empty_cache()
            F, (T, H) = self.ctx.ffn, inp.x.shape
            self.buffers = [
                inp.x.detach().clone(),
                indices.clone(),
                weights.unsqueeze(-2).clone(),
                inp.gate_up.detach().contiguous(),
                inp.down.detach().contiguous(),
            ]
            fd = self.layer.fusion(T, self.ctx.topk, H, F, inp.x.dtype, weights.dtype, fused=True)
            inputs = [t.unsqueeze(0) for t in self.buffers]
            self.replay = graphs.capture(fd, inputs, schedule=self.schedule)
            self.key = key
        self.buffers[1].copy_(indices)
        self.buffers[2].copy_(weights.unsqueeze(-2))
        (out,) = self.replay()
        return out.view(inp.x.shape)

    def release(self) -> None:
        """Drop the graphs, their memory pools and the input buffers."""
        self.replay, self.buffers, self.key = None, None, None


def hostir_variants(args, ctx, check: bool = False) -> list:
    """hostir's variants of the expert-parallel MoE layer; with `check`,
    the walked exact form at its worst-case bound (the references drop
    pairs per expert, as the padded form does, not per peer)."""
    from bench_moe import MODES, Variant, capacity_of, route

    from hostir import DeviceMesh
    from hostir.moe import MoELayer

    capacity = capacity_of(args, ctx.tokens, args.capacity_factor)
    drops = args.capacity_factor is not None
    backend = {"backend": "gloo"} if ctx.cpu else {}
    mesh = DeviceMesh(range(ctx.world))

    def run(layer):
        def forward(inp):
            weights, indices = route(inp.x, inp.router, ctx.topk)
            # gate_up whole, as hostir.parallel.ExpertParallel passes it:
            # the program cuts it into gate and up and joins their
            # gradients in one cat.
            return layer(inp.x, indices, weights, inp.gate_up, inp.down)

        return forward

    schedules = [("hostir_seq", "sequential"), ("hostir_ring", "ring")]
    if not ctx.cpu:
        schedules.append(("hostir_ring_cuda", "ring:transport=cuda"))
    schedules.append(("hostir_auto", None))
    out = []
    for name, schedule in schedules:
        kwargs = dict(backend, **({"schedule": schedule} if schedule else {}))
        layer = MoELayer(mesh, ctx.experts, capacity=capacity, **kwargs)
        note = f"C={capacity}" + (" (pairs past C dropped)" if drops else " (worst case, nothing dropped)")
        out.append(
            Variant(
                name,
                run(layer),
                note=f"{note}; schedule {schedule or 'chosen by the planner'}",
                optional=name == "hostir_ring_cuda",
                capacity=capacity if drops else None,
                describe=None if schedule else chosen(layer),
            )
        )
    if not ctx.cpu:
        schedule = "ring:transport=cuda"
        graphed = MoELayer(mesh, ctx.experts, capacity=capacity, schedule=schedule)
        out.append(
            Variant(
                "hostir_ring_cuda_graph",
                GraphedLayer(ctx, graphed, schedule),
                note=f"C={capacity}; schedule {schedule}; forward replayed from CUDA graphs",
                modes=("fwd",),
                optional=True,
                capacity=capacity if drops else None,
            )
        )
    exact = MoELayer(mesh, ctx.experts, exact=True, **backend)
    out.append(
        Variant(
            "hostir_exact",
            run(exact),
            note="exact: counts exchanged first, rows sized at run time, grouped GEMMs; sequential",
        )
    )
    walked = [("hostir_exact_ring", "ring")]
    if not ctx.cpu:
        walked += [("hostir_exact_ring_cuda", "ring:transport=cuda"), ("hostir_exact_ring_cuda_graph", None)]
    factor = None if check else args.capacity_factor
    for name, schedule in walked:
        graph = name.endswith("_graph")
        schedule = schedule or "ring:transport=cuda"
        layer = MoELayer(
            mesh,
            ctx.experts,
            exact=True,
            overlap=True,
            capacity_factor=factor,
            schedule=schedule,
            **backend,
        )
        bound = layer.slots(ctx.tokens, ctx.topk)
        note = f"B={bound}" + (" (pairs past B for a peer dropped)" if factor else " (every pair, nothing dropped)")
        out.append(
            Variant(
                name,
                GraphedLayer(ctx, layer, schedule) if graph else run(layer),
                note=f"exact, walked: {note}; schedule {schedule}"
                + ("; forward replayed from CUDA graphs" if graph else ""),
                modes=("fwd",) if graph else MODES,
                optional=name != "hostir_exact_ring",
                capacity=bound if factor else None,
            )
        )
    return out


def chosen(layer):
    """What the planner chose for the latest call of `layer` (a
    `MoELayer`): its schedule and the model's figures (the loop's head in
    the dump)."""

    def describe() -> str:
        (fd,) = layer.fusions.values()
        schedule = fd.last_schedule
        if schedule is None:
            return "planner: no choice (the lowering's default)"
        head = f"{schedule.decomposition}, chunks={schedule.chunks}, transport={schedule.transport or 'backend'}"
        return f"planner: {head}" + (f" ({schedule.note})" if schedule.note else "")

    return describe
