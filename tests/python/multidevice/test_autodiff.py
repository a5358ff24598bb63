"""Backward programs across ranks: `torch.autograd.gradcheck` in float64 of
every communication's transpose and of the tensor-parallel layers, on any
number of ranks.

The function checked maps whole tensors (the same on every rank) to whole
tensors: each rank cuts its pieces of the inputs, runs the fusion, and the
pieces of the outputs are put back together. Cutting and joining are
differentiable with the whole-tensor meaning of the program (a replicated
value is one value, as in DTensor): the gradient of a cut piece is gathered
back into the whole, and the gradient of a joined whole is cut to the piece.
gradcheck's numerical Jacobian perturbs the same element on every rank, so
it differentiates the same whole-tensor function the backward programs
compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hostir import DeviceMesh, FusionDefinition, ParallelType

F64 = torch.float64


@pytest.fixture(autouse=True)
def _torch_distributed(world, device):
    # The joins below use torch.distributed's default group (hostir's
    # communicator creates it), on the rank's device.
    DeviceMesh(range(world.size)).to_torch(device.type)


class _Cut(torch.autograd.Function):
    """Whole -> this rank's chunk `index` of `parts` along `axis`; the
    gradient of the whole is every rank's chunk gradient, gathered."""

    @staticmethod
    def forward(ctx, whole, axis, parts, index):
        ctx.axis, ctx.parts = axis, parts
        return whole.chunk(parts, axis)[index].contiguous()

    @staticmethod
    def backward(ctx, g):
        pieces = [torch.empty_like(g) for _ in range(ctx.parts)]
        dist.all_gather(pieces, g.contiguous())
        return torch.cat(pieces, ctx.axis), None, None, None


class _Join(torch.autograd.Function):
    """This rank's chunk along `axis` -> the whole; the gradient of the
    piece is its chunk of the whole's."""

    @staticmethod
    def forward(ctx, piece, axis, parts, index):
        ctx.axis, ctx.parts, ctx.index = axis, parts, index
        pieces = [torch.empty_like(piece) for _ in range(parts)]
        dist.all_gather(pieces, piece.contiguous())
        return torch.cat(pieces, axis)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.parts, ctx.axis)[ctx.index].contiguous(), None, None, None


class _FromRoot(torch.autograd.Function):
    """A whole held by `root` only -> the whole on every rank; the gradient
    goes back to the root."""

    @staticmethod
    def forward(ctx, held, like, root):
        ctx.root = root
        out = held.detach().clone() if held is not None else torch.empty_like(like)
        dist.broadcast(out, root)
        return out

    @staticmethod
    def backward(ctx, g):
        return (g if dist.get_rank() == ctx.root else None), None, None


class _ToRoot(torch.autograd.Function):
    """A whole that only `root` holds: the others get a garbage piece of the
    same shape; the gradient is the root's, on every rank."""

    @staticmethod
    def forward(ctx, whole, root):
        ctx.root = root
        return whole.clone() if dist.get_rank() == root else torch.full_like(whole, 99.0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.broadcast(g, ctx.root)
        return g, None


def cut(whole, spec, world):
    """`spec`: None (replicated), ("shard", axis) over all ranks, or
    ("on", rank) for a tensor only `rank` holds (the others pass a garbage
    piece of the same shape, outside autograd)."""
    if spec is None:
        return whole
    kind, arg = spec
    if kind == "shard":
        return _Cut.apply(whole, arg, world.size, world.rank)
    return _ToRoot.apply(whole, arg)


def join(piece, spec, world, like):
    if spec is None:
        return piece
    kind, arg = spec
    if kind == "shard":
        return _Join.apply(piece, arg, world.size, world.rank)
    return _FromRoot.apply(piece, like, arg)


def gradcheck(fd, wholes, in_specs, out_specs, world, out_like=None):
    def run(*xs):
        outs = fd.execute([cut(x, s, world) for x, s in zip(xs, in_specs)])
        return tuple(join(o, s, world, out_like) for o, s in zip(outs, out_specs))

    inputs = tuple(w.detach().clone().requires_grad_() for w in wholes)
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-6)


def shard(tv, axis, d):
    tv.outer_split(axis, d)
    tv.axis(axis).parallelize(ParallelType.mesh_x)


def place(mesh, *tvs):
    for tv in tvs:
        if tv is not None:
            tv.set_device_mesh(mesh)


@pytest.fixture
def randn(device):
    """Whole float64 tensors from the per-test seed, on the rank's device."""

    def make(*shape):
        return torch.randn(*shape, dtype=F64).to(device)

    return make


# ------------------------------------------------------------ communications


def test_allgather(world, randn):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        y = fd.ops.set(x)
        fd.add_output(fd.ops.mul(y, y))
    place(DeviceMesh(range(D)), x, y)
    shard(x, 0, D)
    gradcheck(fd, [randn(2 * D, 3)], [("shard", 0)], [None], world)


def test_allreduce(world, randn):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        y = fd.ops.sum(fd.ops.tanh(x), [1])
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, y)
    shard(x, 1, D)
    assert "type=Allreduce" in fd.host_ir()
    gradcheck(fd, [randn(3, 2 * D)], [("shard", 1)], [None], world)


def test_reduce_scatter(world, randn):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([D, -1, -1], F64)
        y = fd.ops.sum(fd.ops.sigmoid(x), [0])
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    shard(y, 1, D)  # y's domain is [rD, M, N]
    assert "type=ReduceScatter" in fd.host_ir()
    gradcheck(fd, [randn(D, 2 * D, 3)], [("shard", 0)], [("shard", 0)], world)


def test_all_to_all(world, randn):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        y = fd.ops.set(x)
        fd.add_output(fd.ops.exp(y))
    place(DeviceMesh(range(D)), x, y)
    shard(x, 0, D)
    shard(y, 1, D)
    assert "type=AllToAll" in fd.host_ir()
    gradcheck(fd, [randn(D, 2 * D)], [("shard", 0)], [("shard", 1)], world)


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast(world, randn, root):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        y = fd.ops.set(x)
        fd.add_output(fd.ops.mul(y, y))
    x.set_device_mesh(DeviceMesh([r]))
    place(DeviceMesh(range(D)), y)
    assert "type=Broadcast" in fd.host_ir()
    gradcheck(fd, [randn(2, 3)], [("on", r)], [None], world)


@pytest.mark.parametrize("root", ["first", "last"])
def test_gather_and_scatter(world, randn, root):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor([D, -1], F64)
        y = fd.ops.set(x)  # Gather onto r
        z = fd.ops.mul(y, y)
        w = fd.ops.set(z)  # Scatter from r
        fd.add_output(w)
    place(DeviceMesh(range(D)), x, w)
    place(DeviceMesh([r]), y, z)
    x.axis(0).parallelize(ParallelType.mesh_x)
    w.axis(0).parallelize(ParallelType.mesh_x)
    dump = fd.host_ir()
    assert "type=Gather" in dump and "type=Scatter" in dump
    gradcheck(fd, [randn(D, 3)], [("shard", 0)], [("shard", 0)], world)


@pytest.mark.parametrize("root", ["first", "last"])
def test_reduce(world, randn, root):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor([D, -1], F64)
        y = fd.ops.sum(fd.ops.exp(x), [0])  # Reduce onto r
        z = fd.ops.set(fd.ops.tanh(y))  # Broadcast from r
        fd.add_output(z)
    place(DeviceMesh(range(D)), x, z)
    y.set_device_mesh(DeviceMesh([r]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    dump = fd.host_ir()
    assert "type=Reduce" in dump and "type=Broadcast" in dump
    gradcheck(fd, [randn(D, 3)], [("shard", 0)], [None], world)


def test_send_recv(world, randn):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([D, -1], F64)
        y = fd.ops.set(x)
        fd.add_output(fd.ops.sigmoid(y))
    place(DeviceMesh(range(D)), x)
    y.set_device_mesh(DeviceMesh(list(reversed(range(D)))))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.mesh_x)
    assert "type=SendRecv" in fd.host_ir()
    whole = randn(D, 3)

    def run(x):
        (out,) = fd.execute([cut(x, ("shard", 0), world)])
        # y's mesh is reversed: rank r holds row D-1-r.
        return _Join.apply(out, 0, D, world.rank).flip(0)

    assert torch.autograd.gradcheck(run, (whole.requires_grad_(),), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------ tensor-parallel layers


def _linear(D, x_axis=None, w_axis=None, b_sharded=False, y_axis=None, bias=True):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F64)
        w = fd.define_tensor([-1, -1], F64)
        b = fd.define_tensor([-1], F64) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, b, y)
    if x_axis is not None:
        shard(x, x_axis, D)
    if w_axis is not None:
        shard(w, w_axis, D)
    if b_sharded:
        shard(b, 0, D)
    if y_axis is not None:
        shard(y, y_axis, D)
    return fd


def test_column_parallel_linear(world, randn):
    D = world.size
    fd = _linear(D, w_axis=0, b_sharded=True, y_axis=1)
    gradcheck(fd, [randn(3, 4), randn(2 * D, 4), randn(2 * D)], [None, ("shard", 0), ("shard", 0)], [("shard", 1)], world)


@pytest.mark.parametrize("output", ["allreduce", "reduce_scatter"])
def test_row_parallel_linear(world, randn, output):
    D = world.size
    fd = _linear(D, x_axis=1, w_axis=1, y_axis=0 if output == "reduce_scatter" else None)
    out = ("shard", 0) if output == "reduce_scatter" else None
    gradcheck(fd, [randn(2 * D, 2 * D), randn(3, 2 * D), randn(3)], [("shard", 1), ("shard", 1), None], [out], world)


def test_sequence_parallel_column_linear_regathers_its_input(world, randn):
    D = world.size
    fd = _linear(D, x_axis=0, w_axis=0, b_sharded=True, y_axis=1)
    gradcheck(
        fd,
        [randn(2 * D, 4), randn(2 * D, 4), randn(2 * D)],
        [("shard", 0), ("shard", 0), ("shard", 0)],
        [("shard", 1)],
        world,
    )


def test_megatron_mlp_block_matches_eager(world, randn):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / "megatron_mlp.py"
    spec = importlib.util.spec_from_file_location("megatron_mlp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    D = world.size
    fd, tvs = example.define(D, F64)
    H = example.HIDDEN
    wholes = [randn(2 * D, H), randn(4 * H, H) / H**0.5, randn(4 * H), randn(H, 4 * H) / (2 * H), randn(H)]
    specs = [("shard", 0), ("shard", 0), ("shard", 0), ("shard", 1), None]
    ours = [w.clone().requires_grad_() for w in wholes]
    ref = [w.clone().requires_grad_() for w in wholes]
    (y,) = fd.execute([cut(x, s, world) for x, s in zip(ours, specs)])
    y = join(y, ("shard", 0), world, None)
    g = randn(*y.shape)
    y.backward(g)
    expected = example.reference(*ref)
    expected.backward(g)
    torch.testing.assert_close(y, expected)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("keep_gathered", [False, True], ids=["regather", "keep_gathered"])
def test_sequence_parallel_linear_saves_the_shard_or_the_gathered_input(world, randn, keep_gathered):
    from hostir.autograd import training_of

    D = world.size
    fd = _linear(D, x_axis=0, w_axis=0, b_sharded=True, y_axis=1)
    fd.keep_gathered = keep_gathered
    gradcheck(
        fd,
        [randn(2 * D, 4), randn(2 * D, 4), randn(2 * D)],
        [("shard", 0), ("shard", 0), ("shard", 0)],
        [("shard", 1)],
        world,
    )
    training = training_of(fd, (0, 1, 2))
    saved = [training.derivation.forward.outputs[i] for kind, i in training.derivation.saved if kind == "output"]
    backward = training.backward.host_ir()
    if keep_gathered:
        # The forward's gathered x is saved; the backward gathers nothing.
        assert len(saved) == 1 and "type=Allgather" not in backward
    else:
        # Only the shard (an input) is saved; the backward gathers it again.
        assert saved == [] and "type=Allgather" in backward
    assert "type=ReduceScatter" in backward


SCHEDULES = ["ring", "ring:chunks=2,direction=-1", "collective", "sequential"]


@pytest.mark.parametrize("sched", SCHEDULES)
def test_allgather_matmul_layer_backward(world, device, sched):
    """The AG+matmul layer's gradients under every decomposition: the
    weight gradient gathers the saved shard again (a ring, when the
    schedule says so); the input gradient is this rank's rows."""
    from hostir import overlap

    # The backward gathers x transposed, [K, m] per shard: chunks cut K.
    D, m, K, N = world.size, 4, 6, 5
    X, W, G = torch.randn(D, m, K, device=device), torch.randn(K, N, device=device), torch.randn(D, m, N, device=device)
    fd = overlap.allgather_matmul(D)
    (x, w), expected = overlap.allgather_matmul_inputs(X, W, world.rank)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    (y,) = fd.execute([x, w], schedule=sched, number_of_streams=2)
    torch.testing.assert_close(y, expected)
    y.backward(G)
    torch.testing.assert_close(x.grad, (G @ W.T)[world.rank : world.rank + 1])
    torch.testing.assert_close(w.grad, X.reshape(-1, K).T @ G.reshape(-1, N))


@pytest.mark.parametrize("sched", SCHEDULES)
def test_matmul_reduce_scatter_layer_backward(world, device, sched):
    """The matmul+RS layer's gradients under every decomposition: one
    gather of the output gradient (a ring, when the schedule says so) feeds
    both products."""
    from hostir import overlap

    D, m, k, N = world.size, 4, 3, 5
    A, B = torch.randn(D * m, D * k, device=device), torch.randn(D * k, N, device=device)
    G = torch.randn(D * m, N, device=device)
    fd = overlap.matmul_reduce_scatter(D)
    (a, b), expected = overlap.matmul_reduce_scatter_inputs(A, B, D, world.rank)
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    (y,) = fd.execute([a, b], schedule=sched, number_of_streams=2)
    torch.testing.assert_close(y.reshape(expected.shape), expected)
    y.backward(G.reshape(D, m, N)[world.rank : world.rank + 1].reshape(y.shape))
    (da, db), _ = overlap.matmul_reduce_scatter_inputs(G @ B.T, A.T @ G, D, world.rank)
    torch.testing.assert_close(a.grad, da)
    torch.testing.assert_close(b.grad, db)
