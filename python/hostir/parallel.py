"""`torch.distributed.tensor.parallel`, run by hostir.

    from hostir.parallel import parallelize_module      # instead of torch's
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = parallelize_module(model, tp_mesh, {"layers.*.mlp.up_proj": ColwiseParallel(), ...})

`parallelize_module(module, device_mesh, parallelize_plan)` takes the same
arguments as torch's and resolves the plan the same way (fully qualified
names with `*` patterns, a style for the module itself, nested dicts as
torch resolves them). Plans use torch's own style objects, or the strings of
Hugging Face plans (`"colwise"`, `"rowwise"`, `"colwise_rep"`,
`"rowwise_rep"`, `"sequence_parallel"`):

- an `nn.Linear` under `ColwiseParallel` or `RowwiseParallel` gets its
  parameters distributed exactly as torch distributes them (DTensors:
  `Shard(0)` weight and bias for colwise, `Shard(1)` weight and replicated
  bias for rowwise), and its forward and backward run as hostir programs:
  one fusion `y = linear(x, w, b)` whose input is sharded as the incoming
  tensor is (`input_layouts` for a plain tensor, its placement for a
  DTensor) and whose output is sharded as `output_layouts` says. hostir
  inserts the communications torch's TP makes: an Allgather of a
  sequence-sharded input, partial sums completed by an Allreduce or a
  ReduceScatter, and in the backward their transposes. Under sequence
  parallelism the gather of a colwise input and the reduce-scatter of a
  rowwise output are decomposed walking the sequence (AG+GEMM and GEMM+RS,
  in the schedule the machine model chooses), and so are their backwards:
  the colwise input gradient's reduce-scatter (GEMM+RS, the re-gather of
  the saved shard running under it) and the rowwise gather of the output
  gradient (AG+GEMM, computing the input gradient as it goes);
  `use_local_output`
  returns the local tensor or the DTensor as torch does;
- `nn.Embedding` under those styles, `SequenceParallel`,
  `PrepareModuleInput`, `PrepareModuleOutput` and any other style run as
  torch runs them (they redistribute activations between the layers);
- a `ColwiseParallel` or `RowwiseParallel` on any other module is a
  `ParallelizeError` at `parallelize_module` time, naming the module and
  the style, before any parameter moves.

Optimizers, `state_dict` and distributed checkpoints see the same DTensor
parameters torch's TP makes.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from hostir import ir
from hostir.errors import HostIrError

__all__ = ["ParallelizeError", "parallelize_module"]


class ParallelizeError(HostIrError, ValueError):
    """A plan entry hostir cannot run."""


def _styles():
    from torch.distributed.tensor.parallel import style

    return style


def _from_string(key: str, text: str):
    from torch.distributed.tensor import Replicate, Shard

    s = _styles()
    table = {
        "colwise": lambda: s.ColwiseParallel(),
        "rowwise": lambda: s.RowwiseParallel(),
        "colwise_rep": lambda: s.ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: s.ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: s.RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: s.SequenceParallel(),
        "rowwise_seq": lambda: s.RowwiseParallel(output_layouts=Shard(1)),
    }
    make = table.get(text)
    if make is None:
        raise ParallelizeError(
            f"plan entry {key!r}: the style {text!r} is not one hostir knows; use torch's ParallelStyle "
            f"objects or one of {sorted(table)}"
        )
    return make()


def parallelize_module(
    module: nn.Module,
    device_mesh: Any = None,
    parallelize_plan: Any = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """torch's `parallelize_module`, with every `nn.Linear` of the plan run
    by hostir (see the module's doc)."""
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    if isinstance(device_mesh, ir.DeviceMesh):
        # hostir's own mesh: the torch mesh of the same ranks, on this
        # rank's device type (torch's styles take torch's meshes only).
        device_mesh = device_mesh.to_torch()
    if parallelize_plan is None:
        return torch_parallelize(module, device_mesh, None, src_data_rank=src_data_rank)
    plan = _converted(parallelize_plan, "")
    _check(module, plan, "")
    result = torch_parallelize(module, device_mesh, plan, src_data_rank=src_data_rank)
    # Each hostir Linear learns its name, for its errors and dumps.
    for name, sub in module.named_modules():
        linear = getattr(sub, "_hostir_linear", None)
        if isinstance(linear, _Linear):
            linear.name = name or "(root)"
    return result


def _converted(plan, key: str):
    """The plan with strings made styles and Linear styles made hostir's."""
    s = _styles()
    if isinstance(plan, str):
        plan = _from_string(key, plan)
    if isinstance(plan, dict):
        return {k: _converted(v, k) for k, v in plan.items()}
    if isinstance(plan, (s.ColwiseParallel, s.RowwiseParallel)):
        return _HostirLinearStyle(plan)
    if not isinstance(plan, s.ParallelStyle):
        raise ParallelizeError(f"plan entry {key!r}: expected a ParallelStyle or a dict of them, got {type(plan).__name__}")
    return plan


def _matches(module: nn.Module, path: str):
    """(name, submodule) pairs `path` resolves to, as torch resolves it
    (each dotted token matched with fnmatch against child names)."""
    found = [("", module)]
    for token in path.split("."):
        found = [
            (f"{prefix}.{name}" if prefix else name, child)
            for prefix, parent in found
            for name, child in parent.named_children()
            if fnmatch.fnmatch(name, token)
        ]
    return found


def _check(module: nn.Module, plan, prefix: str) -> None:
    """Refuse, before anything moves, a Linear style on a module hostir
    cannot run it on."""
    items = plan.items() if isinstance(plan, dict) else [("", plan)]
    for key, style in items:
        targets = [("", module)] if key == "" else _matches(module, key)
        for name, sub in targets:
            fqn = ".".join(p for p in (prefix, name) if p)
            if isinstance(style, dict):
                _check(sub, style, fqn)
                continue
            if isinstance(style, _HostirLinearStyle) and not isinstance(sub, (nn.Linear, nn.Embedding)):
                raise ParallelizeError(
                    f"module {fqn or '(root)'!r} ({type(sub).__name__}) under {style.inner!r}: hostir runs "
                    f"ColwiseParallel and RowwiseParallel on nn.Linear (and nn.Embedding as torch does); "
                    f"apply the style to the Linear layers inside it"
                )


class _HostirLinearStyle(_styles().ParallelStyle):
    """A torch Colwise/Rowwise style whose Linear runs through hostir."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.src_data_rank = getattr(inner, "src_data_rank", 0)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.inner.src_data_rank = self.src_data_rank
        if not isinstance(module, nn.Linear):
            return self.inner._apply(module, device_mesh)
        s = _styles()
        # Parameters placed exactly as torch places them.
        self.inner._partition_linear_fn("", module, device_mesh)
        rowwise = isinstance(self.inner, s.RowwiseParallel)
        module._hostir_linear = _Linear(
            device_mesh,
            self.inner.input_layouts[0],
            self.inner.output_layouts[0],
            self.inner.use_local_output,
            "rowwise" if rowwise else "colwise",
        )
        module.forward = module._hostir_linear.bind(module)
        return module

    def __repr__(self) -> str:
        return f"hostir({self.inner!r})"


class _Linear:
    """The hostir forward of one parallelized nn.Linear: a fusion per input
    signature (placement, rank, dtype), kept."""

    def __init__(self, mesh, input_layout, output_layout, use_local_output: bool, kind: str):
        self.mesh = mesh
        self.input_layout = input_layout
        self.output_layout = output_layout
        self.use_local_output = use_local_output
        self.kind = kind
        self.fusions: dict[tuple, Any] = {}
        # The mesh's device type says where the layer runs: a CPU mesh runs
        # on gloo, on a machine with GPUs too (the default backend there
        # would be NCCL, on the GPU).
        self.backend = {"backend": "gloo"} if mesh.device_type == "cpu" else {}
        self.return_dtensors = not use_local_output
        # The module's fully qualified name (set by parallelize_module).
        self.name = "(a Linear)"

    def bind(self, module: nn.Linear):
        def forward(x):
            return self(module, x)

        return forward

    def __call__(self, module: nn.Linear, x):
        # A plain input is the local piece `input_layout` places (as torch's
        # `DTensor.from_local` takes it): the fusion's input is placed so
        # when defined, and the tensor goes in as it is; a local output
        # comes out as it is. No DTensor is made only to be taken apart.
        local = type(x) is torch.Tensor or not _is_dtensor(x)
        placement = self.input_layout if local else x.placements[0]
        bias = module.bias
        ndim = x.dim()
        key = (placement, ndim, x.dtype, bias is not None, local)
        inputs = [x, module.weight] if bias is None else [x, module.weight, bias]
        try:
            fd = self.fusions.get(key)
            if fd is None:
                where = _placement_key(placement, ndim)
                fd = self._define(ndim, x.dtype, bias is not None, where, placement if local else None)
                # Dumps and logs of its programs (its training's too) name the module.
                fd.executor.label = f" ({self.name}, {self.kind} nn.Linear)"
                self.fusions[key] = fd
            (y,) = fd.execute(inputs, return_dtensors=self.return_dtensors, **self.backend)
        except HostIrError as err:
            err.add_note(self._where(inputs))
            raise
        return y

    def _where(self, inputs) -> str:
        """What the fusion's inputs are in the user's module: the error's note."""
        names = ["the input (activation)", "the weight", "the bias"]
        parts = [f"input {i} is {names[i]} {_shape_of(t)}" for i, t in enumerate(inputs)]
        return f"in module {self.name!r} ({self.kind} nn.Linear, hostir.parallel): " + "; ".join(parts)

    def _define(self, ndim: int, dtype: torch.dtype, bias: bool, placement: tuple = ("replicate",), input_placement=None):
        from hostir.frontend import FusionDefinition
        from hostir.ir import DeviceMesh, ParallelType

        D = self.mesh.size()
        layout = self.output_layout
        out_dim = layout.dim % ndim if layout.is_shard() else None
        # A colwise linear on an activation sharded on a row axis (sequence
        # parallelism) gathers it walking that axis: the AG+GEMM, with the
        # schedule the machine model (or a forced one) picks.
        walked = placement[1] if placement[0] == "shard" and placement[1] < ndim - 1 else None
        if walked is not None and (D < 2 or self.kind != "colwise" or walked == out_dim):
            walked = None
        # A rowwise linear whose output is sharded on a row axis (sequence
        # parallelism) reduce-scatters its partial sums along that axis: the
        # GEMM+RS, walked by marking the same axis of its K-sharded input
        # as a stream axis (each step's partial product is that input's rows).
        scattered = None
        if (
            self.kind == "rowwise"
            and D >= 2
            and input_placement is not None
            and input_placement.is_shard()
            and input_placement.dim % ndim == ndim - 1
            and out_dim is not None
            and out_dim < ndim - 1
        ):
            scattered = out_dim
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1] * ndim, dtype)
            w = fd.define_tensor([-1, -1], dtype)
            b = fd.define_tensor([-1], dtype) if bias else None
            xg = fd.ops.set(x) if walked is not None else x
            y = fd.ops.linear(xg, w, b)
            fd.add_output(y)
        mesh = DeviceMesh(self.mesh)
        if input_placement is not None:
            x.set_device_mesh(mesh)
            if input_placement.is_shard():
                d = input_placement.dim % ndim
                x.outer_split(d, D)
                x.axis(d).parallelize(ParallelType.mesh_x)
            if scattered is not None:
                x.outer_split(scattered, D)
                x.axis(scattered).parallelize(ParallelType.stream)
            elif not input_placement.is_shard() and not input_placement.is_replicate():
                raise ParallelizeError(
                    f"input layout {input_placement!r} of a {self.kind} linear: hostir takes Shard(d) or Replicate()"
                )
        y.set_device_mesh(mesh)
        if layout.is_shard():
            y.outer_split(out_dim, D)
            y.axis(out_dim).parallelize(ParallelType.mesh_x)
        elif not layout.is_replicate():
            raise ParallelizeError(f"output layout {layout!r} of a {self.kind} linear: hostir makes Shard(d) or Replicate()")
        if walked is not None:
            xg.set_device_mesh(mesh)
            for tv in (xg, y):
                # Loop index of the walked axis: one more behind a split output axis.
                at = walked + (tv is y and out_dim is not None and out_dim < walked)
                tv.outer_split(at, D)
                tv.axis(at).parallelize(ParallelType.stream)
        return fd


def _shape_of(t) -> str:
    shape = getattr(t, "shape", None)
    return f"of shape {list(shape)}" if shape is not None else f"({type(t).__name__})"


def _is_dtensor(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _placement_key(p, ndim: int):
    if p.is_shard():
        return ("shard", p.dim % ndim)
    return ("replicate",) if p.is_replicate() else (repr(p),)
