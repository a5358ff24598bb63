"""The dry run of a training step: the training forward, the tensors saved
for the backward, and the backward, every rank, on meta tensors.

`dry_run_training(fd, inputs, wrt)` derives the fusion's backward for the
inputs `wrt` (default: every floating-point tensor input), dry-runs the
training forward on `inputs`, then the backward on the forward's output
shapes (the cotangents) and the saved tensors, and reports per rank the
forward peak, the backward peak and the bytes held between them: the saved
intermediates (extra memory the forward keeps alive) and the saved inputs
(which the caller holds anyway). `fd.dry_run(inputs, backward=True)` calls it.
"""

from __future__ import annotations

import dataclasses

import torch

from hostir import ir
from hostir.analysis.dry_run import DryRunReport, _bytes, dry_run, meta_inputs


@dataclasses.dataclass
class TrainingRankReport:
    rank: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved_bytes: int
    saved_input_bytes: int
    saved: list  # (what, shape, dtype)


@dataclasses.dataclass
class TrainingDryRunReport:
    forward: DryRunReport
    backward: DryRunReport
    ranks: list

    def __getitem__(self, rank: int) -> TrainingRankReport:
        return self.ranks[rank]

    def as_dict(self) -> dict:
        return {
            "forward": self.forward.as_dict(),
            "backward": self.backward.as_dict(),
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
        }

    def __str__(self) -> str:
        lines = [f"Training dry run on {len(self.ranks)} rank(s):"]
        for r in self.ranks:
            lines.append(
                f"  rank {r.rank}: forward peak {_bytes(r.forward_peak_bytes)}, backward peak "
                f"{_bytes(r.backward_peak_bytes)}, saved between them {_bytes(r.saved_bytes)} "
                f"(+ {_bytes(r.saved_input_bytes)} of inputs the caller holds)"
            )
            for what, shape, dtype in r.saved:
                lines.append(f"    saved {what}: {dtype}{shape}")
        return "\n".join(lines) + "\n"


def dry_run_training(fd, inputs, wrt=None, world_size: int | None = None, keep_gathered: bool = False, **kwargs):
    from hostir.autodiff import derive

    fusion = getattr(fd, "fusion", fd)
    metas = meta_inputs(fusion, inputs)
    if wrt is None:
        wrt = [
            i
            for i, (tv, t) in enumerate(zip(fusion.inputs, metas))
            if isinstance(tv, ir.TensorView) and t.dtype.is_floating_point
        ]
    d = derive(fusion, list(wrt), keep_gathered=keep_gathered)
    forward = dry_run(d.forward, metas, world_size=world_size, **kwargs)
    per_rank_inputs = {}
    ranks = []
    for rep in forward.ranks:
        shapes = [shape for _, shape, _ in rep.outputs]
        # A rank outside an output's mesh passes a piece of the shape the
        # others hold (its values are never read).
        held = [s if s is not None else next((o.outputs[k][1] for o in forward.ranks if o.outputs[k][1] is not None), None)
                for k, s in enumerate(shapes)]
        cotangents = [
            torch.empty(held[k], dtype=tv.dtype, device="meta") for k, tv in enumerate(d.forward.outputs[: d.user_outputs])
        ]
        saved, listed, saved_bytes, input_bytes = [], [], 0, 0
        for kind, i in d.saved:
            if kind == "cotangent":
                saved.append(cotangents[i])  # the same tensor again: no bytes saved
            elif kind == "input":
                value = metas[i]
                saved.append(value)
                if isinstance(value, torch.Tensor):
                    input_bytes += ir.nbytes(value)
            else:
                tv = d.forward.outputs[i]
                t = torch.empty(held[i], dtype=tv.dtype, device="meta")
                saved.append(t)
                saved_bytes += ir.nbytes(t)
                listed.append((f"T{tv.name}", list(t.shape), str(tv.dtype).removeprefix("torch.")))
        per_rank_inputs[rep.rank] = cotangents + saved
        ranks.append(TrainingRankReport(rep.rank, rep.peak_bytes, 0, saved_bytes, input_bytes, listed))
    backward = dry_run(d.backward, per_rank_inputs, world_size=forward.world_size, **kwargs)
    for r, rep in zip(ranks, backward.ranks):
        r.backward_peak_bytes = rep.peak_bytes
    return TrainingDryRunReport(forward, backward, ranks)
