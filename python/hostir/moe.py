"""Expert parallelism: a mixture-of-experts layer's experts spread over
the ranks of a mesh, as one hostir program.

    layer = hostir.moe.MoELayer(mesh, experts=64)
    y = layer(x, indices, weights, gate, up, down)   # every rank, its own tokens
    y = layer(x, indices, weights, gate_up, down)    # or gate and up as one

Each rank holds its own tokens `x` [T, H] with the router's choices for
them (`indices` [T, k], expert ids, and `weights` [T, k]), and the weights
of `experts / D` experts: `gate` and `up` [E/D, F, H], `down` [E/D, H, F]
(rank r holds experts r*E/D ... (r+1)*E/D - 1, as `Shard(0)` of the whole
[E, ...] weights places them). `gate` and `up` may come as one tensor,
`gate_up` [E/D, 2F, H] (gate's rows first, as Hugging Face's
`gate_up_proj` holds them): the program cuts it into gate and up (views),
and their gradients join in one cat, into gate_up's. The program
(`MoELayer.fusion`):

1. `route`: each (token, choice) pair's slot in a buffer of `capacity`
   rows per expert, and each slot's token (the stable permutation of the
   pairs by expert, and its inverse);
2. dispatch: the tokens taken into the slots, [D, E/D, C, H] per rank,
   and an AllToAll (a resharding `set`) that brings each rank the rows of
   its experts from every rank;
3. the experts: `down(act(gate(x)) * up(x))` as batched matmuls, one batch
   per (source rank, expert): the grouped GEMM in its capacity-padded form;
4. combine: the AllToAll back, each pair's result taken from its slot,
   weighted and summed over the k choices.

With `overlap` (the default) the received tokens' source axis is a stream
axis: the experts walk the source ranks, and dispatch and combine become
one ring (`decompose_device_axis`): each step receives one peer's tokens,
runs the experts on them and sends the results back, while the other
steps move (the schedule's `transport=cuda` moves them on the copy
engine). `schedule="sequential"` keeps the two AllToAlls.

Every size is fixed by the tokens per rank and `capacity` (by default the
worst case, `T`: no pair is ever dropped, and the result is exactly the
unsharded layer's), so the program is graph-capturable and agreed across
ranks like any other; with a smaller `capacity` pairs past an expert's
capacity are dropped (their contribution is zero), as capacity-factor
routers do. Its backward is derived like any fusion's: the two AllToAlls
transpose into each other (walked as the forward's with `overlap`: one
ring whose steps return each peer's tokens' gradients), dispatch's `take`
(given each token's slots) into a gather of those slots summed, combine's
into `put_add`, and each batched matmul into two.

The exact form (`exact=True`) moves and computes only the rows the
routing fills: `route(..., packed=True)` packs each rank's pairs by
destination rank, expert after expert, `route_counts` counts each
expert's rows, the counts go first (an AllToAll of counts), the tokens and
the results go as AllToAlls sized by them at run time (`set(...,
rows=...)`; the transport reads the counts on the host), and the experts
are grouped GEMMs (`grouped_mm`) over each source rank's rows. Its buffers
are allocated at a bound (by default every pair a rank has: nothing
dropped); the host synchronization keeps it out of a CUDA graph. With
`overlap=True` it is walked instead: after the counts, each ring step
moves one peer's whole piece at the bound (real rows first, zeros after;
no host synchronization) and runs the grouped GEMMs on its real rows.

`hostir.parallel.parallelize_module` runs Hugging Face MoE blocks'
experts through this class (its `ExpertParallel` style, `docs/moe.md`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hostir import ir
from hostir.errors import UsageError
from hostir.frontend import FusionDefinition
from hostir.kinds import UnaryKind
from hostir.runtime.checks import InputError

__all__ = ["MoELayer"]


class MoELayer:
    """One expert-parallel MoE layer over the ranks of `mesh` (a
    `hostir.DeviceMesh`, or the ranks' list): `experts` experts in all,
    `activation` a unary kind (`"silu"`: the SwiGLU experts of Mixtral,
    Qwen and DeepSeek), `capacity` slots per expert and source rank, or
    `capacity_factor`: `ceil(factor * T * k / E)` slots for T tokens of k
    choices (neither: the tokens per rank, nothing ever dropped; never
    more). Calling it runs the layer on this rank's tokens (see the
    module's doc); the fusions are made per (tokens, choices per token,
    sizes, dtypes) and kept. `overlap`: walk the source ranks (see the
    module's doc; the default for the padded form, not for the exact
    one, whose walk moves whole pieces at the bound). `exact`: the exact
    form (see the module's doc), where `capacity` bounds the rows a rank
    sends one peer (default all its pairs) and `capacity_factor` makes it
    `ceil(factor * T * k / D)`. `check_indices`: refuse expert ids
    outside [0, experts) before anything runs, at the cost of reading them
    on the host (a synchronization on a GPU); None, the default, checks
    where that costs nothing new: tokens on the CPU, and the exact form
    unwalked, which reads its counts on the host anyway (a rank that
    refuses its call leaves its peers to time out in their first
    exchange).
    `execute_kwargs` go to every `execute` (a backend, a schedule,
    `number_of_streams`, ...)."""

    def __init__(
        self,
        mesh,
        experts: int,
        activation: str = "silu",
        capacity: int | None = None,
        capacity_factor: float | None = None,
        overlap: bool | None = None,
        exact: bool = False,
        check_indices: bool | None = None,
        **execute_kwargs: Any,
    ):
        self.mesh = mesh if isinstance(mesh, ir.DeviceMesh) else ir.DeviceMesh(list(mesh))
        self.D = self.mesh.size
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1 or experts % self.D:
            raise UsageError(f"MoELayer: {experts!r} experts do not divide over the {self.D} ranks of the mesh")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise UsageError(f"MoELayer: capacity must be an int >= 1 or None, got {capacity!r}")
        if capacity_factor is not None:
            if capacity is not None:
                raise UsageError("MoELayer: give capacity or capacity_factor, not both")
            if (
                isinstance(capacity_factor, bool)
                or not isinstance(capacity_factor, (int, float))
                or capacity_factor <= 0
            ):
                raise UsageError(f"MoELayer: capacity_factor must be a number > 0, got {capacity_factor!r}")
        try:
            self.activation = UnaryKind(activation)
        except ValueError:
            raise UsageError(f"MoELayer: unknown activation {activation!r}") from None
        self.experts, self.capacity, self.capacity_factor = experts, capacity, capacity_factor
        if not isinstance(exact, bool):
            raise UsageError(f"MoELayer: exact must be a bool, got {exact!r}")
        self.exact = exact
        self.overlap = not exact if overlap is None else bool(overlap)
        self.check_indices = check_indices
        self.execute_kwargs = execute_kwargs
        self.fusions: dict[tuple, FusionDefinition] = {}

    def slots(self, tokens: int, topk: int) -> int:
        """The rows per (source rank, expert) for `tokens` tokens of `topk`
        choices: the capacity, the capacity factor's, or the tokens (an
        expert takes a token at most once). In the exact form, the bound
        on the rows a rank sends one peer: the capacity, the capacity
        factor's share (`ceil(factor * T * k / D)`), or all its pairs."""
        if self.exact:
            pairs = tokens * topk
            if self.capacity is not None:
                return min(self.capacity, pairs)
            if self.capacity_factor is not None:
                return max(1, min(pairs, math.ceil(self.capacity_factor * pairs / self.D)))
            return pairs
        if self.capacity is not None:
            return min(self.capacity, tokens)
        if self.capacity_factor is not None:
            return max(1, min(tokens, math.ceil(self.capacity_factor * tokens * topk / self.experts)))
        return tokens

    def fusion(
        self,
        tokens: int,
        topk: int,
        hidden: int,
        ffn: int,
        dtype: torch.dtype,
        weights_dtype=None,
        fused: bool = False,
    ) -> FusionDefinition:
        """The layer's program for `tokens` tokens per rank (see the
        module's doc); inputs, each with a leading axis of the mesh's size
        sharded on it: x [D, T, H], indices [D, T, k], weights [D, T, 1, k],
        gate and up [D, E/D, F, H] (`fused`: gate_up [D, E/D, 2F, H] in
        their place), down [D, E/D, H, F]; output [D, T, 1, H]."""
        weights_dtype = weights_dtype or dtype
        key = (tokens, topk, hidden, ffn, dtype, weights_dtype, fused)
        fd = self.fusions.get(key)
        if fd is not None:
            return fd
        D, E, k = self.D, self.experts, topk
        C = self.slots(tokens, topk)
        if self.exact:
            fd = self._exact_fusion(tokens, topk, hidden, ffn, dtype, weights_dtype, fused)
            self.fusions[key] = fd
            return fd
        with FusionDefinition() as fd:
            x, indices, weights, *experts = self._inputs(fd, tokens, k, hidden, ffn, dtype, weights_dtype, fused)
            slot, source = fd.ops.route(indices, E, C, groups=D)
            swap = [0, 1, 3, 2]
            gate_t, up_t, down_t = (fd.ops.permute(w, swap) for w in self._gate_up_down(fd, experts, ffn))
            # [source rank, destination rank, its expert, slot, H].
            # `slot` lists each token's slots: the gradient gathers them.
            sent = fd.ops.take(x, source, batch=1, features=1, inverse=slot)
            received = fd.ops.set(sent)
            g = fd.ops.matmul(received, gate_t)
            u = fd.ops.matmul(received, up_t)
            h = fd.ops.mul(getattr(fd.ops, self.activation.value)(g), u)
            y = fd.ops.matmul(h, down_t)
            back = fd.ops.set(y)
            picked = fd.ops.take(back, slot, batch=1, features=1)
            # The k results weighted and summed: one batched product per
            # token, [1, k] x [k, H] (whose gradients are products too).
            if weights_dtype != dtype:
                weights_as_x = fd.ops.cast(weights, dtype)
            else:
                weights_as_x = weights
            fd.add_output(fd.ops.matmul(weights_as_x, picked))
        for tv, axis in ((x, 0), (indices, 0), (weights, 0), *((w, 0) for w in experts), (received, 1), (back, 0)):
            tv.set_device_mesh(self.mesh)
            tv.axis(axis).parallelize(ir.ParallelType.mesh_x)
        if self.overlap:
            # The experts walk the source ranks: each rank's tokens are
            # computed as they arrive (a ring of the dispatch's pieces).
            received.axis(0).parallelize(ir.ParallelType.stream)
        fd.executor.label = f" (expert-parallel MoE, {E} experts over {D} ranks, top-{k})"
        self.fusions[key] = fd
        return fd

    def _inputs(self, fd: FusionDefinition, tokens, k, hidden, ffn, dtype, weights_dtype, fused) -> tuple:
        """Both forms' inputs (see `fusion`): x, indices, weights, gate, up
        (or gate_up), down. The mesh axis of a one-rank mesh is left
        symbolic: a constant size 1 would make it a broadcast axis, not the
        rank's piece."""
        R, El = (self.D if self.D > 1 else -1), self.experts // self.D
        ins = [[R, El, 2 * ffn, hidden]] if fused else [[R, El, ffn, hidden]] * 2
        return (
            fd.define_tensor([R, tokens, hidden], dtype),
            fd.define_tensor([R, tokens, k], torch.int64),
            fd.define_tensor([R, tokens, 1, k], weights_dtype),
            *(fd.define_tensor(shape, dtype) for shape in ins),
            fd.define_tensor([R, El, hidden, ffn], dtype),
        )

    @staticmethod
    def _gate_up_down(fd: FusionDefinition, experts: list, ffn: int) -> list:
        """gate, up and down among the experts' weight inputs: a gate_up
        input cut into its halves (views, each rank's piece cut alike; their
        gradients join in one cat). The weight is cut, not the product: a
        product's halves would be read strided by every elementwise op
        after it, and one product of 2F columns is no faster than two of F
        (measured on one H200: `docs/moe.md`)."""
        if len(experts) == 3:
            return list(experts)
        gate_up, down = experts
        return [
            fd.ops.slice(gate_up, [0] * 4, [None, None, ffn, None]),
            fd.ops.slice(gate_up, [0, 0, ffn, 0], [None] * 4),
            down,
        ]

    def _exact_fusion(self, tokens, topk, hidden, ffn, dtype, weights_dtype, fused) -> FusionDefinition:
        """The exact form: each rank's pairs packed by destination rank,
        expert after expert (`route(..., packed=True)`), the per-expert
        counts exchanged first (an AllToAll of counts), the tokens and the
        results exchanged sized by them, and the experts as grouped GEMMs
        over the real rows."""
        D, E, k = self.D, self.experts, topk
        B = self.slots(tokens, topk)
        with FusionDefinition() as fd:
            x, indices, weights, *experts = self._inputs(fd, tokens, k, hidden, ffn, dtype, weights_dtype, fused)
            gate, up, down = self._gate_up_down(fd, experts, ffn)
            slot, source = fd.ops.route(indices, E, B, groups=D, packed=True)
            # [source rank, destination rank, its expert]: the rows sent.
            counts = fd.ops.route_counts(indices, E, B, groups=D, packed=True)
            # [source rank, destination rank, B, H], B a bound on the rows.
            sent = fd.ops.take(x, source, batch=1, features=1, inverse=slot)
            counts_in = fd.ops.set(counts)
            # Sized by the counts, unless walked (whole pieces of B rows,
            # zeros past the real ones) or on one rank, where every pair
            # stays and the bound is all of them.
            sized = D > 1 and not self.overlap
            received = fd.ops.set(sent, rows=(counts, counts_in) if sized else None)
            g = fd.ops.grouped_mm(received, gate, counts_in)
            u = fd.ops.grouped_mm(received, up, counts_in)
            h = fd.ops.mul(getattr(fd.ops, self.activation.value)(g), u)
            y = fd.ops.grouped_mm(h, down, counts_in)
            back = fd.ops.set(y, rows=(counts_in, counts) if sized else None)
            picked = fd.ops.take(back, slot, batch=1, features=1)
            weights_as_x = fd.ops.cast(weights, dtype) if weights_dtype != dtype else weights
            fd.add_output(fd.ops.matmul(weights_as_x, picked))
        placed = [(x, 0), (indices, 0), (weights, 0), *((w, 0) for w in experts), (counts, 0), (sent, 0)]
        placed += [(counts_in, 1), (received, 1), (back, 0)]
        for tv, axis in placed:
            tv.set_device_mesh(self.mesh)
            tv.axis(axis).parallelize(ir.ParallelType.mesh_x)
        if self.overlap:
            # The experts walk the source ranks as in the padded form; the
            # counts, exchanged whole before the walk, are read a source
            # rank's row at a step.
            received.axis(0).parallelize(ir.ParallelType.stream)
        walked = ", walked" if self.overlap else ""
        fd.executor.label = f" (expert-parallel MoE, exact{walked}, {E} experts over {D} ranks, top-{k})"
        return fd

    def __call__(self, x, indices, weights, *experts) -> torch.Tensor:
        """This rank's output [T, H] for its tokens `x` [T, H], their
        choices `indices` and `weights` [T, k], and its experts' weights:
        `gate`, `up` [E/D, F, H] and `down` [E/D, H, F], or `gate_up`
        [E/D, 2F, H] (gate's rows first) and `down`."""
        El = self.experts // self.D
        if len(experts) not in (2, 3):
            raise InputError(
                f"MoELayer: give the experts' weights as gate, up, down or as gate_up, down; got {len(experts)} tensors"
            )
        fused = len(experts) == 2
        if x.dim() != 2:
            raise InputError(f"MoELayer: the tokens must be [T, H], got shape {list(x.shape)}")
        T, H = x.shape
        k = indices.shape[-1] if indices.dim() == 2 else -1
        for name, t in (("indices", indices), ("weights", weights)):
            if t.dim() != 2 or list(t.shape) != [T, k]:
                raise InputError(f"MoELayer: {name} must be [{T}, k] (tokens, choices), got {list(t.shape)}")
        if indices.dtype is not torch.int64:
            raise InputError(f"MoELayer: indices must be int64, got {indices.dtype}")
        if not 1 <= k <= self.experts:
            raise InputError(f"MoELayer: {k} choices per token among {self.experts} experts")
        first = experts[0]
        F = (first.shape[1] // 2 if fused else first.shape[1]) if first.dim() == 3 else -1
        named = (("gate_up", [El, 2 * F, H]),) if fused else (("gate", [El, F, H]), ("up", [El, F, H]))
        for (name, shape), t in zip((*named, ("down", [El, H, F])), experts):
            if list(t.shape) != shape:
                raise InputError(f"MoELayer: {name} must be this rank's {El} experts, {shape}, got {list(t.shape)}")
        check = self.check_indices
        if check is None:
            check = indices.device.type == "cpu" or (self.exact and not self.overlap)
        if check and T * k:
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= self.experts:
                bad = low if low < 0 else high
                raise InputError(f"MoELayer: expert id {bad} in indices is outside [0, {self.experts})")
        fd = self.fusion(T, k, H, F, x.dtype, weights.dtype, fused)
        inputs = [x, indices, weights.unsqueeze(-2), *experts]
        (out,) = fd.execute([t.unsqueeze(0) for t in inputs], **self.execute_kwargs)
        return out.view(T, H)
