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
A training call whose signature ran before (`_signature`) takes the first
call's record (`_Record`: the parameters, the derivation, where the DTensors
are) instead of deciding it all again, and its node runs the two programs
from their executors' prepared records (`_Runs`), checking before each run
what can change under a record: the environment, the communicator, the
fusion's version and `keep_gathered`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch

from hostir import communicator, ir
from hostir.autodiff import BackwardError, Derivation, derive
from hostir.dtensor import has_dtensors, is_dtensor
from hostir.errors import UsageError
from hostir.runtime import prepared

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
        # A module's name (hostir.parallel's Linears) stays in the labels.
        label = fd.executor.label
        forward.label, backward.label = f"{label} (training forward)", f"{label} (backward)"
        found = cache[key] = Training(d, forward, backward)
    return found


def execute(fd, inputs, outputs, params, return_dtensors, kwargs) -> list[Any]:
    """`fd.execute(inputs, ...)` recording one autograd node.

    A call of a signature that already ran here (see `_signature`) takes
    its `_Record`: what the checks below decided for it, without deciding
    again. The node's two programs then run through their executors'
    prepared calls, as every call does."""
    from hostir.executor import ExecutorParams

    key = _signature(inputs, outputs, params, return_dtensors, kwargs)
    if key is not None:
        record = _lookup(fd.__dict__.get("_training_calls", _NO_CALLS), key)
        if record is not None and record.version == fd.fusion.version and record.keep == _keep_gathered(fd):
            results = list(_Node.apply(record, *inputs))
            return fd._dtensors().wrap_outputs(results) if record.wrap else results
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
    dtensors = tuple(i for i, t in enumerate(inputs) if is_dtensor(t))
    meshes = tuple(inputs[i].device_mesh for i in dtensors)
    record = _Record(fd.fusion.version, _keep_gathered(fd), training_of(fd, wrt), params, wrap, dtensors, meshes)
    results = list(_Node.apply(record, *inputs))
    if key is not None:
        try:
            hash(key)
        except TypeError:
            key = None
    if key is not None:
        calls = fd.__dict__.setdefault("_training_calls", {})
        if len(calls) >= _MAX_CALLS:
            calls.pop(next(iter(calls)))
        calls[key] = record
    return fd._dtensors().wrap_outputs(results) if wrap else results


_NO_CALLS: dict = {}
_MAX_CALLS = 16


class _Record:
    """What `execute` decided for the training calls of one signature: the
    parameters, the derivation and its executors, which inputs are
    DTensors, whether outputs are DTensors. Valid while the fusion keeps
    its version and `fd.keep_gathered` its value; `meshes` keeps the
    DTensor inputs' meshes alive, so that their ids in the signature stay
    theirs. `forward` and `backward` run the two programs."""

    __slots__ = (
        "version", "keep", "training", "params", "wrap", "dtensors", "meshes", "forward", "backward", "_gradient_specs"
    )  # fmt: skip

    def __init__(self, version: int, keep: bool, training: Training, params, wrap: bool, dtensors: tuple, meshes):
        self.version, self.keep, self.training, self.params = version, keep, training, params
        self.wrap, self.dtensors, self.meshes = wrap, dtensors, meshes
        self.forward = _Runs(training.forward, params)
        self.backward = _Runs(training.backward, params)
        self._gradient_specs: dict[int, Any] = {}

    def gradient_spec(self, i: int, spec) -> Any:
        """The spec of DTensor input `i`'s gradients: a copy of the input's,
        made once (the signature fixes its mesh, placements, shape and
        strides), as DTensor's own ops give the outputs of one sharding the
        same spec call after call."""
        found = self._gradient_specs.get(i)
        if found is None:
            found = self._gradient_specs[i] = copy.copy(spec)
        return found


class _Runs:
    """A program's calls from one `_Record`: `executor.execute(inputs, None,
    params)`, made from the executor's prepared record of the inputs'
    signature once one exists, without working out the parts of the
    signature the record fixes (the parameters) or that are checked here
    instead (the environment, the communicator, the program's version)."""

    __slots__ = ("executor", "params", "_ready", "_environment", "_comm")

    def __init__(self, executor, params) -> None:
        self.executor, self.params = executor, params
        # Per inputs' signature, the executor's prepared record.
        self._ready: dict[tuple, Any] = {}
        self._environment: tuple | None = None
        self._comm: Any = None

    def __call__(self, inputs: list) -> list:
        key = prepared.tensor_signatures(inputs)
        ready = self._ready.get(key) if key is not None else None
        if (
            ready is not None
            and ready.version == self.executor.fusion.version
            and prepared.environment() == self._environment
            and communicator.live() is self._comm
        ):
            results = self.executor.run_prepared(ready, inputs)
            if results is not None:
                return results
        results = self.executor.execute(inputs, None, self.params)
        if key is not None:
            environment, comm = prepared.environment(), communicator.live()
            if (environment, comm) != (self._environment, self._comm):
                self._ready.clear()
                self._environment, self._comm = environment, comm
            ready = self.executor.recall(inputs, self.params) if environment is not None else None
            if ready is not None and len(self._ready) < _MAX_CALLS:
                self._ready[key] = ready
        return results


def _keep_gathered(fd) -> bool:
    return bool(getattr(fd, "keep_gathered", False))


def _signature(inputs, outputs, params, return_dtensors, kwargs) -> tuple | None:
    """The signature of a training call that decides everything `execute`
    checks before the node runs: per input its type, shape, strides, dtype,
    device and requires_grad (a DTensor's mesh, placements, global shape
    and strides, and its local shard's strides, dtype and device),
    `return_dtensors` and the keyword arguments with their types. None (no
    record) for a call with outputs or an ExecutorParams, or an argument
    other than a tensor or a DTensor; an unhashable keyword argument finds
    and keeps no record."""
    if outputs is not None or params is not None or type(inputs) not in (list, tuple):
        return None
    dtensor = _dtensor_type()
    found = []
    for t in inputs:
        kind = type(t)
        if kind is torch.Tensor:
            found.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        elif kind is dtensor:
            spec, local = t._spec, t._local_tensor
            found.append((id(spec.mesh), spec.placements, spec.shape, spec.stride, local.stride(), local.dtype,
                          local.device, t.requires_grad))  # fmt: skip
        else:
            return None
    # Hashed once, by the lookup (`_lookup`): an unhashable keyword
    # argument makes the call keep no record.
    return (tuple(found), return_dtensors, tuple([(name, type(v), v) for name, v in kwargs.items()]))


def _lookup(calls: dict, key: tuple) -> _Record | None:
    try:
        return calls.get(key)
    except TypeError:
        return None


def _dtensor_type():
    return ir.loaded_class("torch.distributed.tensor._api", "DTensor")


def _plain(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def _local(t):
    """A DTensor's local shard (its own tensor, not a view with a grad
    node); anything else as it is."""
    return t._local_tensor if is_dtensor(t) else t


def _gradient_like(g: torch.Tensor, spec, local_stride: tuple, own_spec=None) -> Any:
    """The gradient of a DTensor input from its local shard `g`: placed as
    the input (whose spec is `spec` and whose local shard had strides
    `local_stride`), a Partial placement as Replicate, as the backward of
    `DTensor.to_local` places it. With the input's own placements and
    strides it takes a copy of the input's spec (`own_spec`, where the
    caller keeps one), without `to_local`'s `from_local`."""
    from torch.distributed.tensor import DTensor, Replicate

    if g.stride() == local_stride and not any(p.is_partial() for p in spec.placements):
        return DTensor(g, own_spec or copy.copy(spec), requires_grad=False)
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


def _unviewed(outputs, inputs) -> list:
    """`outputs` with each view of memory the program made (a piece of one
    of its buffers) returned as a plain tensor over the same memory: torch
    refuses an in-place op on a custom Function's output that is a view,
    and such a view is no input's. A view of an input stays a view."""
    storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    return [
        r.detach()
        if isinstance(r, torch.Tensor) and r._is_view() and r.untyped_storage().data_ptr() not in storages
        else r
        for r in outputs
    ]


class _Node(torch.autograd.Function):
    @staticmethod
    def forward(ctx, record: _Record, *inputs):
        d = record.training.derivation
        specs = None
        if record.dtensors:
            specs = [None] * len(inputs)
            inputs = list(inputs)
            for i in record.dtensors:
                t = inputs[i]
                local = t._local_tensor
                specs[i] = (t._spec, local.stride())
                inputs[i] = local
        results = record.forward([t.detach() if isinstance(t, torch.Tensor) else t for t in inputs])
        user = _unviewed(results[: d.user_outputs], inputs)
        saved = [
            inputs[i] if kind == "input" else results[i] if kind == "output" else _Cotangent(i) for kind, i in d.saved
        ]
        if any(t is None for t in saved):
            saved = _placeholders(d, saved, inputs)
        ctx.save_for_backward(*[t for t in saved if isinstance(t, torch.Tensor)])
        ctx.layout = [isinstance(t, torch.Tensor) for t in saved]
        ctx.scalars = [t for t in saved if not isinstance(t, torch.Tensor)]
        ctx.record = record
        ctx.outputs = [(None if r is None else (r.shape, r.dtype, r.device)) for r in user]
        ctx.count = len(inputs)
        # A program may run elsewhere than its inputs (CPU tensors of a
        # mesh program on a GPU machine, copied there): each gradient goes
        # back to its input's device, as autograd requires.
        ctx.devices = [t.device if isinstance(t, torch.Tensor) else None for t in inputs]
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
        record = ctx.record
        d = record.training.derivation
        tensors = iter(ctx.saved_tensors)
        scalars = iter(ctx.scalars)
        saved = [next(tensors).detach() if is_tensor else next(scalars) for is_tensor in ctx.layout]
        cotangents = []
        for g, out in zip(grads, ctx.outputs):
            if g is None:
                shape, dtype, device = out
                g = torch.zeros(shape, dtype=dtype, device=device)
            elif type(g) is not torch.Tensor and is_dtensor(g):
                g = g.to_local()
            cotangents.append(g.contiguous())
        # A cotangent read again (an alias a product walks) is the same tensor.
        if ctx.scalars:
            saved = [cotangents[v.index] if isinstance(v, _Cotangent) else v for v in saved]
        results = record.backward(cotangents + saved)
        per_input: list[Any] = [None] * ctx.count
        specs = ctx.specs
        for i, g in zip(d.grad_inputs, results):
            if g is not None and ctx.devices[i] is not None and g.device != ctx.devices[i]:
                g = g.to(ctx.devices[i])
            if specs is None or specs[i] is None or g is None:
                per_input[i] = g
            else:
                per_input[i] = _gradient_like(g, *specs[i], record.gradient_spec(i, specs[i][0]))
        return (None, *per_input)
