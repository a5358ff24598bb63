"""What runs a call, and why, is said and can be asked: `fd.last_runner`,
one line in the `host_ir` dump and in the `hostir` log. The C++ executor is
never left out silently: every reason it is not used is listed."""

from __future__ import annotations

import logging

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
        fd.add_output(fd.ops.relu(fd.ops.mul(x, a)))
    x = torch.randn(3, 5)
    (out,) = fd.execute([x, -2.0])
    torch.testing.assert_close(out, torch.relu(x * -2.0))
    reasons = fd.last_runner.reasons
    assert [r.split(" (")[0].split(":")[0] for r in reasons] == [
        "it takes scalar inputs",
        "it has no instruction for UnaryOp",
    ], reasons


def test_fake_is_a_runner(monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    fd = _double()
    (out,) = fd.execute([torch.randn(4, 3)])
    assert out.device.type == "meta" and list(out.shape) == [4, 3]
    assert fd.last_runner.name == "fake"
    assert "HOSTIR_FAKE=1" in fd.last_runner.reason


def test_the_full_path_and_a_prepared_call_share_the_run_stage(monkeypatch):
    """A prepared call holds no runner of its own: it enters at bind, and
    both routes run through `bind.run`."""
    from hostir.runtime import bind

    real, calls = bind.run, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("exact_outputs", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(bind, "run", spy)
    fd = _double()
    x = torch.randn(4, 3)
    for _ in range(3):
        (out,) = fd.execute([x])
        torch.testing.assert_close(out, x + x)
    # The full path once, then the prepared record twice.
    assert calls == [False, True, True]
    assert len(fd.executor._prepared) == 1
