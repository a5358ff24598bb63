"""`lower` returns a `LoweredProgram`: the host program, which holds ops and
values only, beside what running it needs (digest, teams, chunked axes,
the rank it was pruned for) and the options it was lowered with."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ir, overlap
from hostir.container import VerifyError
from hostir.lower import LoweredProgram, LoweringError, LoweringOptions, lower, pass_names
from hostir.lower.hoist_transfers import Hoisting
from hostir.lower.schedule import Schedule

RUN_CONFIGURATION = ("rank", "backend", "schedule", "chunked", "digest", "all_teams")


def test_the_container_holds_no_run_configuration_and_the_record_does():
    fusion = overlap.allgather_matmul(2).fusion
    schedule = Schedule(chunks=4)
    hoisting = Hoisting("sequential")
    lowered = lower(fusion, rank=1, backend="Gloo", schedule=schedule, hoisting=hoisting)
    assert isinstance(lowered, LoweredProgram)
    for name in RUN_CONFIGURATION:
        assert not hasattr(lowered.program, name), name
        assert not hasattr(lowered.program.derive(), name), name
    assert lowered.rank == 1
    assert lowered.backend == "gloo" and lowered.options.backend == "gloo"
    assert lowered.schedule is schedule and lowered.hoisting is hoisting
    # The digest hashes the program before pruning: every rank's is the
    # unpruned program's.
    whole = lower(fusion, backend="gloo", schedule=schedule, hoisting=hoisting)
    assert whole.rank is None
    assert lowered.digest == whole.digest == hashlib.sha256(str(whole.program).encode()).hexdigest()
    assert lower(fusion, rank=0, backend="gloo", schedule=schedule, hoisting=hoisting).digest == lowered.digest
    # A ring moves pieces peer to peer: no process group beyond the world.
    assert lowered.teams == tuple(whole.program.teams()) == ()
    collective = lower(fusion, rank=1, backend="gloo", schedule=Schedule("collective"))
    assert collective.teams == ((0, 1),)
    # The rows the ring cuts into 4 chunks have a symbolic extent: each call checks it divides.
    ((extent, parts, where),) = lowered.chunking
    assert isinstance(extent, ir.Scalar) and not extent.is_constant and parts == 4
    assert where.startswith("axis iS6{i0}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lowered.rank = 0  # type: ignore[misc]


def test_options_as_a_record_or_as_keywords_lower_the_same():
    fusion = overlap.allgather_matmul(2).fusion
    options = LoweringOptions(rank=0, backend="gloo", schedule=Schedule(chunks=2))
    by_record = lower(fusion, options)
    by_keywords = lower(fusion, rank=0, backend="gloo", schedule=Schedule(chunks=2))
    assert by_record.options == by_keywords.options == options
    assert str(by_record.program) == str(by_keywords.program)
    assert by_record.digest == by_keywords.digest
    with pytest.raises(LoweringError, match="not both"):
        lower(fusion, options, rank=1)
    with pytest.raises(LoweringError, match="resharding must be one of"):
        LoweringOptions(resharding="sideways")
    with pytest.raises(TypeError):
        lower(fusion, ranks=0)


def test_a_single_device_program_is_never_pruned():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.relu(x))
    lowered = lower(fd.fusion, rank=3)
    assert lowered.rank is None and lowered.options.rank == 3
    assert lowered.teams == () and lowered.chunking == ()
    assert lowered.digest == hashlib.sha256(str(lowered.program).encode()).hexdigest()


def test_until_returns_the_record_of_the_program_so_far():
    fusion = overlap.allgather_matmul(2).fusion
    first = lower(fusion, rank=1, until="build_host_program")
    assert first.digest is None and first.teams == () and first.rank is None
    cut = lower(fusion, rank=1, schedule=Schedule(chunks=4), until="decompose_device_axis")
    assert cut.digest is None and cut.rank is None and [p for _, p, _ in cut.chunking] == [4]
    for name in pass_names()[1:-1]:
        stopped = lower(fusion, rank=1, until=name)
        assert stopped.digest is None and stopped.rank is None, name
        for attr in RUN_CONFIGURATION:
            assert not hasattr(stopped.program, attr), (name, attr)
    pruned = lower(fusion, rank=1, until="prune_for_rank")
    full = lower(fusion, rank=1)
    assert pruned.rank == full.rank == 1 and pruned.digest == full.digest and pruned.teams == full.teams
    assert str(pruned.program) == str(full.program)


def test_a_pruned_program_verifies_as_its_rank():
    """Rank 1 holds nothing of a program on rank 0's mesh: its pruned
    program defines no output, which is right for rank 1 only."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        y = fd.ops.relu(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh([0]))
    elsewhere = lower(fd.fusion, rank=1)
    assert elsewhere.rank == 1 and not elsewhere.program.exprs
    elsewhere.program.verify(elsewhere.rank)
    with pytest.raises(VerifyError, match="is never defined"):
        elsewhere.program.verify()


def test_the_executor_keeps_the_record_of_each_program():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.relu(x))
    t = torch.randn(3, 5)
    (out,) = fd.execute([t])
    torch.testing.assert_close(out, t.relu())
    (program,) = fd.executor._programs.values()
    assert program.lowered.program is program.container
    assert program.lowered.digest == lower(fd.fusion).digest
    assert str(fd.executor.lowered_program().program) == str(fd.host_program()) == fd.host_ir()


def test_call_keywords_without_the_calls_inputs_are_refused():
    """`host_ir(schedule=...)` without inputs would lower the default
    program and drop the keyword: it is refused, naming the keyword."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.relu(x))
    with pytest.raises(Exception, match="schedule shape the program of a call: give the call's inputs"):
        fd.host_ir(schedule="sequential")
    assert "relu" in fd.host_ir(inputs=[torch.randn(3, 5)], schedule="sequential")
