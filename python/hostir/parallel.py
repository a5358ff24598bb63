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
  returns the local tensor or the DTensor as torch does. Colwise siblings
  that their parent calls on one input (q, k and v; gate and up) run as one
  program, one gather feeding every product (`_Group`;
  `group_siblings=False` turns it off). Under
  `torch.compile` such a Linear is one opaque operator,
  `torch.ops.hostir.linear` (its backward `torch.ops.hostir.linear_backward`),
  with a fake implementation that gives this rank's output shape: dynamo
  traces no hostir code, so a model of these Linears compiles without a
  graph break, with `fullgraph=True` too (`docs/compile.md`);
- `nn.Embedding` under those styles, `SequenceParallel`,
  `PrepareModuleInput`, `PrepareModuleOutput` and any other style run as
  torch runs them (they redistribute activations between the layers);
- a MoE block's experts module under hostir's `ExpertParallel` (Hugging
  Face's `Qwen2MoeExperts`, `MixtralExperts`, ...) gets its experts
  sharded over the mesh and runs as `hostir.moe.MoELayer`: each rank's
  tokens dispatched to their experts' ranks and combined back, forward and
  backward (`docs/moe.md`);
- a `ColwiseParallel` or `RowwiseParallel` on any other module, or an
  `ExpertParallel` on a module without experts' weights, is a
  `ParallelizeError` at `parallelize_module` time, naming the module and
  the style, before any parameter moves.

Optimizers, `state_dict` and distributed checkpoints see the same DTensor
parameters torch's TP makes.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import weakref
from typing import Any

import torch
from torch import nn

from hostir import autograd, ir
from hostir.errors import HostIrError
from hostir.executor import ExecutorParams

__all__ = ["ExpertParallel", "ParallelizeError", "parallelize_module"]


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
    group_siblings: bool | None = None,
) -> nn.Module:
    """torch's `parallelize_module`, with every `nn.Linear` of the plan run
    by hostir (see the module's doc). `group_siblings` (default: on, unless
    `HOSTIR_GROUP_SIBLINGS=0`) lets colwise siblings that read one input
    run as one program (`_Group`)."""
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    if isinstance(device_mesh, ir.DeviceMesh):
        # hostir's own mesh: the torch mesh of the same ranks, on this
        # rank's device type (torch's styles take torch's meshes only).
        device_mesh = device_mesh.to_torch()
    if parallelize_plan is None:
        return torch_parallelize(module, device_mesh, None, src_data_rank=src_data_rank)
    plan = _converted(parallelize_plan, "")
    _check(module, plan, "", device_mesh.size())
    result = torch_parallelize(module, device_mesh, plan, src_data_rank=src_data_rank)
    # Each hostir Linear learns its name, for its errors and dumps.
    for name, sub in module.named_modules():
        linear = getattr(sub, "_hostir_linear", None)
        if isinstance(linear, _Linear):
            linear.name = name or "(root)"
    if group_siblings is None:
        group_siblings = os.environ.get("HOSTIR_GROUP_SIBLINGS", "1") != "0"
    if group_siblings:
        _group_siblings(module)
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
        raise ParallelizeError(
            f"plan entry {key!r}: expected a ParallelStyle or a dict of them, got {type(plan).__name__}"
        )
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


def _check(module: nn.Module, plan, prefix: str, D: int) -> None:
    """Refuse, before anything moves, a Linear style or `ExpertParallel` on
    a module hostir cannot run it on (D: the mesh's size)."""
    items = plan.items() if isinstance(plan, dict) else [("", plan)]
    for key, style in items:
        targets = [("", module)] if key == "" else _matches(module, key)
        for name, sub in targets:
            fqn = ".".join(p for p in (prefix, name) if p)
            if isinstance(style, dict):
                _check(sub, style, fqn, D)
                continue
            if isinstance(style, ExpertParallel):
                style.check(sub, fqn, D)
                continue
            if isinstance(style, _HostirLinearStyle) and not isinstance(sub, (nn.Linear, nn.Embedding)):
                raise ParallelizeError(
                    f"module {fqn or '(root)'!r} ({type(sub).__name__}) under {style.inner!r}: hostir runs "
                    f"ColwiseParallel and RowwiseParallel on nn.Linear (and nn.Embedding as torch does); "
                    f"apply the style to the Linear layers inside it"
                )


def _activation_of(module: nn.Module) -> str | None:
    """The unary kind that computes an experts module's `act_fn`, found by
    running both on the same points (a module of any name: Hugging Face's
    SiLUActivation, torch's nn.SiLU, a plain function)."""
    from hostir.kinds import UnaryKind

    act = getattr(module, "act_fn", None)
    if not callable(act):
        return None
    points = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            values = act(points)
    except Exception:  # noqa: BLE001 - an act_fn that cannot run here is one hostir cannot name
        return None
    for name in ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "tanh"):
        kind = UnaryKind(name)
        if torch.allclose(values, kind.torch_fn(points), rtol=1e-6, atol=1e-9):
            return name
    return None


class ExpertParallel(_styles().ParallelStyle):
    """Expert parallelism for the experts of a mixture-of-experts block:
    the style of the module that holds them (Hugging Face's
    `Qwen2MoeExperts`, `MixtralExperts`, `Qwen3MoeExperts`, ...: weights
    `gate_up_proj` [E, 2F, H] and `down_proj` [E, H, F], an `act_fn`, and
    `forward(hidden_states, top_k_index, top_k_weights)`).

    Its parameters become `Shard(0)` DTensors (rank r holds experts r*E/D
    to (r+1)*E/D - 1), and its forward runs `hostir.moe.MoELayer`: each
    rank's tokens dispatched to the ranks of their experts by an AllToAll,
    the experts as batched matmuls, and the results combined back, forward
    and backward. The rest of the block (the router, a shared expert) runs
    as torch runs it, on each rank's own tokens: data parallel, so their
    gradients are each rank's own (sum them across ranks as DDP or FSDP
    do). `capacity`: slots per expert and source rank (None: as many as
    the tokens, nothing dropped). `exact`: the layer's exact form instead
    (the counts exchanged first, only the real rows moved, the experts as
    grouped GEMMs; `capacity` then bounds the rows a rank sends a peer).
    Other keywords go to the layer (`overlap=True` with `exact=True`
    walks the exact form; `capacity_factor`) or to its `execute`."""

    def __init__(self, capacity: int | None = None, exact: bool = False, **execute_kwargs):
        super().__init__()
        self.capacity = capacity
        self.exact = exact
        self.execute_kwargs = execute_kwargs

    def check(self, module: nn.Module, fqn: str, D: int) -> None:
        """Refuse, before anything moves, a module this style cannot run."""
        where = f"module {fqn or '(root)'!r} ({type(module).__name__}) under ExpertParallel"
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise ParallelizeError(
                f"{where}: hostir runs the experts module of a MoE block, whose weights are gate_up_proj "
                f"[E, 2F, H] and down_proj [E, H, F]; apply the style to the block's `experts`"
            )
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] or gate_up.shape[1] % 2:
            raise ParallelizeError(
                f"{where}: gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not "
                f"[E, 2F, H] and [E, H, F]"
            )
        if gate_up.shape[0] % D:
            raise ParallelizeError(f"{where}: its {gate_up.shape[0]} experts do not divide over {D} ranks")
        if _activation_of(module) is None:
            raise ParallelizeError(f"{where}: hostir has no unary op for its activation {module.act_fn!r}")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        from hostir.moe import MoELayer

        self.check(module, "", device_mesh.size())
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(module, name)
            dist = distribute_tensor(p.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            setattr(module, name, nn.Parameter(dist, requires_grad=p.requires_grad))
        kwargs = dict(self.execute_kwargs)
        if device_mesh.device_type == "cpu":
            kwargs.setdefault("backend", "gloo")
        layer = MoELayer(
            ir.DeviceMesh(device_mesh.mesh.flatten().tolist()),
            module.gate_up_proj.shape[0],
            _activation_of(module),
            self.capacity,
            exact=self.exact,
            **kwargs,
        )
        module._hostir_moe = layer

        def forward(hidden_states, top_k_index, top_k_weights):
            # gate_up_proj as it is: the layer's program cuts it into gate
            # and up (views) and joins their gradients in one cat.
            gate_up, down = module.gate_up_proj.to_local(), module.down_proj.to_local()
            return layer(hidden_states, top_k_index, top_k_weights, gate_up, down)

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return f"hostir.parallel.ExpertParallel(capacity={self.capacity})"


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
        module._hostir_linear = linear = _Linear(
            device_mesh,
            self.inner.input_layouts[0],
            self.inner.output_layouts[0],
            self.inner.use_local_output,
            "rowwise" if rowwise else "colwise",
        )
        module.forward = linear.bind(module)
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
        # Its number in the custom ops' table (`torch.ops.hostir.linear`).
        self.handle = next(_HANDLES)
        _LINEARS[self.handle] = self
        # The `_Group` of its siblings reading one input, if it has one.
        self.group: _Group | None = None

    def bind(self, module: nn.Linear):
        def forward(x):
            if torch.compiler.is_compiling():
                return self.compiled(module, x)
            group = self.group
            if group is not None:
                y = group.call(self, x)
                if y is not None:
                    return y
            return self(module, x)

        return forward

    def compiled(self, module: nn.Linear, x):
        """The forward as torch.compile traces it: one opaque op,
        `torch.ops.hostir.linear`, on the local tensors (the DTensor
        parameters' `to_local()`, whose backward places their gradients as
        the parameters), so that no hostir code is traced."""
        local = not _is_dtensor(x)
        placement = self.input_layout if local else x.placements[0]
        if not (placement.is_shard() or placement.is_replicate()):
            raise ParallelizeError(
                f"input layout {placement!r} of a {self.kind} linear: hostir takes Shard(d) or Replicate()"
            )
        shard = placement.dim % x.dim() if placement.is_shard() else -1
        weight = module.weight.to_local() if _is_dtensor(module.weight) else module.weight
        bias = module.bias
        if bias is not None and _is_dtensor(bias):
            bias = bias.to_local()
        y = torch.ops.hostir.linear(self.handle, x if local else x.to_local(), weight, bias, shard)
        if not self.return_dtensors:
            return y
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(y, self.mesh, [self.output_layout], run_check=False)

    def fusion(self, shard: int, ndim: int, dtype: torch.dtype, bias: bool):
        """The fusion of a local input sharded on axis `shard` (-1:
        replicated) with `ndim` axes, and of the parameters' local shards:
        the eager forward's fusion, with the weight and bias placed as the
        DTensor parameters place them there."""
        from torch.distributed.tensor import Replicate, Shard

        placement = Replicate() if shard < 0 else Shard(shard)
        key = (placement, ndim, dtype, bias, "local parameters")
        fd = self.fusions.get(key)
        if fd is None:
            fd = self._define(ndim, dtype, bias, _placement_key(placement, ndim), placement, local_parameters=True)
            fd.executor.label = f" ({self.name}, {self.kind} nn.Linear)"
            self.fusions[key] = fd
        return fd

    def local_output_shape(self, x_shape, weight_shape, shard: int) -> list:
        """The shape of this rank's output for a local input of `x_shape`
        sharded on axis `shard` (-1: replicated) and a local weight of
        `weight_shape` (symbolic sizes too: torch.compile's fake tensors)."""
        D = self.mesh.size()
        whole = list(x_shape)
        if shard >= 0:
            whole[shard] = whole[shard] * D
        # The weight's rows are the output features: sharded for colwise.
        features = weight_shape[0] * D if self.kind == "colwise" else weight_shape[0]
        shape = whole[:-1] + [features]
        if self.output_layout.is_shard():
            out = self.output_layout.dim % len(shape)
            shape[out] = shape[out] // D
        return shape

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

    def _define(
        self,
        ndim: int,
        dtype: torch.dtype,
        bias: bool,
        placement: tuple = ("replicate",),
        input_placement=None,
        local_parameters: bool = False,
        count: int = 1,
    ):
        """The fusion of `count` linears of this layout reading one input
        (`x`, then each linear's weight and bias, in that order; one output
        per linear): one, or the siblings of a `_Group`, whose gather of a
        sequence-sharded input feeds every product."""
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
            params = []
            for _ in range(count):
                w = fd.define_tensor([-1, -1], dtype)
                params.append((w, fd.define_tensor([-1], dtype) if bias else None))
            xg = fd.ops.set(x) if walked is not None else x
            ys = [fd.ops.linear(xg, w, b) for w, b in params]
            for y in ys:
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
        if not (layout.is_shard() or layout.is_replicate()):
            raise ParallelizeError(
                f"output layout {layout!r} of a {self.kind} linear: hostir makes Shard(d) or Replicate()"
            )
        for y in ys:
            y.set_device_mesh(mesh)
            if layout.is_shard():
                y.outer_split(out_dim, D)
                y.axis(out_dim).parallelize(ParallelType.mesh_x)
        if local_parameters:
            # Placed as torch's styles place the parameters: the weight's
            # rows (colwise) or columns (rowwise) sharded, the bias sharded
            # with the rows or replicated.
            for w, b in params:
                sharded = [(w, 0)] + ([(b, 0)] if b is not None else []) if self.kind == "colwise" else [(w, 1)]
                for tv in (w, b) if b is not None else (w,):
                    tv.set_device_mesh(mesh)
                for tv, d in sharded:
                    tv.outer_split(d, D)
                    tv.axis(d).parallelize(ParallelType.mesh_x)
        if walked is not None:
            xg.set_device_mesh(mesh)
            for tv in (xg, *ys):
                # Loop index of the walked axis: one more behind a split output axis.
                at = walked + (tv is not xg and out_dim is not None and out_dim < walked)
                tv.outer_split(at, D)
                tv.axis(at).parallelize(ParallelType.stream)
        return fd


def _group_siblings(root: nn.Module) -> None:
    """A `_Group` for each set of two or more hostir colwise Linears that
    are children of one module and alike: the same mesh, input and output
    layouts, local output or not, input features, bias or none, dtype and
    device. Each learns from its parent's first call whether they read one
    input."""
    for parent in root.modules():
        alike: dict[tuple, list[nn.Linear]] = {}
        for child in parent.children():
            linear = getattr(child, "_hostir_linear", None)
            if not isinstance(linear, _Linear) or linear.kind != "colwise" or linear.group is not None:
                continue
            key = (
                id(linear.mesh),
                repr(linear.input_layout),
                repr(linear.output_layout),
                linear.use_local_output,
                child.in_features,
                child.bias is not None,
                child.weight.dtype,
                child.weight.device,
            )
            alike.setdefault(key, []).append(child)
        for members in alike.values():
            if len(members) > 1:
                _Group(parent, members)


class _Group:
    """Colwise sibling Linears that their parent calls on one input
    (attention's q, k and v; an MLP's gate and up), run as one program: one
    gather of a sequence-sharded input feeding every product (the AG+GEMM
    ring computes each arriving piece's products for all of them), one
    program call instead of one per Linear, and in the backward one program
    of the Linear of their concatenated weights (one reduce-scatter or
    all-reduce of the input gradient, one re-gather).

    It learns from the parent's first call: when that call runs each member
    exactly once, all on one tensor, the group is armed; otherwise it is
    off for good and each member runs on its own. Armed, a member's call
    runs the group's program and keeps its siblings' outputs, which their
    calls on the same tensor (unchanged since) return; a call on another
    tensor runs the program again. A parent call that leaves an output
    unread turns the group off. Outside the parent's forward, and under
    torch.compile, each member runs on its own."""

    def __init__(self, parent: nn.Module, members: list[nn.Linear]):
        self.modules = members
        self.linears = [m._hostir_linear for m in members]
        for linear in self.linears:
            linear.group = self
        lead = self.linears[0]
        self.lead = lead
        # The backward's Linear: the members' weights concatenated by rows.
        self.concat = _Linear(lead.mesh, lead.input_layout, lead.output_layout, True, "colwise")
        self.concat.name = "+".join(linear.name for linear in self.linears)
        self.fusions: dict[tuple, Any] = {}
        self.weights = self._share_weights()
        self.state = "learning"
        self.depth = 0
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.kept: dict[int, tuple[torch.Tensor, int, tuple, torch.Tensor]] = {}
        parent.register_forward_pre_hook(self._begin)
        parent.register_forward_hook(self._end, always_call=True)

    def _share_weights(self) -> torch.Tensor | None:
        """One buffer of every member's local weight shard, by rows, each
        member's DTensor parameter made again over its rows: the backward's
        concatenated weight, without a copy. None where the weights are not
        DTensors (each call then concatenates them)."""
        from torch.distributed.tensor import DTensor

        weights = [m.weight for m in self.modules]
        if not all(_is_dtensor(w) for w in weights):
            return None
        with torch.no_grad():
            buffer = torch.cat([w.to_local() for w in weights], 0)
        start = 0
        for m, w in zip(self.modules, weights):
            rows = w.to_local().shape[0]
            local = buffer.narrow(0, start, rows)
            start += rows
            shared = DTensor.from_local(local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())
            m.weight = nn.Parameter(shared, requires_grad=w.requires_grad)
        return buffer

    def concatenated(self, weights) -> torch.Tensor:
        """The members' local weights `weights` as one tensor by rows: the
        shared buffer while each still lies where it was put there (an
        optimizer's in-place step keeps it so; `module.to(...)` or loading
        new tensors does not), else a copy."""
        buffer = self.weights
        if buffer is not None:
            step = buffer.stride(0) * buffer.element_size()
            at, start = buffer.data_ptr(), 0
            shared = buffer.untyped_storage().data_ptr()
            for w in weights:
                if (
                    w.untyped_storage().data_ptr() != shared
                    or w.data_ptr() != at + start * step
                    or w.dtype != buffer.dtype
                    or w.shape[1:] != buffer.shape[1:]
                    or not w.is_contiguous()
                ):
                    break
                start += w.shape[0]
            else:
                if start == buffer.shape[0]:
                    return buffer
        return torch.cat(weights, 0)

    def _begin(self, _module, _args) -> None:
        self.depth += 1
        if self.depth == 1:
            self.calls.clear()
            self.kept.clear()

    def _end(self, _module, _args, _output) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        if self.state == "learning":
            seen = sorted(i for i, _ in self.calls)
            one_input = all(x is self.calls[0][1] for _, x in self.calls)
            self.state = "armed" if seen == list(range(len(self.linears))) and one_input else "off"
        elif self.state == "armed" and self.kept:
            self.state = "off"  # outputs made and never read: the parent's calls changed
        self.calls.clear()
        self.kept.clear()

    def _versions(self) -> tuple:
        return tuple(m.weight._version for m in self.modules)

    def _placed(self) -> bool:
        """Whether every member's parameters are still placed as the style
        placed them (DTensors sharded by rows on the group's mesh), so that
        their local tensors are the shards the group's program takes; a
        parameter made anew otherwise (another mesh, a plain tensor) makes
        each member run alone."""
        from torch.distributed.tensor import Shard

        for m in self.modules:
            for t in (m.weight, m.bias):
                if t is None:
                    continue
                if not _is_dtensor(t) or t.device_mesh != self.lead.mesh or tuple(t.placements) != (Shard(0),):
                    return False
        return True

    def call(self, linear: _Linear, x):
        """The member's output from the group, or None where it runs alone."""
        if self.depth == 0 or self.state == "off" or not isinstance(x, torch.Tensor) or not self._placed():
            return None
        i = self.linears.index(linear)
        if self.state == "learning":
            self.calls.append((i, x))
            return None
        kept = self.kept.pop(i, None)
        if kept is not None and kept[0] is x and kept[1] == x._version and kept[2] == self._versions():
            return kept[3]
        outputs = self.run(x)
        version, weights = x._version, self._versions()
        self.kept = {j: (x, version, weights, y) for j, y in enumerate(outputs) if j != i}
        return outputs[i]

    def fusion(self, shard: int, ndim: int, dtype: torch.dtype, bias: bool):
        """The forward fusion of every member on a local input sharded on
        axis `shard` (-1: replicated), their parameters local shards."""
        from torch.distributed.tensor import Replicate, Shard

        placement = Replicate() if shard < 0 else Shard(shard)
        key = (placement, ndim, dtype, bias)
        fd = self.fusions.get(key)
        if fd is None:
            fd = self.lead._define(
                ndim, dtype, bias, _placement_key(placement, ndim), placement, local_parameters=True,
                count=len(self.linears),
            )
            fd.executor.label = f" ({self.concat.name}, {len(self.linears)} colwise nn.Linear siblings)"
            self.fusions[key] = fd
        return fd

    def run(self, x) -> list:
        """Every member's output for input `x`."""
        local = not _is_dtensor(x)
        placement = self.lead.input_layout if local else x.placements[0]
        if not (placement.is_shard() or placement.is_replicate()):
            raise ParallelizeError(
                f"input layout {placement!r} of a colwise linear: hostir takes Shard(d) or Replicate()"
            )
        shard = placement.dim % x.dim() if placement.is_shard() else -1
        weights = [m.weight.to_local() if _is_dtensor(m.weight) else m.weight for m in self.modules]
        biases = []
        if self.modules[0].bias is not None:
            biases = [m.bias.to_local() if _is_dtensor(m.bias) else m.bias for m in self.modules]
        outputs = _GroupLinear.apply(self, shard, x if local else x.to_local(), *weights, *biases)
        if not self.lead.return_dtensors:
            return list(outputs)
        from torch.distributed.tensor import DTensor

        return [DTensor.from_local(y, self.lead.mesh, [self.lead.output_layout], run_check=False) for y in outputs]


class _GroupLinear(torch.autograd.Function):
    """A `_Group`'s forward program, and as its backward the backward
    program of the Linear of the members' concatenated weights."""

    @staticmethod
    def forward(ctx, group: _Group, shard: int, x: torch.Tensor, *params: torch.Tensor):
        n = len(group.linears)
        weights, biases = list(params[:n]), list(params[n:])
        inputs = [x]
        for i in range(n):
            inputs += [weights[i]] + ([biases[i]] if biases else [])
        try:
            fd = group.fusion(shard, x.dim(), x.dtype, bool(biases))
            with torch.no_grad():
                outputs = fd.execute(inputs, **group.lead.backend)
        except HostIrError as err:
            err.add_note(
                f"in the colwise siblings {group.concat.name!r} (hostir.parallel), input {_shape_of(x)}, "
                f"weights {', '.join(_shape_of(w) for w in weights)}"
            )
            raise
        ctx.group, ctx.shard = group, shard
        ctx.save_for_backward(x, *params)
        return tuple(_own(y, inputs).detach() for y in outputs)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        n = len(group.linears)
        x, *params = ctx.saved_tensors
        weights, biases = params[:n], params[n:]
        features = [w.shape[0] for w in weights]
        grads = [
            g if g is not None else x.new_zeros((*_output_lead(x, ctx.shard, group), f))
            for g, f in zip(grads, features)
        ]
        needs = ctx.needs_input_grad
        wrt = [i for i, needed in ((0, needs[2]), (1, any(needs[3 : 3 + n])), (2, any(needs[3 + n :]))) if needed]
        found: dict[int, torch.Tensor] = {}
        if wrt:
            weight = group.concatenated(weights)
            bias = torch.cat(biases, 0) if biases else None
            found = dict(zip(wrt, _backward(group.concat, torch.cat(grads, -1), x, weight, bias, ctx.shard, wrt)))
        gx = found.get(0)
        gw = list(found[1].split(features, 0)) if 1 in found else [None] * n
        gb = list(found[2].split(features, 0)) if 2 in found else [None] * len(biases)
        return None, None, gx, *gw, *gb


def _output_lead(x: torch.Tensor, shard: int, group: _Group) -> list[int]:
    """The leading axes of a member's local output for local input `x`."""
    shape = group.lead.local_output_shape(list(x.shape), [1, x.shape[-1]], shard)
    return shape[:-1]


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


# The parallelized Linears, by handle, for the custom ops below (a module
# dropped drops its entry).
_LINEARS: weakref.WeakValueDictionary[int, _Linear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _linear_of(handle: int) -> _Linear:
    linear = _LINEARS.get(handle)
    if linear is None:
        raise ParallelizeError(f"hostir.parallel Linear {handle} no longer exists (its module was dropped)")
    return linear


def _own(t: torch.Tensor, inputs) -> torch.Tensor:
    """`t` contiguous and sharing no memory with `inputs`, as a custom op's
    output must be (a team of one rank may hand back a view)."""
    shared = any(i is not None and i.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for i in inputs)
    return t.clone(memory_format=torch.contiguous_format) if shared else t.contiguous()


@torch.library.custom_op("hostir::linear", mutates_args=())
def _linear_op(
    handle: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard: int
) -> torch.Tensor:
    """A hostir.parallel Linear's forward program on local tensors: `x`
    sharded on axis `shard` (-1: replicated), `weight` and `bias` this
    rank's shards; its output this rank's piece of the module's output."""
    linear = _linear_of(handle)
    inputs = [x, weight] if bias is None else [x, weight, bias]
    try:
        fd = linear.fusion(shard, x.dim(), x.dtype, bias is not None)
        with torch.no_grad():
            (y,) = fd.execute(inputs, **linear.backend)
    except HostIrError as err:
        err.add_note(linear._where(inputs))
        raise
    return _own(y, inputs)


@_linear_op.register_fake
def _(handle: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard: int) -> torch.Tensor:
    linear = _linear_of(handle)
    return x.new_empty(linear.local_output_shape(x.shape, weight.shape, shard))


@torch.library.custom_op("hostir::linear_backward", mutates_args=())
def _linear_backward_op(
    handle: int,
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shard: int,
    wrt: list[int],
) -> list[torch.Tensor]:
    """The backward program of `hostir::linear` for the gradients of its
    tensor inputs `wrt` (0: x, 1: weight, 2: bias), in that order."""
    return _backward(_linear_of(handle), grad, x, weight, bias, shard, wrt)


def _backward(linear: _Linear, grad, x, weight, bias, shard: int, wrt) -> list[torch.Tensor]:
    """The gradients `wrt` (0: x, 1: weight, 2: bias) of `linear`'s
    forward on local tensors, by the backward program hostir derives for
    it (the weight and bias this rank's shards)."""
    inputs = [x, weight] if bias is None else [x, weight, bias]
    try:
        fd = linear.fusion(shard, x.dim(), x.dtype, bias is not None)
        training = autograd.training_of(fd, tuple(wrt))
        d = training.derivation
        saved = []
        for kind, i in d.saved:
            if kind == "output":
                # The derivation of a Linear saves its inputs only; a
                # program that also saved an intermediate would need it
                # returned by the forward op.
                raise ParallelizeError(
                    f"{linear.name}: the backward reads a forward output, which the op does not keep"
                )
            saved.append(inputs[i] if kind == "input" else grad)
        params = ExecutorParams.from_arguments(None, dict(linear.backend))
        with torch.no_grad():
            results = training.backward.execute([grad.contiguous(), *saved], None, params)
    except HostIrError as err:
        err.add_note(linear._where(inputs))
        raise
    by_input = dict(zip(d.grad_inputs, results))
    return [_own(by_input[i], inputs) for i in wrt]


@_linear_backward_op.register_fake
def _(handle, grad, x, weight, bias, shard, wrt):
    inputs = [x, weight, bias]
    return [inputs[i].new_empty(inputs[i].shape) for i in wrt]


def _linear_setup(ctx, inputs, output) -> None:
    handle, x, weight, bias, shard = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.handle, ctx.shard = handle, shard


def _linear_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    wrt = [i for i, needed in enumerate(ctx.needs_input_grad[1:4]) if needed]
    grads: list[torch.Tensor | None] = [None, None, None]
    if wrt:
        for i, g in zip(wrt, torch.ops.hostir.linear_backward(ctx.handle, grad, x, weight, bias, ctx.shard, wrt)):
            grads[i] = g
    return None, *grads, None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)
