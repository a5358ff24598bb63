"""The C++ executor against the Python evaluator on every rank: AllToAll,
unary ops on sharded tensors, the forward and backward programs of
`hostir.parallel`'s Linears (split axes, sharded operands, partial sums
completed by an Allreduce, permutes), every communication type and P2P
on the c10d transport (the parity test of csrc/host_ir/transports/c10d.cpp),
and AllToAlls sized at run time (alone, with counts that disagree, and the
exact MoE layer's forward and backward),
each run on both evaluators on the same random data, with the runner saying
the C++ executor ran it."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, cpp, ir, shard_tensor
from hostir.container import HostIrContainer
from hostir.kinds import UnaryKind
from hostir.moe import MoELayer
from hostir.parallel import parallelize_module
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.streams import streams_for

from .test_moe import TOL as MOE_TOL
from .test_moe import kwargs as moe_kwargs
from .test_moe import reference_exact, routed

pytestmark = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")


def chunk(t: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    return t.chunk(n, dim)[index]


def shard(tv, axis: int, d: int) -> None:
    tv.outer_split(axis, d)
    tv.axis(axis).parallelize(ParallelType.mesh_x)


def both(fd, inputs):
    python = fd.execute(inputs, evaluator="python")
    assert fd.last_runner.name == "python"
    compiled = fd.execute(inputs, evaluator="cpp")
    assert fd.last_runner.name == "cpp" and fd.last_runner.reasons == (), fd.last_runner
    for p, c in zip(python, compiled):
        assert p.dtype == c.dtype and p.shape == c.shape
        torch.testing.assert_close(c, p, rtol=0, atol=0)
    return compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("axes", [(0, 2), (2, 0), (1, 0)])
def test_all_to_all(world, device, dtype, axes):
    """The sharded axis moves from `axes[0]` to `axes[1]`; pieces keep the
    team's order."""
    D = world.size
    src, dst = axes
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    shard(x, src, D)
    shard(y, dst, D)
    full = torch.randn(2 * D, 3 * D, D).mul(10).to(dtype).to(device)
    (out,) = both(fd, [shard_tensor(full, x)])
    torch.testing.assert_close(out, shard_tensor(full, y), rtol=0, atol=0)
    assert "type=AllToAll" in fd.host_ir()


def test_all_to_all_over_a_reversed_team(world, device):
    """A mesh listing the ranks backwards: the group's order differs from
    the team's, so the pieces are permuted both ways."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    mesh = DeviceMesh(list(reversed(range(D))))
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    shard(x, 0, D)
    shard(y, 1, D)
    full = torch.randn(2 * D, 3 * D, device=device)
    (out,) = both(fd, [shard_tensor(full, x)])
    torch.testing.assert_close(out, shard_tensor(full, y), rtol=0, atol=0)


@pytest.mark.parametrize("kind", [k.value for k in UnaryKind])
def test_unary_on_a_sharded_tensor(world, device, kind):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        if kind == "gelu_tanh":
            y = fd.ops.gelu(x, approximate="tanh")
        elif kind == "cast":
            y = fd.ops.cast(x, torch.float64)
        else:
            y = getattr(fd.ops, kind)(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    shard(x, 0, D)
    full = torch.randn(2 * D, 5, device=device)
    (out,) = both(fd, [shard_tensor(full, x)])
    fn = UnaryKind(kind).torch_fn
    piece = chunk(full, 0, D, world.rank)
    torch.testing.assert_close(out.reshape(piece.shape), piece.double() if fn is None else fn(piece))


@pytest.mark.parametrize("kind", ["sum", "max"])
def test_the_communication_dump_prints_the_same_postings_on_both_runners(world, device, kind, monkeypatch, capsys):
    # HOSTIR_DUMP=communication on the C++ executor: each collective it
    # posted, with its input's and output's sizes, as the Python evaluator
    # prints them.
    D = world.size
    monkeypatch.setenv("HOSTIR_DUMP", "communication")
    monkeypatch.setenv("HOSTIR_DUMP_RANKS", "all")
    printed = {}
    full = torch.randn(D, 2 * D, 3, device=device)
    for evaluator in ("python", "cpp"):
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[-1, -1, -1])
            y = getattr(fd.ops, kind)(x, [0])
            fd.add_output(y)
        x.set_device_mesh(DeviceMesh(range(D)))
        y.set_device_mesh(DeviceMesh(range(D)))
        x.axis(0).parallelize(ParallelType.mesh_x)
        (out,) = fd.execute([shard_tensor(full, x)], evaluator=evaluator)
        assert fd.last_runner.name == evaluator
        torch.testing.assert_close(out.reshape(2 * D, 3), full.sum(0) if kind == "sum" else full.amax(0))
        printed[evaluator] = [line for line in capsys.readouterr().out.splitlines() if "Posting" in line or "  with" in line]
    assert printed["cpp"] == printed["python"], printed
    assert any("type=Allreduce" in line for line in printed["cpp"]) and any("with input" in line for line in printed["cpp"])


# ------------------------------------------------------------ parallel Linears


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 6 * 4, bias=True)
        self.down = nn.Linear(6 * 4, 5, bias=True)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


PLANS = {
    "tensor parallel": lambda: {"up": ColwiseParallel(), "down": RowwiseParallel()},
    "sequence parallel": lambda: {
        "up": ColwiseParallel(input_layouts=Shard(0)),
        "down": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
    },
}


def _linears(model):
    for name in ("up", "down"):
        linear = model.get_submodule(name)._hostir_linear
        for fd in linear.fusions.values():
            for training in fd.__dict__.get("_trainings", {}).values():
                yield f"{name} forward", training.forward
                yield f"{name} backward", training.backward


def _step(model, x, mesh, plan, evaluator, monkeypatch):
    monkeypatch.setenv("HOSTIR_EVALUATOR", evaluator)
    inp = x.detach().clone().requires_grad_(True)
    if plan == "sequence parallel":
        inp = DTensor.from_local(inp.chunk(mesh.size(), 0)[mesh.get_local_rank()].detach().requires_grad_(True), mesh, (Shard(0),))
    y = model(inp)
    full = y.full_tensor() if isinstance(y, DTensor) else y
    loss = (full * torch.arange(full.numel(), device=full.device).reshape(full.shape)).sum()
    loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in model.named_parameters()}
    runners = {label: executor.last_runner for label, executor in _linears(model)}
    model.zero_grad()
    return full.detach(), grads, runners


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_parallel_linears_forward_and_backward_run_in_cpp(world, device, plan, monkeypatch):
    """Every program of both Linears, forward and backward, runs on the C++
    executor (`cpp`, strict: a program it cannot run is an error) and gives
    what the Python evaluator gives, and both what torch gives unsharded."""
    torch.manual_seed(0)
    ref = MLP().to(device)
    model = copy.deepcopy(ref)
    mesh = DeviceMesh(range(world.size)).to_torch(device.type)
    parallelize_module(model, mesh, PLANS[plan]())
    x = torch.randn(2 * world.size, 8).to(device)
    out_py, grads_py, runners_py = _step(model, x, mesh, plan, "python", monkeypatch)
    out_cpp, grads_cpp, runners_cpp = _step(model, x, mesh, plan, "cpp", monkeypatch)
    assert len(runners_cpp) == 4
    for label, runner in runners_cpp.items():
        assert runner.name == "cpp" and runner.reasons == (), (label, runner)
    assert all(r.name == "python" for r in runners_py.values())
    torch.testing.assert_close(out_cpp, out_py)
    for name, g in grads_py.items():
        torch.testing.assert_close(grads_cpp[name], g, msg=lambda m: f"{name}: {m}")
    # And both are torch's unsharded results.
    inp = x.clone().requires_grad_(True)
    expected = ref(inp)
    (expected * torch.arange(expected.numel(), device=device).reshape(expected.shape)).sum().backward()
    torch.testing.assert_close(out_cpp, expected.detach(), rtol=1e-4, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads_cpp[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------ the c10d transport
#
# The parity test of csrc/host_ir/transports/c10d.cpp: each communication
# type and P2P, posted by the C++ transport and by the Python one
# (runtime/transports/torch_dist.py) on the same data, bit for bit.

TRANSPORT_CASES = [
    "Allgather",
    "Allreduce-sum",
    "Allreduce-max",
    "ReduceScatter-sum",
    "ReduceScatter-min",
    "Broadcast",
    "Gather",
    "Scatter",
    "Reduce-sum",
    "Reduce-max",
    "SendRecv",
]


def _one_communication(world, device, case: str, dtype):
    """A program whose one communication is `case` over every rank (a root:
    the last), and this rank's input; a max or min's data hold a NaN."""
    D = world.size
    name, _, kind = case.partition("-")
    shape = [D, D, 3] if name == "ReduceScatter" else [D, 3]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=shape, dtype=dtype)
        y = getattr(fd.ops, kind)(x, [0]) if kind else fd.ops.set(x)
        fd.add_output(y)
    everyone, root = DeviceMesh(range(D)), DeviceMesh([D - 1])
    x.set_device_mesh(root if name in ("Broadcast", "Scatter") else everyone)
    y.set_device_mesh({"Gather": root, "Reduce": root, "SendRecv": DeviceMesh(list(reversed(range(D))))}.get(name, everyone))
    if name not in ("Broadcast", "Scatter"):
        x.axis(0).parallelize(ParallelType.mesh_x)
    if name in ("Scatter", "SendRecv"):
        y.axis(0).parallelize(ParallelType.mesh_x)
    if name == "ReduceScatter":
        y.axis(1).parallelize(ParallelType.mesh_x)  # y's domain is [rD, D, 3]
    full = torch.randint(-8, 8, shape).to(dtype)
    if kind in ("max", "min") and dtype.is_floating_point:
        full.view(-1)[1] = float("nan")
    full = full.to(device)
    if name in ("Broadcast", "Scatter"):
        mine = full if world.rank == D - 1 else torch.full_like(full, 99)
    else:
        mine = shard_tensor(full, x)
    return fd, mine


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("case", TRANSPORT_CASES)
def test_each_communication_posts_on_the_c10d_transport_as_in_python(world, device, case, dtype):
    fd, mine = _one_communication(world, device, case, dtype)
    assert f"type={case.partition('-')[0]}," in fd.host_ir()
    outs = {}
    for evaluator in ("python", "cpp"):
        outs[evaluator] = [fd.execute([mine], evaluator=evaluator)[0] for _ in range(2)]
        assert fd.last_runner.name == evaluator and (evaluator == "python" or fd.last_runner.reasons == ()), fd.last_runner
    for p, c in zip(outs["python"], outs["cpp"]):
        assert (p is None) == (c is None)
        if p is not None:
            torch.testing.assert_close(c, p, rtol=0, atol=0, equal_nan=True)


def _ring(world, coalesced: bool):
    """Send the input to the next rank, receive the previous rank's."""
    c = HostIrContainer()
    x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(6))], torch.float32, ir.MemoryType.global_)
    c.add_input(x)
    buf = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(6))], torch.float32, ir.MemoryType.global_)
    c.push_back(ir.Allocate(buf))
    me = c.named_scalar("rank")
    backend = "NCCL" if torch.cuda.is_available() else "gloo"
    send = ir.P2PCommunication(c.next_name("comm"), "send", x, (me + 1) % world.size, backend=backend)
    recv = ir.P2PCommunication(c.next_name("comm"), "recv", buf, (me + (world.size - 1)) % world.size, backend=backend)
    if coalesced:
        end = ir.EndCoalescing(c.next_name("comm"))
        exprs = [ir.StartCoalescing(), send, recv, end, ir.Wait(end)]
    else:
        exprs = [send, recv, ir.Wait(send), ir.Wait(recv)]
    for e in exprs:
        c.push_back(e)
    c.add_output(buf)
    c.verify()
    return c, x


@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "separate"])
def test_p2p_posts_on_the_c10d_transport_as_in_python(world, device, coalesced):
    container, x = _ring(world, coalesced)
    mine = torch.randn(6, device=device)
    outs = []
    for make in (HostIrEvaluator, cpp.CppEvaluator):
        evaluator = make(container, streams=streams_for(device), device=device, communicator=hostir.communicator.get())
        (out,) = evaluator.run({x: mine})
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    # Every instruction of the ring names the backend its transport is for.
    expected = "NCCL" if torch.cuda.is_available() else "gloo"
    named = {i.op: i.fields.get("backend") for i in evaluator._flat.instrs if "backend" in i.fields}
    assert named == ({"start_coalescing": expected, "p2p": expected, "end_coalescing": expected} if coalesced else {"p2p": expected})


# ------------------------------------------------------------ AllToAlls sized at run time
#
# `set(x, rows=(sent, received))`: the C++ transport reads the counts on the
# host, checks them as torch_dist.py's `_piece_rows` does, moves only the
# real rows and zeros the rest, as the Python transport.


def _sized_all_to_all(world, mesh, bound: int, hidden: int):
    """y = set(x, rows=(rows, rows_in)): x [sender, receiver, bound, hidden]
    sharded on the sender, y on the receiver; rows [sender, receiver] as x,
    rows_in as y."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, D, bound, hidden])
        rows = fd.define_tensor(shape=[D, D], dtype=torch.int64)
        rows_in = fd.define_tensor(shape=[D, D], dtype=torch.int64)
        y = fd.ops.set(x, rows=(rows, rows_in))
        fd.add_output(y)
    for tv, axis in ((x, 0), (rows, 0), (rows_in, 1), (y, 1)):
        tv.set_device_mesh(mesh)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    return fd, x, rows, rows_in, y


@pytest.mark.parametrize("reversed_team", [False, True], ids=["team", "reversed team"])
def test_all_to_all_sized_at_run_time(world, device, reversed_team):
    """Each sender's piece for each receiver moves its first counts[s, d]
    rows (0 to the bound, its own piece included), the rest of the output
    zeros; the same on both runners, twice (the second call prepared), over
    a team in the group's order and one listing the ranks backwards."""
    D, B, H = world.size, 5, 3
    mesh = DeviceMesh(list(reversed(range(D))) if reversed_team else range(D))
    fd, x, rows, rows_in, y = _sized_all_to_all(world, mesh, B, H)
    full = torch.randn(D, D, B, H, device=device)
    counts = torch.randint(0, B + 1, (D, D), device=device)
    counts[0, -1], counts[-1, 0] = 0, B  # an empty piece and a full one
    expected = torch.zeros_like(full)
    for s in range(D):
        for d in range(D):
            expected[s, d, : counts[s, d]] = full[s, d, : counts[s, d]]
    mine = [shard_tensor(full, x), shard_tensor(counts, rows), shard_tensor(counts, rows_in)]
    for _ in range(2):
        (out,) = both(fd, mine)
        torch.testing.assert_close(out, shard_tensor(expected, y), rtol=0, atol=0)
    assert "rows=" in fd.host_ir()


def test_a_sized_all_to_all_whose_counts_disagree_on_the_own_piece_raises_on_every_rank(world, device):
    """rows and rows_in disagree on each rank's own piece: every rank raises
    before it posts anything, with the same message on both runners."""
    D, B, H = world.size, 4, 2
    fd, x, rows, rows_in, _ = _sized_all_to_all(world, DeviceMesh(range(D)), B, H)
    full = torch.randn(D, D, B, H, device=device)
    counts = torch.randint(0, B + 1, (D, D), device=device)
    wrong = counts.clone()
    wrong.diagonal().copy_((counts.diagonal() + 1) % (B + 1))
    mine = [shard_tensor(full, x), shard_tensor(counts, rows), shard_tensor(wrong, rows_in)]
    r = world.rank
    expected = f"this rank keeps {int(counts[r, r])} rows of its own piece by rows but {int(wrong[r, r])} by rows_in"
    said = {}
    for evaluator in ("python", "cpp"):
        with pytest.raises(Exception, match="this rank keeps") as caught:
            fd.execute(mine, evaluator=evaluator)
        assert fd.last_runner.name == evaluator
        (said[evaluator],) = re.findall(r"this rank keeps .* disagree", str(caught.value))
        assert said[evaluator].startswith(expected), said[evaluator]
    assert said["cpp"] == said["python"], said


@pytest.mark.parametrize("capacity", [None, 3])
def test_exact_moe_layer_forward_and_backward_run_in_cpp(world, device, capacity):
    """`MoELayer(exact=True)`: its forward (counts exchanged, then the tokens
    and results sized by them) and its backward (the same exchanges with
    the counts swapped, grouped outer products) run on the C++ executor and
    give what the Python evaluator gives, bit for bit, and what the
    token-by-token layer gives; with capacity 3, a bound that drops pairs."""
    D, r = world.size, world.rank
    T, H, F, E, k = 7, 8, 12, 2 * D, 2
    El = E // D
    x, indices, weights = routed(D, T, H, E, k, device)
    gate, up = torch.randn(E, F, H, device=device) / 3, torch.randn(E, F, H, device=device) / 3
    down = torch.randn(E, H, F, device=device) / 3
    whole = [t.clone().requires_grad_() for t in (x, weights, gate, up, down)]
    bound = T * k if capacity is None else capacity
    expected = reference_exact(whole[0], indices, *whole[1:], bound=bound)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    results = {}
    for evaluator in ("python", "cpp"):
        mine = [x[r], weights[r]] + [w[r * El : (r + 1) * El] for w in (gate, up, down)]
        mine = [t.clone().requires_grad_() for t in mine]
        layer = MoELayer(
            DeviceMesh(range(D)), E, capacity=capacity, exact=True, evaluator=evaluator, **moe_kwargs(device)
        )
        out = layer(mine[0], indices[r], *mine[1:])
        out.backward(grad[r])
        (training,) = layer.fusion(T, k, H, F, torch.float32).__dict__["_trainings"].values()
        for program in (training.forward, training.backward):
            runner = program.last_runner
            assert runner.name == evaluator and (evaluator == "python" or runner.reasons == ()), runner
        assert "rows=" in training.forward.host_ir() and "rows=" in training.backward.host_ir()
        results[evaluator] = [out.detach()] + [t.grad for t in mine]
    for p, c in zip(results["python"], results["cpp"]):
        torch.testing.assert_close(c, p, rtol=0, atol=0)
    out, *grads = results["cpp"]
    torch.testing.assert_close(out, expected[r].detach(), **MOE_TOL)
    torch.testing.assert_close(grads[0], whole[0].grad[r], **MOE_TOL)
    torch.testing.assert_close(grads[1], whole[1].grad[r], **MOE_TOL)
    for ours, theirs in zip(grads[2:], whole[2:]):
        torch.testing.assert_close(ours, theirs.grad[r * El : (r + 1) * El], **MOE_TOL)


@pytest.mark.parametrize(
    "form", [{}, {"exact": True, "overlap": True, "capacity_factor": 1.5}], ids=["padded", "exact_walked"]
)
def test_moe_layer_with_gate_up_fused_runs_in_cpp(world, device, form):
    """gate and up as one gate_up: the forward's slices of it (views of
    each rank's piece) and the backward's cat of their gradients run on
    the C++ executor, and it gives what the Python evaluator gives, bit
    for bit."""
    D, r = world.size, world.rank
    T, H, F, E, k = 7, 8, 12, 2 * D, 2
    El = E // D
    x, indices, weights = routed(D, T, H, E, k, device)
    gate_up = torch.randn(E, 2 * F, H, device=device) / 3
    down = torch.randn(E, H, F, device=device) / 3
    grad = torch.randn(T, H, device=device)
    results = {}
    for evaluator in ("python", "cpp"):
        mine = [x[r], weights[r], gate_up[r * El : (r + 1) * El], down[r * El : (r + 1) * El]]
        mine = [t.clone().requires_grad_() for t in mine]
        layer = MoELayer(DeviceMesh(range(D)), E, evaluator=evaluator, **form, **moe_kwargs(device))
        out = layer(mine[0], indices[r], *mine[1:])
        out.backward(grad)
        (training,) = layer.fusion(T, k, H, F, torch.float32, fused=True).__dict__["_trainings"].values()
        for program in (training.forward, training.backward):
            runner = program.last_runner
            assert runner.name == evaluator and (evaluator == "python" or runner.reasons == ()), runner
        assert "slice(" in training.forward.host_ir() and "cat(" in training.backward.host_ir()
        results[evaluator] = [out.detach()] + [t.grad for t in mine]
    for p, c in zip(results["python"], results["cpp"]):
        torch.testing.assert_close(c, p, rtol=0, atol=0)
