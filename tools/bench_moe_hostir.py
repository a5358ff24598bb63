"""hostir's rows of `tools/bench_moe.py`: the layer as `hostir.moe.MoELayer`.

`bench_moe.py` calls `hostir_variants(args, ctx)` once per token count, after
its own torch baselines are built, and runs every `Variant` it returns
exactly as it runs the baselines: checked against `reference_local` under
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
* `hostir_exact`: the exact form (`MoELayer(exact=True)`): the per-expert
  counts exchanged first, the tokens and the results exchanged sized by
  them at run time, the experts as `torch._grouped_mm` over the real rows;
  nothing dropped (its bound is the worst case), sequential.

The contract (the whole of it is in `bench_moe.py`'s module docstring):
`args` are `bench_moe.py`'s parsed arguments, `ctx` its `Context`; each
`Variant`'s callables take the rank's `Inputs` and return the output [T, H]
in `ctx.dtype`; every rank returns the same variants in the same order.
"""

from __future__ import annotations


def hostir_variants(args, ctx) -> list:
    """hostir's variants of the expert-parallel MoE layer."""
    from bench_moe import Variant, capacity_of, route

    from hostir import DeviceMesh
    from hostir.moe import MoELayer

    F = ctx.ffn
    capacity = capacity_of(args, ctx.tokens, args.capacity_factor)
    drops = args.capacity_factor is not None
    backend = {"backend": "gloo"} if ctx.cpu else {}
    mesh = DeviceMesh(range(ctx.world))

    def run(layer):
        def forward(inp):
            weights, indices = route(inp.x, inp.router, ctx.topk)
            gate_up = inp.gate_up
            return layer(inp.x, indices, weights, gate_up[:, :F], gate_up[:, F:], inp.down)

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
    return out
