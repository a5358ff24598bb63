"""`fd.execute` under autograd: one `torch.autograd.Function` node per call.

When grad mode is on and an input requires grad, `FusionDefinition.execute`
hands the call here. The fusion's derivation (`hostir.autodiff.derive`) for
the inputs that require grad is made once per fusion version and kept; its
training forward runs now (the user's outputs, then the tensors the
backward reads), and `backward()` runs its backward program, communications
included, returning one gradient per input that torch accumulates into
`.grad` as it does for its own ops. DTensor inputs enter the node as
they are: it runs on their local shards and returns their gradients as
DTensors with the inputs' placements (as `to_local()`'s backward would,
without a `to_local` node and a `from_local` per gradient on every call);
outputs leave through `DTensor.from_local`.

Everything else (`no_grad`, no input requiring grad) never reaches this
module: those calls run the plain forward program as before.

Not covered: preallocated outputs and `cuda_graph=True` (both raise
`UsageError`; run such calls under `torch.no_grad()`), and double backward
(`backward(create_graph=True)` through a fusion raises `BackwardError`).
Prepared calls are: the training forward and the backward are ordinary
executors, so their steady-state single-device calls take the prepared path.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch

from hostir.autodiff import BackwardError, Derivation, derive
from hostir.dtensor import has_dtensors, is_dtensor
from hostir.errors import UsageError

__all__ = ["requires_grad", "execute", "training_of"]


def requires_grad(inputs: Sequence[Any]) -> bool:
    """Whether a call on `inputs` records a backward (grad mode is on and an
    input requires grad). Cheap: one attribute read per input."""
    if not torch.is_grad_enabled() or not isinstance(inputs, (list, tuple)):
        return False
    for t in inputs:
        if getattr(t, "requires_grad", False):
            return True
    return False


@dataclasses.dataclass
class Training:
    """A fusion's derivation for one set of inputs, and the executors of
    its two programs."""

    derivation: Derivation
    forward: Any  # FusionExecutor
    backward: Any  # FusionExecutor


def training_of(fd, wrt: tuple[int, ...]) -> Training:
    """The derivation of `fd` for the gradients of inputs `wrt`, made on
    first use and kept per fusion version."""
    from hostir.executor import FusionExecutor

    cache = fd.__dict__.setdefault("_trainings", {})
    keep = bool(getattr(fd, "keep_gathered", False))
    key = (fd.fusion.version, wrt, keep)
    found = cache.get(key)
    if found is None:
        if len(cache) > 8:
            cache.clear()
        d = derive(fd.fusion, wrt, keep_gathered=keep)
        forward, backward = FusionExecutor(d.forward), FusionExecutor(d.backward)
        forward.label, backward.label = " (training forward)", " (backward)"
        found = cache[key] = Training(d, forward, backward)
    return found


def execute(fd, inputs, outputs, params, return_dtensors, kwargs) -> list[Any]:
    """`fd.execute(inputs, ...)` recording one autograd node."""
    from hostir.executor import ExecutorParams

    if outputs is not None:
        raise UsageError(
            "preallocated outputs and autograd do not mix (torch could not track writes into them): "
            "call without outputs, or under torch.no_grad()"
        )
    params = ExecutorParams.from_arguments(params, dict(kwargs))
    if params.cuda_graph:
        raise UsageError(
            "cuda_graph=True does not cover the backward: inputs that require grad would record a "
            "backward that replays no graph; call under torch.no_grad() to replay graphs, or without "
            "cuda_graph to train"
        )
    wrap = bool(return_dtensors)
    if has_dtensors(inputs):
        wrap = return_dtensors is not False
        # DTensor inputs enter the node as they are: it reads their local
        # shards and gives their gradients their own specs (no to_local
        # node, and no from_local per gradient, on every call).
        fd._dtensors().place_inputs(inputs)
    if wrap:
        fd._dtensors().check_outputs()
    fusion_inputs = fd.fusion.inputs
    wrt = tuple(
        i
        for i, t in enumerate(inputs)
        if isinstance(t, torch.Tensor) and t.requires_grad and i < len(fusion_inputs) and t.is_floating_point()
    )
    if len(inputs) != len(fusion_inputs) or not wrt:
        results = fd.executor.execute([_plain(_local(t)) for t in inputs], None, params)
        return fd._dtensors().wrap_outputs(results) if wrap else results
    training = training_of(fd, wrt)
    results = list(_Node.apply(training, params, *inputs))
    return fd._dtensors().wrap_outputs(results) if wrap else results


def _plain(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def _local(t):
    """A DTensor's local shard (its own tensor, not a view with a grad
    node); anything else as it is."""
    return t._local_tensor if is_dtensor(t) else t


def _gradient_like(g: torch.Tensor, spec, local_stride: tuple) -> Any:
    """The gradient of a DTensor input from its local shard `g`: placed as
    the input (whose spec is `spec` and whose local shard had strides
    `local_stride`), a Partial placement as Replicate, as the backward of
    `DTensor.to_local` places it. With the input's own placements and
    strides it takes a copy of the input's spec, as that backward does,
    without its `from_local`."""
    from torch.distributed.tensor import DTensor, Replicate

    if g.stride() == local_stride and not any(p.is_partial() for p in spec.placements):
        return DTensor(g, copy.copy(spec), requires_grad=False)
    from torch.distributed.tensor._utils import compute_global_tensor_info

    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    _, stride = compute_global_tensor_info(g, spec.mesh, placements)
    return DTensor.from_local(g, spec.mesh, placements, run_check=False, shape=spec.shape, stride=tuple(stride))


def _placeholders(d: Derivation, saved: list, inputs) -> list:
    """A saved value this rank does not hold (it lives on other ranks'
    mesh) is passed to the backward as a tensor of the shape the program
    expects, which it never reads."""
    from hostir import ir
    from hostir.runtime.checks import check_sizes, equal_input_axes

    plain = [_plain(t) for t in inputs]
    sizes = check_sizes(d.forward, plain, equal_input_axes(d.forward))
    device = next((t.device for t in plain if isinstance(t, torch.Tensor)), None)
    out = list(saved)
    for k, ((kind, i), value) in enumerate(zip(d.saved, saved)):
        if value is not None:
            continue
        tv = d.forward.outputs[i]
        shape = []
        for axis in tv.logical_runtime():
            if any(leaf.is_device_parallel for leaf in axis.loop_leaves()):
                raise BackwardError(
                    f"T{tv.name}, saved for the backward, lives on ranks {tv.mesh} sharded; a rank outside its "
                    f"mesh cannot size its placeholder"
                )
            extent = axis.extent
            size = extent.value if extent.is_constant else sizes.get(extent)
            if size is None and isinstance(extent, ir.ScalarExpr):
                size = _evaluate(extent, sizes)
            shape.append(size)
        out[k] = torch.empty(shape, dtype=tv.dtype, device=device)
    return out


def _evaluate(s, sizes):
    from hostir import ir

    if isinstance(s, ir.ScalarExpr):
        a, b = _evaluate(s.lhs, sizes), _evaluate(s.rhs, sizes)
        return None if a is None or b is None else ir.ScalarExpr.OPS[s.op](a, b)
    return s.value if s.is_constant else sizes.get(s)


@dataclasses.dataclass(frozen=True)
class _Cotangent:
    """Stands, among the values saved for the backward, for the cotangent
    of user output `index`, known only when the backward runs."""

    index: int


class _Node(torch.autograd.Function):
    @staticmethod
    def forward(ctx, training: Training, params, *inputs):
        d = training.derivation
        specs = [(t._spec, t._local_tensor.stride()) if is_dtensor(t) else None for t in inputs]
        if any(specs):
            inputs = tuple(_local(t) for t in inputs)
        results = training.forward.execute([_plain(t) for t in inputs], None, params)
        user = results[: d.user_outputs]
        saved = [
            inputs[i] if kind == "input" else results[i] if kind == "output" else _Cotangent(i) for kind, i in d.saved
        ]
        if any(t is None for t in saved):
            saved = _placeholders(d, saved, inputs)
        tensors = [t for t in saved if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [isinstance(t, torch.Tensor) for t in saved]
        ctx.scalars = [t for t in saved if not isinstance(t, torch.Tensor)]
        ctx.training, ctx.params = training, params
        ctx.outputs = [(None if r is None else (r.shape, r.dtype, r.device)) for r in user]
        ctx.count = len(inputs)
        ctx.specs = specs
        for r in user:
            if r is not None and not r.is_floating_point():
                ctx.mark_non_differentiable(r)
        return tuple(user)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise BackwardError(
                "double backward through a hostir fusion is not supported: its backward program is not "
                "itself differentiated; call backward without create_graph=True"
            )
        training = ctx.training
        d = training.derivation
        tensors = iter(ctx.saved_tensors)
        scalars = iter(ctx.scalars)
        saved = [_plain(next(tensors)) if is_tensor else next(scalars) for is_tensor in ctx.layout]
        cotangents = []
        for g, out in zip(grads, ctx.outputs):
            if g is None:
                shape, dtype, device = out
                g = torch.zeros(shape, dtype=dtype, device=device)
            elif is_dtensor(g):
                g = g.to_local()
            cotangents.append(g.contiguous())
        # A cotangent read again (an alias a product walks) is the same tensor.
        saved = [cotangents[v.index] if isinstance(v, _Cotangent) else v for v in saved]
        results = training.backward.execute(cotangents + saved, None, ctx.params)
        per_input: list[Any] = [None] * ctx.count
        for i, g in zip(d.grad_inputs, results):
            spec = ctx.specs[i]
            per_input[i] = g if spec is None or g is None else _gradient_like(g, *spec)
        return (None, None, *per_input)
