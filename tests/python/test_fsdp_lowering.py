"""FSDP-style programs lowered for one rank of 2, 3 and 4: each layer's
weight Allgather is posted before the previous layer computes, its Wait
stays before the linear that reads it, and the gathered weight is freed
right after that linear. Golden dumps (race-checked with every Wait and
Synchronize removed in turn); the same programs run under mpirun in
tests/python/multidevice/test_fsdp.py."""

from __future__ import annotations

import pytest

import hostir
from conftest import check_golden
from fsdp_programs import fsdp_mlp
from hostir import ir
from hostir.lower import lower
from hostir.lower.hoist_transfers import Hoisting


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_golden_dump_of_hoisted_allgathers(world_size):
    check_golden(f"fsdp_mlp_np{world_size}", lower(fsdp_mlp(world_size).fusion, rank=0, backend="gloo"))


def test_each_gathered_weight_is_freed_after_its_linear():
    program = lower(fsdp_mlp(2).fusion, rank=0, backend="gloo").program
    exprs = program.exprs
    for comm in [e for e in exprs if isinstance(e, ir.Communication)]:
        (linear,) = [e for e in exprs if isinstance(e, ir.LinearOp) and e.weight is comm.out]
        (free,) = [i for i, e in enumerate(exprs) if isinstance(e, ir.Deallocate) and e.buffer is comm.out]
        assert free > exprs.index(linear)
        assert not any(isinstance(e, ir.FUSION_OPS) for e in exprs[exprs.index(linear) + 1 : free])


def test_at_most_two_gathered_weights_are_live():
    lowered = lower(fsdp_mlp(4, layers=5).fusion, rank=1, backend="gloo")
    program = lowered.program
    live = peak = 0
    for e in program.exprs:
        if isinstance(e, ir.Allocate):
            live += 1
            peak = max(peak, live)
        elif isinstance(e, ir.Deallocate) and any(
            isinstance(c, ir.Communication) and c.out is e.buffer for c in program.exprs
        ):
            live -= 1
    assert peak == 2
    hoisted = [e for e in program.exprs if isinstance(e, ir.Communication) and e.schedule]
    assert len(hoisted) == 4 and all("hoisted above" in e.schedule for e in hoisted)
    assert hostir.check_races(program, lowered.rank) == []


def test_sequential_leaves_each_allgather_by_its_use():
    program = lower(fsdp_mlp(2).fusion, rank=0, backend="gloo", hoisting=Hoisting("sequential")).program
    exprs = program.exprs
    for i, e in enumerate(exprs):
        if isinstance(e, ir.Communication):
            assert isinstance(exprs[i + 1], ir.Wait) and exprs[i + 1].communication is e
            assert e.schedule == "sequential"
