"""One eager forward of the expert-parallel MoE layer per form, traced after
warm-ups, for its stream timeline (`tools/plot_timeline.py` draws it).

    torchrun --standalone --nproc-per-node 2 tools/trace_moe.py OUT [--tokens 8192] [--capacity-factor 2]
    python3 tools/plot_timeline.py OUT/exact -o timeline_moe_exact.png

Each rank draws its own tokens and router choices (softmax of random
scores, top-k, bfloat16 tokens and experts: the shapes of `bench_moe.py`,
hidden 4096, ffn 1536, 64 experts, top 8) and runs, in order:

* `sequential`, `ring`, `ring_transport_cuda`: the capacity-padded form
  (`--capacity-factor`, default 2) in each schedule;
* `exact`: the exact form (counts exchanged first, rows sized at run time,
  grouped GEMMs; nothing dropped).

Each form's trace lands in OUT/<form> (one file per rank); the ranks end
together (a barrier), and the process group is destroyed.

With `--backward`, each form instead runs one forward and backward under
`torch.profiler` (after warm-ups) and rank 0 writes the ops' table, sorted
by their device time, to OUT/<form>_fwd_bwd.txt: where a training step of
the layer spends its time, op by op (the stream timeline shows the
forward's overlap; this shows the backward's costs).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import hostir
from hostir import DeviceMesh
from hostir.moe import MoELayer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for the traces, one subfolder per form")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--forms", default="sequential,ring,ring:transport=cuda,exact")
    ap.add_argument("--backward", action="store_true", help="profile one forward+backward per form instead")
    args = ap.parse_args()
    D, r = hostir.world_size(), hostir.rank()
    dev = torch.device("cuda", hostir.local_rank())
    torch.cuda.set_device(dev)
    T, H, F, E, k = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    El = E // D
    torch.manual_seed(r)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    weights, indices = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), k)
    gate = torch.randn(El, F, H, device=dev, dtype=torch.bfloat16) / 64
    up = torch.randn_like(gate)
    down = torch.randn(El, H, F, device=dev, dtype=torch.bfloat16) / 64
    mesh = DeviceMesh(range(D))
    try:
        for form in args.forms.split(","):
            if form == "exact":
                layer = MoELayer(mesh, E, exact=True)
                kwargs = {}
            else:
                layer = MoELayer(mesh, E, capacity_factor=args.capacity_factor, schedule=form)
                kwargs = {"schedule": form}
            name = form.replace(":", "_").replace("=", "_")
            if args.backward:
                profile_step(layer, (x, indices, weights, gate, up, down), f"{args.out}/{name}_fwd_bwd.txt", r)
                continue
            with torch.no_grad():
                for _ in range(3):
                    layer(x, indices, weights, gate, up, down)
                torch.cuda.synchronize()
                fd = layer.fusion(T, k, H, F, torch.bfloat16, weights.dtype)
                inputs = [x, indices, weights.unsqueeze(-2), gate, up, down]
                fd.execute([t.unsqueeze(0) for t in inputs], trace=f"{args.out}/{name}", **kwargs)
                torch.cuda.synchronize()
            if r == 0:
                print(f"{form}: traced into {args.out}/{name}", flush=True)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def profile_step(layer: MoELayer, inputs: tuple, path: str, rank: int) -> None:
    """One forward and backward of `layer` under torch.profiler, after
    three warm-ups; rank 0 writes the ops' table by device time to `path`."""
    x, indices, weights, gate, up, down = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate, up, down)]

    def step():
        xl, wl, gl, ul, dl = leaves
        out = layer(xl, indices, wl, gl, ul, dl)
        out.backward(torch.ones_like(out))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        import pathlib

        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60)
        pathlib.Path(path).write_text(table)
        print(f"profiled one forward+backward into {path}", flush=True)


if __name__ == "__main__":
    main()
