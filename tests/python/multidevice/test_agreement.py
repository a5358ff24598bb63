"""Ranks that disagree fail together, and stay in step afterwards.

Every rank runs each test; one rank (rank 1) passes something different,
and every rank must raise `RankMismatchError` from the same execute, before
any collective of the program. A correct execute right after it must still
work: the failure may not leave the ranks' collectives paired wrongly.
"""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, InputError, ParallelType, RankMismatchError, shard_tensor

ODD = 1  # the rank that passes something different


def rand_int(shape, device, dtype=torch.float32) -> torch.Tensor:
    return torch.randint(-8, 8, tuple(shape)).to(dtype).to(device)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def allgather_fd(world, m=-1, dtype=torch.float32):
    """x [D, m] sharded on axis 0 -> y replicated: an Allgather."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, m], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def allreduce_fd(world, kind="sum", shard_axis=0):
    """x [D, D, n] sharded on `shard_axis` -> kind(x, [shard_axis]) replicated."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, D, -1], dtype=torch.float32)
        y = getattr(fd.ops, kind)(x, [shard_axis])
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(shard_axis).parallelize(ParallelType.mesh_x)
    return fd, x


def still_in_step(world, device, fd=None, x=None):
    """A correct execute on every rank after a failed one."""
    if fd is None:
        fd, x = allgather_fd(world)
    full = rand_int([world.size, 3], device)
    out, = fd.execute([shard_tensor(full, x)])
    exact(out, full)


# ------------------------------------------------------------ inputs


def test_rank_dependent_shape(world, device):
    fd, x = allgather_fd(world)
    full = rand_int([world.size, 4], device)
    odd = rand_int([world.size, 6], device)
    mine = shard_tensor(odd if world.rank == ODD else full, x)
    with pytest.raises(RankMismatchError) as info:
        fd.execute([mine])
    message = str(info.value)
    assert "rank 1" in message, message
    assert "[1, 6]" in message and "[1, 4]" in message, message
    still_in_step(world, device, fd, x)


def test_other_shapes_that_fail_a_check_are_named_first(world, device):
    """Rank 1's other shape fails its check of a static size: the error
    names the shapes the ranks disagree on, then the failed check."""
    fd, x = allgather_fd(world, m=5)
    full = rand_int([world.size, 5], device)
    mine = shard_tensor(full, x) if world.rank != ODD else rand_int([1, 7], device)
    with pytest.raises(RankMismatchError) as info:
        fd.execute([mine])
    message = str(info.value)
    assert message.startswith(
        f"inputs differ across ranks: rank {ODD} input 0 has shape [1, 7] and dtype float32, "
        f"but rank 0 input 0 has shape [1, 5]"
    ), message
    assert f"rank {ODD} failed before the program ran" in message and "must have size 5, got 7" in message, message
    out, = fd.execute([shard_tensor(full, x)])
    exact(out, full)


def test_every_rank_failing_the_same_check_raises_its_own_error(world, device):
    """No rank disagrees: each raises the check's own error type, as a job
    of one rank would, never a RankMismatchError."""
    fd, x = allgather_fd(world, m=5)
    bad = rand_int([1, 7], device)
    with pytest.raises(InputError, match="must have size 5, got 7") as info:
        fd.execute([bad])
    assert not isinstance(info.value, RankMismatchError)
    full = rand_int([world.size, 5], device)
    with pytest.raises(InputError, match="[Ww]rong number of inputs") as info:
        fd.execute([shard_tensor(full, x), shard_tensor(full, x)])
    assert not isinstance(info.value, RankMismatchError)
    out, = fd.execute([shard_tensor(full, x)])
    exact(out, full)


def test_rank_dependent_fixed_size(world, device):
    fd, x = allgather_fd(world, m=5)
    full = rand_int([world.size, 5], device)
    mine = shard_tensor(full, x) if world.rank != ODD else rand_int([1, 7], device)
    with pytest.raises(RankMismatchError, match=r"rank 1 .*axis 1 must have size 5, got 7"):
        fd.execute([mine])
    out, = fd.execute([shard_tensor(full, x)])
    exact(out, full)


def test_unsharded_input_where_a_shard_is_expected(world, device):
    D = world.size
    fd, x = allgather_fd(world)
    full = rand_int([D, 4], device)
    mine = full if world.rank == ODD else shard_tensor(full, x)
    expected = rf"rank 1 .*axis 0 must have size 1 \(extent {D} sharded over {D} ranks\), got {D}"
    with pytest.raises(RankMismatchError, match=expected):
        fd.execute([mine])
    still_in_step(world, device, fd, x)


def test_rank_dependent_dtype(world, device):
    fd, x = allgather_fd(world)
    full = rand_int([world.size, 4], device)
    mine = shard_tensor(full, x)
    if world.rank == ODD:
        mine = mine.to(torch.float64)
    with pytest.raises(RankMismatchError) as info:
        fd.execute([mine])
    message = str(info.value)
    assert "rank 1" in message, message
    assert "float32" in message and "float64" in message, message
    still_in_step(world, device, fd, x)


def test_rank_dependent_number_of_inputs(world, device):
    fd, x = allgather_fd(world)
    full = rand_int([world.size, 4], device)
    inputs = [shard_tensor(full, x)]
    if world.rank == ODD:
        inputs.append(inputs[0].clone())
    with pytest.raises(RankMismatchError, match=r"rank 1 .*[Ww]rong number of inputs"):
        fd.execute(inputs)
    still_in_step(world, device, fd, x)


def test_rank_dependent_bad_preallocated_output(world, device):
    fd, x = allgather_fd(world)
    full = rand_int([world.size, 4], device)
    buffer = torch.empty(4, world.size, device=device)
    out = buffer.t() if world.rank == ODD else torch.empty_like(full)  # right shape, not contiguous
    with pytest.raises(RankMismatchError, match=r"rank 1 .*contiguous"):
        fd.execute([shard_tensor(full, x)], outputs=[out])
    still_in_step(world, device, fd, x)


# ------------------------------------------------------------ definitions


def test_rank_dependent_parallelized_axis(world, device):
    fd, x = allreduce_fd(world, shard_axis=1 if world.rank == ODD else 0)
    full = rand_int([world.size, world.size, 3], device)
    with pytest.raises(RankMismatchError, match=r"program differs across ranks.*rank 1"):
        fd.execute([shard_tensor(full, x)])
    still_in_step(world, device)


def test_rank_dependent_op(world, device):
    fd, x = allreduce_fd(world, kind="max" if world.rank == ODD else "sum")
    full = rand_int([world.size, world.size, 3], device)
    with pytest.raises(RankMismatchError, match=r"program differs across ranks.*rank 1"):
        fd.execute([shard_tensor(full, x)])
    still_in_step(world, device)


def test_rank_dependent_mesh(world, device):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    y.set_device_mesh(DeviceMesh([D - 1] if world.rank == ODD else [0]))  # Gather to another root
    x.axis(0).parallelize(ParallelType.mesh_x)
    full = rand_int([D, 3], device)
    with pytest.raises(RankMismatchError, match=r"program differs across ranks"):
        fd.execute([shard_tensor(full, x)])
    still_in_step(world, device)


def test_definition_that_fails_to_lower_on_one_rank(world, device):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, D], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    if world.rank == ODD:
        x.axis(1).parallelize(ParallelType.mesh_x)  # two mesh_x axes: a lowering error
    full = rand_int([D, D], device)
    mine = full[world.rank : world.rank + 1]
    with pytest.raises(RankMismatchError, match=r"rank 1 failed before the program ran"):
        fd.execute([mine])
    still_in_step(world, device)


# ------------------------------------------------------------ layouts


def _transposed(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The same values as `t`, as a non-contiguous view."""
    view = t.transpose(a, b).contiguous().transpose(a, b)
    assert torch.equal(view, t) and not view.is_contiguous()
    return view


def test_non_contiguous_input_allreduce(world, device):
    fd, x = allreduce_fd(world)
    full = rand_int([world.size, world.size, 3], device)
    mine = _transposed(shard_tensor(full, x), 1, 2)
    out, = fd.execute([mine])
    exact(out, full.sum(0))
    out, = fd.execute([shard_tensor(full, x).contiguous()])
    exact(out, full.sum(0))


def test_non_contiguous_input_split_allgather(world, device):
    D = world.size
    M, K = 2 * D, 3
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[M, K], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.outer_split(0, D)
    x.axis(0).parallelize(ParallelType.mesh_x)
    full = rand_int([M, K], device)
    mine = _transposed(shard_tensor(full, x), 0, 1)
    out, = fd.execute([mine])
    exact(out, full)


def test_non_contiguous_input_on_one_rank_only(world, device):
    fd, x = allreduce_fd(world)
    full = rand_int([world.size, world.size, 3], device)
    mine = shard_tensor(full, x).contiguous()
    if world.rank == ODD:
        mine = _transposed(mine, 1, 2)
    for _ in range(2):
        out, = fd.execute([mine])
        exact(out, full.sum(0))


def test_column_slice_input(world, device):
    fd, x = allgather_fd(world)
    wide = rand_int([world.size, 8], device)
    full = wide[:, ::2]  # every other column: a strided view
    mine = shard_tensor(full, x)
    assert not mine.is_contiguous()
    out, = fd.execute([mine])
    exact(out, full)
    exact(wide[:, ::2], full)  # the caller's tensor is untouched
