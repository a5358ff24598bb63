"""Fuzz multi-device programs: random small programs with a sharded axis
(an Allgather, optionally stream-pipelined; an Allreduce; a ReduceScatter)
after random local ops, random dtypes and sizes (0 and 1 included),
preallocated outputs or not. Each either matches eager torch on the whole
tensors or raises a hostir error on every rank — never another exception, a
hang or a wrong result. Hypothesis runs derandomized, so every rank draws
the same programs in the same order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor


@dataclasses.dataclass
class Program:
    comm: str  # "allgather", "allreduce", "reduce_scatter"
    kind: str  # the reduction of allreduce / reduce_scatter
    dtype: torch.dtype
    chunks: int
    m: int
    local_ops: list[tuple[str, float]]
    stream: bool
    streams: int
    preallocate: bool


@st.composite
def programs(draw) -> Program:
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64]))
    numbers = [2, -1] if not dtype.is_floating_point else [0.5, -2.0]
    return Program(
        comm=draw(st.sampled_from(["allgather", "allreduce", "reduce_scatter"])),
        kind=draw(st.sampled_from(["sum", "max", "min"])),
        dtype=dtype,
        chunks=draw(st.sampled_from([1, 2, 3])),
        m=draw(st.sampled_from([0, 1, 2, 3])),
        local_ops=draw(st.lists(st.tuples(st.sampled_from(["add", "mul"]), st.sampled_from(numbers)), max_size=2)),
        stream=draw(st.booleans()),
        streams=draw(st.integers(1, 3)),
        preallocate=draw(st.booleans()),
    )


def build(p: Program, D: int):
    mesh = DeviceMesh(range(D))
    with FusionDefinition() as fd:
        if p.comm == "allgather":
            x = fd.define_tensor([-1, D, -1], dtype=p.dtype)  # [chunks, D, m], axis 1 sharded
        else:
            x = fd.define_tensor([D, D, -1], dtype=p.dtype)  # axis 0 sharded
        cur, tvs = x, [x]
        for op, number in p.local_ops:
            cur = getattr(fd.ops, op)(cur, number)
            tvs.append(cur)
        out = fd.ops.set(cur) if p.comm == "allgather" else getattr(fd.ops, p.kind)(cur, [0])
        fd.add_output(out)
    for tv in tvs + [out]:
        tv.set_device_mesh(mesh)
    if p.comm == "allgather":
        for tv in tvs:
            tv.axis(1).parallelize(ParallelType.mesh_x)
        if p.stream:
            out.axis(0).parallelize(ParallelType.stream)
    else:
        for tv in tvs:
            tv.axis(0).parallelize(ParallelType.mesh_x)
        if p.comm == "reduce_scatter":
            out.axis(1).parallelize(ParallelType.mesh_x)
    return fd, x, out


def reference(p: Program, full: torch.Tensor) -> torch.Tensor:
    cur = full
    for op, number in p.local_ops:
        cur = getattr(torch, op)(cur, number)
    if p.comm == "allgather":
        return cur
    if p.kind == "sum":
        return cur.sum(0, dtype=cur.dtype if cur.dtype.is_floating_point else torch.int64)
    return cur.amax(0) if p.kind == "max" else cur.amin(0)


@pytest.mark.timeout(600)
@settings(
    max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(p=programs())
def test_random_sharded_programs_match_eager_or_raise_a_hostir_error(world, device, p):
    D = world.size
    fd, x, out_tv = build(p, D)
    torch.manual_seed(p.chunks * 100 + p.m)  # the same whole tensors on every rank
    shape = [p.chunks, D, p.m] if p.comm == "allgather" else [D, D, p.m]
    if p.dtype.is_floating_point:
        full = torch.randn(shape, dtype=p.dtype)
    else:
        full = torch.randint(-6, 7, shape, dtype=p.dtype)
    full = full.to(device)
    try:
        expected = reference(p, full)
    except (RuntimeError, IndexError):
        expected = None  # eager torch rejects it: hostir must too
    if expected is not None and p.comm == "reduce_scatter":
        expected = shard_tensor(expected, out_tv)
    outputs = None
    if p.preallocate and expected is not None:
        outputs = [torch.full_like(expected, 7)]
    try:
        (out,) = fd.execute([shard_tensor(full, x)], outputs=outputs, number_of_streams=p.streams)
    except hostir.HostIrError as err:
        assert str(err)
        return
    assert expected is not None, f"hostir ran a program eager torch rejects: {p}"
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected)
