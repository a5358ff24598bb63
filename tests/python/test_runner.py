"""What runs a call, and why, is said and can be asked: `fd.last_runner`,
one line in the `host_ir` dump and in the `hostir` log. The C++ executor is
never left out silently: every reason it is not used is listed."""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
import torch

from hostir import FusionDefinition, cpp

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")


def _double():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.add(x, x))
    return fd


def _scaled():
    """A scalar input: the C++ executor takes tensors only."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        a = fd.define_scalar(float)
        fd.add_output(fd.ops.mul(x, a))
    return fd


def test_no_runner_before_the_first_call():
    assert _double().last_runner is None


def test_python_when_asked_names_who_asked(monkeypatch):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = _double()
    x = torch.randn(4, 3)
    (out,) = fd.execute([x], evaluator="python")
    torch.testing.assert_close(out, x + x)
    assert fd.last_runner.name == "python"
    assert fd.last_runner.reasons == ("evaluator='python' was passed",)
    monkeypatch.setenv("HOSTIR_EVALUATOR", "python")
    other = _double()
    other.execute([x])
    assert str(other.last_runner) == "runner: python (the C++ executor is not used: HOSTIR_EVALUATOR=python)"


@needs_cpp
def test_cpp_by_default_and_on_the_prepared_path(monkeypatch):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = _double()
    x = torch.randn(4, 3)
    for _ in range(3):  # the full path, then the prepared call's record
        (out,) = fd.execute([x])
        torch.testing.assert_close(out, x + x)
        assert fd.last_runner.name == "cpp" and fd.last_runner.reasons == ()
        assert str(fd.last_runner) == "runner: cpp"
    assert len(fd.executor._prepared) == 1


@needs_cpp
def test_a_program_the_cpp_executor_cannot_run_says_why(monkeypatch, capsys):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    monkeypatch.setenv("HOSTIR_DUMP", "host_ir")
    fd = _scaled()
    x = torch.randn(4, 3)
    (out,) = fd.execute([x, 1.5])
    torch.testing.assert_close(out, x * 1.5)
    runner = fd.last_runner
    assert runner.name == "python"
    assert len(runner.reasons) == 1 and runner.reasons[0].startswith("it takes scalar inputs"), runner.reasons
    dumped = capsys.readouterr().out
    assert f"}} // %HostIrContainer\n{runner}\n" in dumped, dumped


def test_the_runner_is_logged(monkeypatch, caplog):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = _scaled()
    with caplog.at_level(logging.INFO, logger="hostir"):
        fd.execute([torch.randn(2, 2), 2.0], evaluator="python")
    lines = [r.getMessage() for r in caplog.records if "runner:" in r.getMessage()]
    assert lines == [f"[rank 0/1] {fd.last_runner}"], lines


@needs_cpp
def test_every_reason_is_listed(monkeypatch):
    """A scalar input and an op the C++ executor has no instruction for:
    both reasons, in the runner and in `flat.unsupported_reasons`."""
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        a = fd.define_scalar(float)
        fd.add_output(fd.ops.reshape(fd.ops.mul(x, a), [-1]))
    x = torch.randn(3, 5)
    (out,) = fd.execute([x, -2.0])
    torch.testing.assert_close(out, (x * -2.0).reshape(-1))
    reasons = fd.last_runner.reasons
    assert [r.split(" (")[0].split(":")[0] for r in reasons] == [
        "it takes scalar inputs",
        "it has no instruction for ReshapeOp",
    ], reasons


def test_fake_is_a_runner(monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    fd = _double()
    (out,) = fd.execute([torch.randn(4, 3)])
    assert out.device.type == "meta" and list(out.shape) == [4, 3]
    assert fd.last_runner.name == "fake"
    assert "HOSTIR_FAKE=1" in fd.last_runner.reason


def _record_stages(monkeypatch, fd) -> list[str]:
    """The stage methods (`FusionExecutor.STAGES`) each call of `fd` goes
    through, in order."""
    called: list[str] = []
    executor = fd.executor
    for name in executor.STAGES:
        real = getattr(executor, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(executor, name, spy)
    return called


ALL_STAGES = ["_normalize", "_check", "_program", "_agree", "_bind", "_run", "_convert"]


def test_every_route_goes_through_the_same_stages(monkeypatch):
    """The full path, a prepared call (the memo of the first four stages,
    entering at bind) and the fake runner pass through one list of stages."""
    from hostir.executor import FusionExecutor

    assert list(FusionExecutor.STAGES) == ALL_STAGES
    fd = _double()
    called = _record_stages(monkeypatch, fd)
    x = torch.randn(4, 3)
    (out,) = fd.execute([x])
    torch.testing.assert_close(out, x + x)
    assert called == ALL_STAGES
    called.clear()
    for _ in range(2):
        (out,) = fd.execute([x])
        torch.testing.assert_close(out, x + x)
    assert called == ALL_STAGES[4:] * 2
    assert len(fd.executor._prepared) == 1

    called.clear()
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    (out,) = fd.execute([x])
    assert out.device.type == "meta" and list(out.shape) == [4, 3]
    assert fd.last_runner.name == "fake"
    assert called == ALL_STAGES


def test_a_multi_device_call_goes_through_the_same_stages(monkeypatch):
    """A multi-device fusion (here one rank of a one-device mesh, gloo)
    takes the same stages: its agreement is the fourth; the first call
    makes the communicator and keeps the record its second call enters
    bind with (one rank has no peer to agree with)."""
    from hostir import DeviceMesh, ParallelType, communicator

    for name in communicator.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.add(x, x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh([0]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.mesh_x)
    called = _record_stages(monkeypatch, fd)
    try:
        for _ in range(2):
            a = torch.randn(1, 3)  # this rank's piece of the mesh_x axis
            (out,) = fd.execute([a], backend="gloo")
            torch.testing.assert_close(out, a + a)
    finally:
        communicator.shutdown()
    assert called == ALL_STAGES + ALL_STAGES[4:]
    assert len(fd.executor._prepared) == 1


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not on PATH (pip install -e '.[test]')")
def test_steady_multi_device_calls_enter_at_bind():
    """Two ranks (mpirun, gloo): the first call of each exact signature runs
    every stage (the ranks agree on the full record), later calls of it are
    prepared and enter at bind; every result matches eager torch.
    (tests/python/multidevice/test_prepared_agreement.py checks, under
    mpirun, that the protections still fire from such calls.)"""
    from launchers import open_mpi_command, run_job
    from spawn import free_port

    exports = {"HOSTIR_TIMEOUT": "60", "HOSTIR_MASTER_PORT": str(free_port())}
    command = open_mpi_command(2, [sys.executable, "tests/python/scripts/stages_multidevice.py"], exports)
    returncode, output, _ = run_job(command, 240)
    assert returncode == 0, output[-4000:]
    found = {}
    for line in output.splitlines():
        if line.startswith("STAGES "):
            _, rank, text = line.split(" ", 2)
            found[int(rank)] = json.loads(text)
    assert sorted(found) == [0, 1], output[-4000:]
    for rank, report in found.items():
        stages = [call["stages"] for call in report["calls"]]
        assert stages == [ALL_STAGES, ALL_STAGES[4:], ALL_STAGES[4:], ALL_STAGES, ALL_STAGES[4:]], (rank, stages)
        assert all(call["matches"] for call in report["calls"]), (rank, report)
        assert report["prepared"] == 2, (rank, report)
