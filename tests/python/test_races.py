"""The stream-race checker on hand-built programs: accesses resolved through
aliases, slices, out= buffers and communication buffers; happens-before
from Synchronize, Wait, loop iterations and the caller's join; and
`HOSTIR_CHECK=races` after every lowering pass. Every golden program and its
Synchronize/Wait mutants are checked by `conftest.check_golden`."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import FusionDefinition, OptionError, ParallelType, ir
from hostir.container import HostIrContainer
from hostir.lower import PIPELINE, LoweringError, lower

from race_mutations import check_sync_mutations, mutant, sync_paths


def _tv(c, n=4):
    return ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(n))], torch.float32, ir.MemoryType.global_)


def _program():
    """A program with an input x, a caller stream and worker stream 1."""
    c = HostIrContainer()
    x = _tv(c)
    c.add_input(x)
    caller = ir.Stream(c)
    worker = ir.Stream(c, index=ir.Scalar.constant(1))
    c.push_back(ir.GetCurrentStream(caller))
    return c, x, caller, worker


def test_race_free_program_has_no_race():
    c, x, caller, worker = _program()
    y = _tv(c)
    c.push_back(ir.Allocate(y))
    for e in (ir.SetCurrentStream(worker), ir.Synchronize(caller), ir.Set(y, x)):
        c.push_back(e)
    c.push_back(ir.SetCurrentStream(caller))
    c.push_back(ir.Synchronize(worker))
    c.add_output(y)
    assert hostir.check_races(c) == []


def test_write_on_a_worker_stream_races_with_the_allocation_on_the_caller():
    c, x, caller, worker = _program()
    y = _tv(c)
    c.push_back(ir.Allocate(y))
    c.push_back(ir.SetCurrentStream(worker))
    c.push_back(ir.Set(y, x))
    c.add_output(y)
    races = hostir.check_races(c)
    assert races, "unsynchronized worker stream not reported"
    text = "\n".join(map(str, races))
    assert f"race on T{y.name}" in text
    assert "writes on the caller's stream: T1_g_float[iS1{4}] = ALLOCATE" in text
    assert "writes on stream 1: T1_g_float[iS1{4}]\n= Set(" in text or "writes on stream 1: T1_g_float" in text


def test_write_through_an_alias_is_a_write_of_the_original():
    c, x, caller, worker = _program()
    buf, alias, out = _tv(c), _tv(c), _tv(c)
    c.mark_alias(buf, alias)
    c.push_back(ir.Allocate(buf))
    for e in (ir.SetCurrentStream(worker), ir.Synchronize(caller), ir.Set(alias, x), ir.SetCurrentStream(caller)):
        c.push_back(e)
    c.push_back(ir.Set(out, buf))  # reads buf on the caller, never synchronized with the worker
    c.add_output(out)
    races = hostir.check_races(c)
    assert [r.buffer for r in races] == [f"T{buf.name}"]
    assert races[0].first.kind == "write" and races[0].second.kind == "read"
    # With the join, no race.
    c.exprs.insert(len(c.exprs) - 1, ir.Synchronize(worker))
    assert hostir.check_races(c) == []


def _ag_matmul_program():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, 2, -1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(hostir.DeviceMesh([0, 1]))
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return lower(fd.fusion, rank=0).program


def test_communication_output_read_before_its_wait_races_with_loop_indices():
    program = _ag_matmul_program()
    assert hostir.check_races(program, rank=0) == []
    (wait_path,) = [p for p in sync_paths(program.exprs) if isinstance(_at(program, p), ir.Wait)]
    races = hostir.check_races(mutant(program, wait_path), rank=0)
    posted = [r for r in races if r.first.kind == "write" and r.first.line.startswith("Communication")]
    (first,) = [r for r in posted if r.second.kind == "read"]
    # The deallocation of the gathered buffer after the loops races with
    # the unwaited write too.
    assert [r.second.line.split("\n")[0] for r in posted if r.second.kind == "write"] == ["Deallocate {"]
    assert first.buffer == "T2"  # the gathered buffer the slices T5 select from
    assert "matmul" in first.second.line and first.second.kind == "read"
    assert first.first.loops == (("StreamIdx", 0),) and first.second.loops == (("StreamIdx", 0),)
    assert "(in loop StreamIdx = 0)" in str(first) and "communication 0" in str(first)


def _at(program, path):
    e = program.exprs[path[0]]
    for i in path[1:]:
        e = e.body[i]
    return e


def test_slices_of_different_iterations_do_not_overlap_but_whole_buffers_do():
    """Iteration i writes slice i on stream i: race-free; reading the whole
    buffer on the caller without the join races with every slice."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.stream)
    program = fd.host_program()
    assert hostir.check_races(program) == []
    check_sync_mutations(program)
    loop = next(e for e in program.exprs if isinstance(e, ir.ForLoop))
    out = ir.TensorView(program, [ir.IterDomain(program, d.extent) for d in y.domain], torch.float32)
    racy = program.derive()
    body = [e for e in loop.body if not isinstance(e, ir.Synchronize) or e is loop.body[2]]
    racy.exprs = [e if e is not loop else loop.replace(body=body) for e in program.exprs]
    racy.exprs.append(ir.Set(out, program.outputs[0]))
    races = hostir.check_races(racy)
    (race,) = races
    assert race.first.kind == "write" and race.first.loops == (("StreamIdx", 0),)
    assert race.second.kind == "read" and race.second.loops == () and race.second.timeline == "caller"


def test_deallocate_while_another_stream_reads_races():
    c, x, caller, worker = _program()
    tmp, out = _tv(c), _tv(c)
    c.push_back(ir.Set(tmp, x))
    for e in (ir.SetCurrentStream(worker), ir.Synchronize(caller), ir.Allocate(out), ir.Set(out, tmp)):
        c.push_back(e)
    c.push_back(ir.SetCurrentStream(caller))
    c.push_back(ir.Deallocate(tmp))
    c.push_back(ir.Synchronize(worker))
    c.add_output(out)
    races = hostir.check_races(c)
    assert any("Deallocate" in r.second.line or "Deallocate" in r.first.line for r in races)


def test_unwaited_communication_races_with_the_callers_read_of_outputs():
    c = HostIrContainer()
    x, y = _tv(c), _tv(c)
    c.add_input(x)
    c.push_back(ir.Allocate(y))
    comm = ir.P2PCommunication(c.next_name("comm"), "recv", y, ir.Scalar.constant(1))
    c.push_back(comm)
    c.add_output(y)
    races = hostir.check_races(c)
    assert races and "after the program returns" in races[-1].second.line
    c.push_back(ir.Wait(comm))
    assert hostir.check_races(c) == []


def test_check_races_takes_a_container():
    with pytest.raises(TypeError, match="check_races takes a HostIrContainer"):
        hostir.check_races("not a program")


# ---------------------------------------------------------------- HOSTIR_CHECK


def drop_synchronizes(container):
    """A broken pass: drops every Synchronize."""

    def keep(exprs):
        return [
            e.replace(body=keep(e.body)) if isinstance(e, ir.ForLoop) else e
            for e in exprs
            if not isinstance(e, ir.Synchronize)
        ]

    new = container.derive()
    new.exprs = keep(container.exprs)
    return new


def _single_set():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def test_hostir_check_races_fails_the_pass_that_leaves_a_race(monkeypatch):
    monkeypatch.setattr("hostir.lower.PIPELINE", PIPELINE + [drop_synchronizes])
    lower(_single_set().fusion)  # not checked without HOSTIR_CHECK
    monkeypatch.setenv("HOSTIR_CHECK", "races")
    with pytest.raises(LoweringError, match=r"(?s)pass drop_synchronizes left \d+ stream race\(s\).*race on T0"):
        lower(_single_set().fusion)


def test_hostir_check_races_passes_a_race_free_pipeline(monkeypatch):
    monkeypatch.setenv("HOSTIR_CHECK", "races")
    fd = _single_set()
    out, = fd.execute([torch.randn(4, 3)])
    assert out.shape == (4, 3)


def test_hostir_check_bad_option_is_an_error(monkeypatch):
    monkeypatch.setenv("HOSTIR_CHECK", "racez")
    with pytest.raises(OptionError, match="HOSTIR_CHECK: unknown option 'racez'"):
        lower(_single_set().fusion)
