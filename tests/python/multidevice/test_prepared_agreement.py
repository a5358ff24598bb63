"""Steady-state multi-device calls: prepared, and still protected.

The first call of an exact signature exchanges the full agreement record;
later calls of it enter at bind (the memo of stages 1-4) and, with
`check_ranks="always"`, send only a step of a few words. Every protection of
the full record must still fire from a prepared call, on every rank, before
any result is returned: a rank that skips a call, repeats one, or passes
other shapes, another dtype or another program — each here *after* the
ranks agreed on and prepared the signatures involved. One rank (rank 1)
misbehaves; every rank must raise, and the ranks stay in step afterwards.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hostir import RankMismatchError, overlap
from hostir.runtime import agreement

ODD = 1  # the rank that misbehaves
STAGES = ["_normalize", "_check", "_program", "_agree", "_bind", "_run", "_convert"]


def _layer(world, **kwargs):
    """The AG+matmul layer: y[D, m, N] = gather(x[D, m, K]) @ w[K, N]."""
    return overlap.allgather_matmul(world.size)


def _inputs(world, device, m=3, K=4, N=5, dtype=torch.float32):
    X = torch.randn(world.size, m, K, dtype=dtype, device=device)
    W = torch.randn(K, N, dtype=dtype, device=device)
    return overlap.allgather_matmul_inputs(X, W, world.rank)


def _run(fd, world, device, **kwargs):
    """One call on fresh random inputs, checked against eager torch."""
    shape = kwargs.pop("shape", {})
    inputs, expected = _inputs(world, device, **shape)
    (y,) = fd.execute(inputs, **kwargs)
    torch.testing.assert_close(y, expected)


def _record(monkeypatch, fd) -> list[str]:
    called: list[str] = []
    executor = fd.executor
    for name in executor.STAGES:
        real = getattr(executor, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(executor, name, spy)
    return called


def _count_exchanges(monkeypatch) -> dict[str, int]:
    """How many full records and steps the ranks' protocol exchanges."""
    from hostir.runtime import protocol as module

    counts = {"full": 0, "steps": 0}
    full, steps = module.exchange, module.post_steps

    def counted_full(*args, **kwargs):
        counts["full"] += 1
        return full(*args, **kwargs)

    def counted_steps(*args, **kwargs):
        counts["steps"] += 1
        return steps(*args, **kwargs)

    monkeypatch.setattr(module, "exchange", counted_full)
    monkeypatch.setattr(module, "post_steps", counted_steps)
    return counts


def _both_raise(fd, inputs, match: str, **kwargs) -> str:
    with pytest.raises(RankMismatchError, match=match) as info:
        fd.execute(inputs, **kwargs)
    return str(info.value)


# ------------------------------------------------------------ the path


def test_steady_calls_enter_at_bind_and_match_eager(world, device, monkeypatch):
    fd = _layer(world)
    called = _record(monkeypatch, fd)
    counts = _count_exchanges(monkeypatch)
    _run(fd, world, device)
    assert called == STAGES
    assert counts == {"full": 1, "steps": 1}
    called.clear()
    for _ in range(4):
        _run(fd, world, device)
    assert called == STAGES[4:] * 4
    # One step per call, no full record: the signature was agreed once.
    assert counts == {"full": 1, "steps": 5}
    assert len(fd.executor._prepared) == 1
    assert fd.executor.lowerings == 1


def test_a_new_shape_agrees_once_then_is_prepared(world, device, monkeypatch):
    fd = _layer(world)
    counts = _count_exchanges(monkeypatch)
    for m in (3, 3, 6, 6, 3, 6):
        _run(fd, world, device, shape={"m": m})
    assert counts == {"full": 2, "steps": 6}
    assert len(fd.executor._prepared) == 2


def test_first_checks_nothing_in_the_steady_state(world, device, monkeypatch):
    fd = _layer(world)
    called = _record(monkeypatch, fd)
    counts = _count_exchanges(monkeypatch)
    for _ in range(3):
        _run(fd, world, device, check_ranks="first")
    assert called == STAGES + STAGES[4:] * 2
    assert counts == {"full": 1, "steps": 0}


def test_every_exchanges_the_full_record_on_every_call(world, device, monkeypatch):
    fd = _layer(world)
    called = _record(monkeypatch, fd)
    counts = _count_exchanges(monkeypatch)
    for _ in range(3):
        _run(fd, world, device, check_ranks="every")
    assert called == STAGES * 3
    assert counts == {"full": 3, "steps": 0}
    assert len(fd.executor._prepared) == 0


def test_the_cpp_run_collects_a_steady_calls_step_before_its_first_communication(world, device, monkeypatch):
    """With the C++ executor the step posted at a steady call's start is
    collected by the run itself, right before its first communication (the
    host work before it overlaps the other ranks' arrival): once per call,
    from inside `CppEvaluator.run_logical`, and the calls match eager. The
    Python evaluator exchanges the step before the run, and posts none."""
    from hostir.runtime import protocol

    fd = _layer(world)
    _run(fd, world, device)
    cpp_runs = fd.executor.last_runner.name == "cpp"
    inside: list[bool] = []
    real = protocol.PostedStep.__call__

    def spy(self):
        if not self.collected:
            inside.append(any(f.function == "run_logical" and f.filename.endswith("cpp.py") for f in inspect.stack()))
        return real(self)

    monkeypatch.setattr(protocol.PostedStep, "__call__", spy)
    for _ in range(3):
        _run(fd, world, device)
    assert inside == ([True, True, True] if cpp_runs else []), fd.executor.last_runner


# ------------------------------------------------------------ protections after agreement


def _agreed(world, device, *fds, shapes=({},)):
    """Each fusion's signatures agreed on and prepared on every rank."""
    for fd in fds:
        for shape in shapes:
            for _ in range(2):
                _run(fd, world, device, shape=dict(shape))
        assert len(fd.executor._prepared) == len(shapes)


def test_a_skipped_call_raises_on_every_rank(world, device):
    fd, other = _layer(world), _layer(world)
    _agreed(world, device, fd, other)
    inputs, _ = _inputs(world, device)
    # Rank 1 skips its call of `fd` and goes on to `other`.
    mine = other if world.rank == ODD else fd
    message = _both_raise(mine, inputs, "out of step")
    assert "skipped or repeated" in message and f"rank {ODD}" in message, message
    # The others now call `other`, rank 1 the call of `fd` it skipped: the
    # same mismatch the other way round, after which every count is even.
    mine = fd if world.rank == ODD else other
    _both_raise(mine, inputs, "out of step")
    _run(fd, world, device)
    _run(other, world, device)


def test_a_repeated_call_raises_on_every_rank(world, device):
    fd, other = _layer(world), _layer(world)
    _agreed(world, device, fd, other)
    _run(fd, world, device)
    inputs, _ = _inputs(world, device)
    # Rank 1 calls `fd` again where the others go on to `other`.
    mine = fd if world.rank == ODD else other
    message = _both_raise(mine, inputs, "out of step")
    assert "skipped or repeated" in message, message
    mine = other if world.rank == ODD else fd
    _both_raise(mine, inputs, "out of step")
    _run(fd, world, device)
    _run(other, world, device)


@pytest.mark.parametrize("prepared_on_odd", [True, False], ids=["agreed_shape", "new_shape"])
def test_other_shapes_on_one_rank_raise_on_every_rank(world, device, prepared_on_odd):
    """Rank 1 passes shapes the ranks agreed on for another call (both
    ranks' calls are prepared: only the token differs), or a shape it never
    ran (its call takes the full path while the others' is prepared)."""
    fd = _layer(world)
    _agreed(world, device, fd, shapes=({"m": 3}, {"m": 6}))
    odd_m = 6 if prepared_on_odd else 7
    # Both drawn on every rank, so that the random streams stay the same.
    theirs, _ = _inputs(world, device, m=3)
    odd, _ = _inputs(world, device, m=odd_m)
    inputs = odd if world.rank == ODD else theirs
    message = _both_raise(fd, inputs, "inputs differ across ranks")
    assert f"rank {ODD} input 0 has shape [1, {odd_m}, 4]" in message, message
    assert "rank 0 input 0 has shape [1, 3, 4]" in message, message
    _run(fd, world, device, shape={"m": 6})


def test_another_dtype_on_one_rank_raises_on_every_rank(world, device):
    fd = _layer(world)
    _agreed(world, device, fd)
    inputs, _ = _inputs(world, device)
    if world.rank == ODD:
        inputs = [inputs[0].double(), inputs[1]]
    message = _both_raise(fd, inputs, f"rank {ODD} failed before the program ran")
    assert "float64" in message and "float32" in message, message
    _run(fd, world, device)


def test_another_program_on_one_rank_raises_on_every_rank(world, device):
    """Both schedules agreed on and prepared; then rank 1 asks for the other
    one: the same call and shapes, another program."""
    fd = _layer(world)
    for schedule in ("collective", "ring"):
        for _ in range(2):
            _run(fd, world, device, schedule=schedule)
    assert len(fd.executor._prepared) == 2
    inputs, _ = _inputs(world, device)
    schedule = "ring" if world.rank == ODD else "collective"
    message = _both_raise(fd, inputs, "host program differs across ranks", schedule=schedule)
    assert f"rank {ODD} lowered program" in message, message
    _run(fd, world, device, schedule="ring")


def test_a_local_error_of_a_prepared_call_raises_on_every_rank(world, device):
    """A preallocated output that aliases an input, on rank 1 only: the
    one check a prepared call makes again fails there, and every rank
    raises with its message."""
    fd = _layer(world)
    inputs, expected = _inputs(world, device)
    for _ in range(2):
        out = torch.empty_like(expected)
        fd.execute(inputs, [out])
        torch.testing.assert_close(out, expected)
    out = torch.empty_like(expected)
    if world.rank == ODD:
        # The weight, same shape and strides, inside the output's memory.
        w = inputs[1]
        shared = out.view(-1)[: w.numel()].view(w.shape)
        shared.copy_(w)
        inputs = [inputs[0], shared]
    with pytest.raises(RankMismatchError, match=f"rank {ODD} failed before the program ran") as info:
        fd.execute(inputs, [out])
    assert "shares memory with input 1" in str(info.value), str(info.value)
    _run(fd, world, device)


def test_the_step_names_communicator_calls():
    """`check_steps` names what the full record cannot: the executes on the
    communicator counted across fusions."""
    steps = [agreement.Step(0, 2, 5, 9, 77), agreement.Step(1, 2, 5, 10, 77)]
    assert not agreement.in_step(steps)
    with pytest.raises(RankMismatchError, match="rank 0 at its multi-device execute 9, rank 1 at its multi-device execute 10"):
        agreement.check_steps(steps)
    assert agreement.in_step([agreement.Step(0, 2, 5, 9, 77), agreement.Step(1, 2, 5, 9, 77)])
    assert not agreement.in_step([agreement.Step(0, 2, 5, 9, 0), agreement.Step(1, 2, 5, 9, 0)])
