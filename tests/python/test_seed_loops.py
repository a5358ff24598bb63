"""The reference pull request's three stream-lowering programs, written as
a user writes them and lowered by the whole pipeline.

Stream axes propagate to tensors the user left unscheduled, so the middle
op of the third program must be scheduled explicitly with
`parallelize(ParallelType.serial)`: that keeps it out of the stream loops,
and the program gets two loops with the middle op at the top level between
them. Each program's full lowering is a golden dump; without the
deallocation pass (which the pull request predates) it equals the pull
request's dump up to the numbering of values.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import GOLDEN, check_golden, renumber
from hostir import FusionDefinition, ParallelType
from hostir.lower import PIPELINE, run_passes
from hostir.lower.build_host_program import build_host_program
from hostir.lower.insert_deallocations import insert_deallocations

STREAM, SERIAL = ParallelType.stream, ParallelType.serial


def single_set():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    y.axis(0).parallelize(STREAM)
    return fd


def two_sets_merged():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        z = fd.ops.set(y)
        fd.add_output(z)
    y.axis(0).parallelize(STREAM)
    z.axis(0).parallelize(STREAM)
    return fd


def three_sets_split():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.set(x)
        b = fd.ops.set(a)
        c = fd.ops.set(b)
        fd.add_output(c)
    a.axis(0).parallelize(STREAM)
    b.axis(0).parallelize(SERIAL)
    c.axis(0).parallelize(STREAM)
    return fd


SEEDS = {"single_set": single_set, "two_sets_merged": two_sets_merged, "three_sets_split": three_sets_split}


def _without_deallocations(fd) -> str:
    passes = [p for p in PIPELINE if p is not insert_deallocations]
    return str(run_passes(build_host_program(fd.fusion), passes))


@pytest.mark.parametrize("case", sorted(SEEDS))
def test_full_lowering_golden(case):
    fd = SEEDS[case]()
    check_golden(f"seed_{case}", fd.host_program())


@pytest.mark.parametrize("case", sorted(SEEDS))
def test_pipeline_gives_the_reference_dump(case):
    expected = (GOLDEN / f"reference_{case}.hir").read_text()
    assert renumber(_without_deallocations(SEEDS[case]())) == renumber(expected)


@pytest.mark.parametrize("number_of_streams", [1, 3])
@pytest.mark.parametrize("case", sorted(SEEDS))
def test_seed_matches_eager(case, number_of_streams, evaluator, device):
    fd = SEEDS[case]()
    x = torch.randn(6, 5, device=device)
    (out,) = fd.execute([x], number_of_streams=number_of_streams)
    torch.testing.assert_close(out, x)


def test_explicit_serial_runs_at_top_level_between_two_loops():
    text = three_sets_split().host_ir()
    _, first_loop, rest = text.split("\n  FOR StreamIdx", 2)
    assert re.search(r"\n  T2_g_float\[iS\d+\{i0\}, iS\d+\{i1\}\]\n     = Set\( T1_g_float", first_loop), text
    assert "Set( T2_g_float" not in text and "HirAliasSelect( T2_g_float" in rest, text


def test_unscheduled_middle_op_joins_one_loop():
    """Without the explicit schedule the middle tensor takes the stream axis
    of its operand, and the three ops share one loop."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.set(x)
        b = fd.ops.set(a)
        c = fd.ops.set(b)
        fd.add_output(c)
    a.axis(0).parallelize(STREAM)
    c.axis(0).parallelize(STREAM)
    assert fd.host_ir().count("FOR StreamIdx") == 1
    x = torch.randn(4, 3)
    torch.testing.assert_close(fd.execute([x])[0], x)


def test_explicit_serial_keeps_a_consumer_out_of_backward_propagation():
    """A serial schedule on an operand is kept going backward too: the
    stream output's loop slices it instead of giving it a stream axis."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.mul(x, 2.0)
        b = fd.ops.add(a, 1.0)
        fd.add_output(b)
    a.axis(0).parallelize(SERIAL)
    b.axis(0).parallelize(STREAM)
    text = fd.host_ir()
    assert text.count("FOR StreamIdx") == 1, text
    assert "T1_g_float[iS" in text, text
    x = torch.randn(5, 3)
    torch.testing.assert_close(fd.execute([x])[0], x * 2.0 + 1.0)
