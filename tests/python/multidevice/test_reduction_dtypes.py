"""Reductions across ranks follow torch's dtype rules, for every dtype and
every reducing collective, on both evaluators: a `sum` of integers or bools
is int64 (as `torch.sum`), `max` and `min` keep the dtype (a bool max is a
logical or, a min a logical and), and the values are eager torch's.

Each rank holds one row of a [d, 4d] tensor; the program reduces over the
rows into a replicated output (Allreduce), a sharded one (ReduceScatter) or
one held by rank 0 alone (Reduce). int16, which neither gloo nor NCCL
moves, is refused when the program is lowered, on every rank.
"""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType
from hostir.lower.record import LoweringError

DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}
COLLECTIVES = ["Allreduce", "ReduceScatter", "Reduce"]


def _program(d: int, dtype: torch.dtype, op: str, collective: str) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[d, 4 * d], dtype=dtype)
        y = getattr(fd.ops, op)(x, [0])
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(d)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.set_device_mesh(DeviceMesh([0]) if collective == "Reduce" else DeviceMesh(range(d)))
    if collective == "ReduceScatter":
        y.outer_split(1, d)
        y.axis(1).parallelize(ParallelType.mesh_x)
    return fd


def _whole(d: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(d, 4 * d) < 0.5
    if dtype.is_floating_point:
        return torch.randn(d, 4 * d).to(dtype)
    info = torch.iinfo(dtype)
    # Values near the ends of the range: a sum overflows unless it is int64.
    return torch.randint(info.min, info.max, (d, 4 * d), dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("evaluator", ["python", "cpp"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_dtype_reduces_as_torch_does(world, device, collective, evaluator):
    from hostir import cpp

    if evaluator == "cpp" and not cpp.available():
        pytest.fail(f"the C++ executor is not built: {cpp.reason()}")
    d, rank = world.size, world.rank
    for dtype in DTYPES:
        for op, reference in OPS.items():
            fd = _program(d, dtype, op, collective)
            whole = _whole(d, dtype).to(device)
            (got,) = fd.execute([whole[rank : rank + 1]], evaluator=evaluator)
            want = reference(whole, 0)
            if collective == "ReduceScatter":
                want = want.chunk(d)[rank]
            if collective == "Reduce" and rank != 0:
                assert got is None, (dtype, op)
                continue
            where = f"{op} {collective} of {dtype}"
            assert got.dtype == want.dtype, f"{where}: {got.dtype}, torch gives {want.dtype}"
            if dtype.is_floating_point:
                # A 16-bit sum across ranks rounds once per rank's addition
                # (torch.sum rounds once): one unit in the last place per rank.
                tol = {"rtol": 1e-2, "atol": 1e-2} if dtype.itemsize == 2 else {}
                torch.testing.assert_close(got.reshape(want.shape), want, msg=where, **tol)
            else:
                assert torch.equal(got.reshape(want.shape), want), where


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_a_dtype_the_backend_cannot_move_is_refused_by_name_on_every_rank(world, device, collective):
    d, rank = world.size, world.rank
    fd = _program(d, torch.int16, "max", collective)
    whole = _whole(d, torch.int16).to(device)
    # Every rank fails the same check: each raises the lowering's own error.
    with pytest.raises(LoweringError, match=r"(gloo|NCCL) cannot communicate int16 tensors .*cast to int32"):
        fd.execute([whole[rank : rank + 1]])
    # The ranks are still in step: the same program in int32 runs.
    fd = _program(d, torch.int32, "max", collective)
    (got,) = fd.execute([whole[rank : rank + 1].to(torch.int32)])
    want = torch.amax(whole, 0).to(torch.int32)
    if collective == "ReduceScatter":
        want = want.chunk(d)[rank]
    if collective != "Reduce" or rank == 0:
        assert torch.equal(got.reshape(want.shape), want)
