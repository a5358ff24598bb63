"""Training calls at world size 1: a communication over a team of one rank
moves nothing (its output is a view of its input, or a copy into a buffer
the caller gave), a permute with device axes is a view, and the machine
model's hoisting choice is made once per input signature. Results against
eager torch on random data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hostir import FusionDefinition, ParallelType, communicator, ir, planner
from hostir.lower import lower
from hostir.runtime.bind import Binding
from hostir.runtime.evaluator import HostIrEvaluator
from one_rank_linears import MESH, one_rank_linear


class _Ops(TorchDispatchMode):
    """The torch ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, *prefixes: str) -> int:
        return sum(n.startswith(prefixes) for n in self.names)


def test_a_one_rank_allreduce_is_lowered_as_ever(plain_process):
    # The program keeps its communication (the same program on every rank
    # count); running it is what changes.
    fd = one_rank_linear("K")
    program = lower(fd.fusion, rank=0, backend="gloo").program
    (comm,) = [e for e in program.walk() if isinstance(e, ir.Communication)]
    assert comm.type is ir.CommunicationType.Allreduce and comm.team == (0,)


def test_a_one_rank_allreduce_moves_nothing(plain_process):
    fd = one_rank_linear("K")
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    fd.execute([x, w], backend="gloo")
    ops = _Ops()
    with ops:
        (y,) = fd.execute([x, w], backend="gloo")
    torch.testing.assert_close(y, nn.functional.linear(x, w))
    assert ops.count("c10d.") == 0, ops.names
    assert ops.count("aten.copy_", "aten.clone", "aten.empty") == 0, ops.names


def test_a_one_rank_allreduce_writes_into_a_preallocated_output(plain_process):
    fd = one_rank_linear("K")
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    out = torch.full((6, 5), float("nan"))
    (y,) = fd.execute([x, w], outputs=[out], backend="gloo")
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, nn.functional.linear(x, w))


def _one_rank_program(fd, inputs):
    comm = communicator.get(backend="gloo")
    lowered = lower(fd.fusion, rank=0, backend="gloo")
    comm.ensure_groups(lowered.teams)
    program = lowered.program
    evaluator = HostIrEvaluator(program, communicator=comm, rank=0)
    binding = Binding.of(program)
    return program, evaluator, dict(zip(binding.input_tvs, binding.inputs(inputs)))


def test_a_one_rank_allgather_of_an_input_to_an_output_is_a_copy(plain_process):
    # A program output never views a program input, as a set would not.
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, -1], torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(MESH)
    x.axis(0).parallelize(ParallelType.mesh_x)
    t = torch.randn(1, 7)
    program, evaluator, bindings = _one_rank_program(fd, [t])
    assert [e.type for e in program.walk() if isinstance(e, ir.Communication)] == [ir.CommunicationType.Allgather]
    (out,) = evaluator.run(bindings)
    torch.testing.assert_close(out.reshape(1, 7), t)
    assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_a_one_rank_allreduce_output_views_its_partial_sums(plain_process):
    fd = one_rank_linear("K")
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    program, evaluator, bindings = _one_rank_program(fd, [x, w])
    (comm,) = [e for e in program.walk() if isinstance(e, ir.Communication)]
    assert evaluator.local_views == {comm.out}
    seen = {}

    class Watch:
        def op(self, frame, e, run):
            run()
            if e is comm:
                seen["in"], seen["out"] = frame.get(e.input), frame.get(e.out)

    evaluator.observers.append(Watch())
    (y,) = evaluator.run(bindings)
    assert seen["out"].untyped_storage().data_ptr() == seen["in"].untyped_storage().data_ptr()
    torch.testing.assert_close(y.reshape(6, 5), nn.functional.linear(x, w))


def test_a_permute_with_device_axes_is_a_view(plain_process):
    # out = x.T @ g with x's columns sharded: the weight gradient in the
    # backward of a colwise linear.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], torch.float32)
        g = fd.define_tensor([-1, -1], torch.float32)
        xt = fd.ops.permute(x, [1, 0])
        y = fd.ops.matmul(xt, g)
        fd.add_output(y)
        fd.add_output(xt)
    for tv in (x, g, xt, y):
        tv.set_device_mesh(MESH)
    for tv, axis in ((x, 1), (xt, 0), (y, 0)):
        tv.outer_split(axis, 1)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    a, b = torch.randn(6, 4), torch.randn(6, 3)
    program, evaluator, bindings = _one_rank_program(fd, [a, b])
    (permute,) = [e for e in program.walk() if isinstance(e, ir.PermuteOp)]
    assert permute.input.device_axes()
    seen = {}

    class Watch:
        def op(self, frame, e, run):
            run()
            if e is permute:
                seen["in"], seen["out"] = frame.get(e.input), frame.get(e.out)

    evaluator.observers.append(Watch())
    y_out, xt_out = evaluator.run(bindings)
    assert seen["out"].data_ptr() == seen["in"].data_ptr()
    assert not seen["out"].is_contiguous()
    torch.testing.assert_close(y_out.reshape(4, 3), a.T @ b)
    torch.testing.assert_close(xt_out.reshape(4, 6), a.T)
    # A caller's buffer for the permute's output gets the values copied in.
    given = torch.full((4, 6), float("nan"))
    y2, xt2 = fd.execute([a, b], outputs=[torch.empty(4, 3), given], backend="gloo")
    assert xt2.data_ptr() == given.data_ptr()
    torch.testing.assert_close(given, a.T)
    torch.testing.assert_close(y2, a.T @ b)


def _attn_proj(h: int, kv: int):
    class AttnProj(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(h, h), nn.Linear(h, kv, bias=False),
                                              nn.Linear(h, kv, bias=False), nn.Linear(h, h))

        def forward(self, x):
            return self.o(self.q(x)), self.k(x), self.v(x)

    return AttnProj()


def test_one_rank_parallel_training_matches_eager_and_moves_nothing(plain_process):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hostir.parallel import parallelize_module

    torch.manual_seed(0)
    h, kv = 16, 4
    base = _attn_proj(h, kv)
    model = copy.deepcopy(base)
    mesh = MESH.to_torch("cpu")
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    x = torch.randn(5, h)
    grads = [torch.randn(5, h), torch.randn(5, kv), torch.randn(5, kv)]

    def step(m, inp):
        for p in m.parameters():
            p.grad = None
        outs = m(inp)
        torch.autograd.backward(outs, grads)
        return outs

    for _ in range(2):
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref = step(base, xr)
        ops = _Ops()
        with ops:
            outs = step(model, xo)
        for a, b in zip(outs, ref):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(xo.grad, xr.grad)
        for (name, p), q in zip(model.named_parameters(), base.parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, q.grad, msg=lambda m: f"{name}: {m}")
    # The steady-state step: no collective, no copy of a tensor.
    assert ops.count("c10d.") == 0, ops.names
    assert ops.count("aten.copy_", "aten.clone", "aten._to_copy") == 0, ops.names


def test_the_hoisting_choice_is_made_once_per_signature(plain_process, monkeypatch):
    fd = one_rank_linear("K")
    comm = communicator.get(backend="gloo")
    made = []
    choose = planner._choose_hoisting_for
    monkeypatch.setattr(planner, "_choose_hoisting_for", lambda *a: made.append(a) or choose(*a))
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    device = torch.device("cpu")
    first = planner.hoisting_for_inputs(fd.fusion, [x, w], device, comm, frozenset())
    again = planner.hoisting_for_inputs(fd.fusion, [torch.randn(6, 8), w], device, comm, frozenset())
    assert again is first and len(made) == 1
    planner.hoisting_for_inputs(fd.fusion, [torch.randn(7, 8), w], device, comm, frozenset())
    assert len(made) == 2


def test_dtensor_gradients_keep_the_inputs_placements(plain_process):
    """A fusion on DTensor inputs returns their gradients as DTensors placed
    as the inputs (the spec of a parameter's gradient is a copy of the
    parameter's, not the object itself), with no `to_local` node in the
    graph; a gradient with other strides, or of a Partial input, is placed
    as `to_local()`'s backward places it (Partial as Replicate)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from hostir import autograd

    mesh = MESH.to_torch("cpu")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.linear(x, w))
    X, W = torch.randn(3, 4), torch.randn(5, 4)
    wd = DTensor.from_local(W.clone(), mesh, [Shard(0)]).requires_grad_()
    xd = DTensor.from_local(X.clone(), mesh, [Replicate()]).requires_grad_()
    (y,) = fd.execute([xd, wd], return_dtensors=False)
    # One node, on the DTensors themselves (no to_local node before it).
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions] == ["AccumulateGrad", "AccumulateGrad"]
    G = torch.randn(3, 5)
    y.backward(G)
    assert isinstance(wd.grad, DTensor) and wd.grad.placements == (Shard(0),)
    assert wd.grad._spec is not wd._spec
    torch.testing.assert_close(wd.grad.full_tensor(), G.T @ X)
    assert isinstance(xd.grad, DTensor) and xd.grad.placements == (Replicate(),)
    torch.testing.assert_close(xd.grad.full_tensor(), G @ W)

    spec, stride = wd._spec, wd._local_tensor.stride()
    g = torch.randn(4, 5).T  # other strides than the parameter's shard
    moved = autograd._gradient_like(g, spec, stride)
    assert moved.placements == (Shard(0),) and moved.stride() == g.stride()
    torch.testing.assert_close(moved.to_local(), g)
    partial = DTensor.from_local(torch.randn(5, 4), mesh, [Partial()])
    got = autograd._gradient_like(torch.ones(5, 4), partial._spec, partial._local_tensor.stride())
    assert got.placements == (Replicate(),)


def test_parallelize_module_takes_hostirs_own_mesh(plain_process):
    # hostir.DeviceMesh works where a torch mesh does: the same ranks, on
    # this rank's device type.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hostir.parallel import parallelize_module

    torch.manual_seed(0)
    base = _attn_proj(16, 4)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    torch_mesh = MESH.to_torch()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    parallelize_module(ours, MESH, plan)
    parallelize_module(theirs, torch_mesh, plan)
    x = torch.randn(5, 16, device=torch_mesh.device_type)
    for a, b in zip(ours(x), theirs(x)):
        torch.testing.assert_close(a, b)


def test_an_error_in_a_parallelized_module_names_the_module_and_its_inputs(plain_process, monkeypatch, capsys):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hostir.errors import HostIrError
    from hostir.parallel import parallelize_module

    model = _attn_proj(16, 4)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    parallelize_module(model, MESH.to_torch("cpu"), plan)
    with pytest.raises(HostIrError) as err:
        model.k(torch.randn(5, 16, dtype=torch.float64))  # the weight is float32
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "in module 'k' (colwise nn.Linear, hostir.parallel)" in notes, notes
    assert "input 0 is the input (activation) of shape [5, 16]" in notes and "input 1 is the weight of shape" in notes
    # Its programs' dumps carry the module's name too.
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    model.q(torch.randn(5, 16))
    assert "Host program (q, colwise nn.Linear)" in capsys.readouterr().out
