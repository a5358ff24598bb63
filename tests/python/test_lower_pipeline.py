"""`lower(..., until=pass_name)`: the program right after one pass of the
pipeline, as the `hostir dump --pass` command shows it."""

from __future__ import annotations

import pytest

from hostir import overlap
from hostir.lower import PIPELINE, LoweringError, _run_one, lower, pass_names, pass_options
from hostir.ir import ForLoop
from hostir.lower.assign_streams import StreamAssignmentError, assign_streams, default_form
from hostir.lower.build_host_program import build_host_program


def test_lower_until_a_pass_stops_right_after_it():
    fusion = overlap.allgather_matmul(2).fusion
    names = pass_names()
    assert names[0] == "build_host_program" and names[-1] == "prune_for_rank"
    container = _run_one(build_host_program, fusion, None)
    assert str(lower(fusion, rank=1, backend="gloo", until="build_host_program").program) == str(container)
    options = pass_options(1, "gloo")
    for p in PIPELINE:
        container = _run_one(p, container, None, options.get(p))
        assert str(lower(fusion, rank=1, backend="gloo", until=p.__name__).program) == str(container), p.__name__
    pruned = lower(fusion, rank=1, backend="gloo", until="prune_for_rank")
    assert str(pruned.program) == str(lower(fusion, rank=1, backend="gloo").program)
    with pytest.raises(LoweringError, match="unknown pass 'fuse'; passes in order: build_host_program, "):
        lower(fusion, until="fuse")


def test_the_stream_form_is_an_option():
    """A stream loop's caller/worker form is chosen by an option: by
    default per iteration without meshes; pipelined on request (a loop
    that makes the workers wait for the caller, then the work loop), which
    computes the same."""
    import torch

    from hostir import FusionDefinition, ParallelType
    from hostir.runtime.evaluator import HostIrEvaluator

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.add(x, x)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.stream)
    default = str(lower(fd.fusion).program)
    assert default == str(lower(fd.fusion, stream_form="per_iteration").program)
    pipelined = lower(fd.fusion, stream_form="pipelined").program
    text = str(pipelined)
    assert default.count("FOR StreamIdx") == 1 and text.count("FOR StreamIdx") == 2, text
    assert text.index("GetCurrentStream") < text.index("FOR StreamIdx"), text
    t = torch.randn(6, 5)
    (out,) = HostIrEvaluator(pipelined).run({pipelined.inputs[0]: t})
    torch.testing.assert_close(out, t + t)
    with pytest.raises(LoweringError, match="unknown stream form 'eager'"):
        lower(fd.fusion, stream_form="eager")


def test_assign_streams_follows_the_loop_building_passes():
    names = pass_names()
    assert names.index("assign_streams") == names.index("parallelize_streams") + 1
    assert names.index("decompose_device_axis") < names.index("parallelize_streams")


def _marked_program(caller_ops: int, caller_after: int = 0):
    """A program after `parallelize_streams`: one loop marked stream-parallel."""
    from hostir import FusionDefinition, ParallelType

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.mul(x, 2.0))
    fd.fusion.outputs[0].axis(0).parallelize(ParallelType.stream)
    program = lower(fd.fusion, until="parallelize_streams").program
    program.exprs = [
        e.replace(caller_ops=caller_ops, caller_after=caller_after) if isinstance(e, ForLoop) else e
        for e in program.exprs
    ]
    return program


def test_assign_streams_writes_each_loop_once():
    """The pass clears the marks it acts on: a second run changes nothing."""
    once = assign_streams(_marked_program(0), form="pipelined")
    assert str(assign_streams(once, form="pipelined")) == str(once)
    assert str(assign_streams(once, form="per_iteration")) == str(once)


def test_the_default_stream_form_follows_the_program():
    """One place chooses the form when none is asked for: pipelined for a
    multi-device program, per iteration otherwise."""
    assert default_form(_marked_program(0)) == "per_iteration"
    assert default_form(lower(overlap.allgather_matmul(2).fusion, until="parallelize_streams").program) == "pipelined"


def test_a_loop_counting_missing_caller_ops_is_refused():
    """A loop whose own-chunk ops are not there (only an Allocate is
    before it) is an error that names the loop, not a misplaced wait."""
    with pytest.raises(StreamAssignmentError, match=r"counts 2 ops of the caller before it and 0 after it, but its scope has 1 before"):
        assign_streams(_marked_program(2), form="pipelined")
    # The ops after it: only the loop's end is there (nothing follows it).
    with pytest.raises(StreamAssignmentError, match=r"counts 0 ops of the caller before it and 3 after it, but its scope has 1 before and 0 after"):
        assign_streams(_marked_program(0, 3), form="pipelined")
