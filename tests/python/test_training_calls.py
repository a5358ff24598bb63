"""The steady-state path of training calls: a training call whose signature
already ran takes the first call's record (`hostir.autograd._Record`) and
runs its forward and backward programs from their executors' prepared
records; a C++ program with no preallocated outputs binds and converts back
inside the executor (`CppEvaluator.run_logical`). Whatever the record holds
must still be checked where it can change: the fusion, `keep_gathered`,
the environment that picks the evaluator, the inputs' signature. Results
against eager torch on new random data at every call."""

from __future__ import annotations

import pytest
import torch

from hostir import FusionDefinition, autograd, cpp, executor
from hostir.runtime import prepared
from one_rank_linears import MESH, one_rank_linear

needs_cpp = pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}")



def _mlp() -> FusionDefinition:
    """gelu(x @ w1.T + b1) @ w2.T."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w1 = fd.define_tensor([-1, -1])
        b1 = fd.define_tensor([-1])
        w2 = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1)), w2))
    return fd


def _eager(x, w1, b1, w2):
    return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2)


def _leaves(*shapes):
    return [torch.randn(*s, requires_grad=True) for s in shapes]


def _step_matches_eager(fd, shapes, **kwargs):
    """One training call of `fd` on new random leaves against eager torch:
    output and every gradient."""
    ours = _leaves(*shapes)
    refs = [t.detach().clone().requires_grad_() for t in ours]
    (y,) = fd.execute(ours, **kwargs)
    expected = _eager(*refs)
    torch.testing.assert_close(y, expected)
    g = torch.randn_like(expected)
    y.backward(g)
    expected.backward(g)
    for a, b in zip(ours, refs):
        torch.testing.assert_close(a.grad, b.grad)


class _Counting:
    """Counts calls of named functions (patched by monkeypatch)."""

    def __init__(self, monkeypatch, targets):
        self.counts = {name: 0 for _, name in targets}
        for owner, name in targets:
            original = getattr(owner, name)

            def wrapped(*args, _original=original, _name=name, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(owner, name, wrapped)


SHAPES = [(6, 8), (12, 8), (12,), (5, 12)]


def test_repeated_training_calls_run_from_one_record(monkeypatch):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = _mlp()
    _step_matches_eager(fd, SHAPES)
    assert len(fd._training_calls) == 1
    counting = _Counting(
        monkeypatch,
        [(autograd, "training_of"), (executor.ExecutorParams, "from_arguments"), (executor.FusionExecutor, "_normalize")],
    )
    for _ in range(3):
        _step_matches_eager(fd, SHAPES)
    # Nothing decided again: no derivation looked up, no parameters made,
    # neither program's executor through its full path.
    assert counting.counts == {"training_of": 0, "from_arguments": 0, "_normalize": 0}
    assert len(fd._training_calls) == 1


def test_another_signature_takes_the_full_path_and_keeps_its_own_record():
    fd = _mlp()
    _step_matches_eager(fd, SHAPES)
    _step_matches_eager(fd, [(3, 8), *SHAPES[1:]])
    _step_matches_eager(fd, SHAPES, number_of_streams=2)
    assert len(fd._training_calls) == 3
    # An input that does not require grad: another derivation, another record.
    x, w1, b1, w2 = _leaves(*SHAPES)
    refs = [t.detach().clone().requires_grad_() for t in (w1, b1, w2)]
    (y,) = fd.execute([x.detach(), w1, b1, w2])
    y.sum().backward()
    _eager(x.detach(), *refs).sum().backward()
    for a, b in zip((w1, b1, w2), refs):
        torch.testing.assert_close(a.grad, b.grad)
    assert len(fd._training_calls) == 4


def test_a_bad_input_after_a_record_gets_the_full_paths_error():
    fd = _mlp()
    _step_matches_eager(fd, SHAPES)
    x, w1, b1, w2 = _leaves(*SHAPES)
    with pytest.raises(Exception, match="Wrong number of inputs"):
        fd.execute([x, w1, b1])
    with pytest.raises(Exception) as info:
        fd.execute([x, torch.randn(12, 9, requires_grad=True), b1, w2])
    assert "9" in str(info.value)


def test_a_changed_fusion_or_keep_gathered_derives_again(plain_process, monkeypatch):
    # On the CPU whatever the machine has: the fusion becomes a one-rank
    # multi-device one below, with the same call signature.
    on_cpu = {"device": "cpu", "backend": "gloo"}
    fd = _mlp()
    _step_matches_eager(fd, SHAPES, **on_cpu)
    counting = _Counting(monkeypatch, [(autograd, "derive")])
    fd.keep_gathered = True
    _step_matches_eager(fd, SHAPES, **on_cpu)
    assert counting.counts["derive"] == 1
    fd.keep_gathered = False
    _step_matches_eager(fd, SHAPES, **on_cpu)
    # The version of the derivation for keep_gathered=False is still kept.
    assert counting.counts["derive"] == 1
    # A fusion changed since (its version moves) is derived again.
    fd.fusion.inputs[0].set_device_mesh(MESH)
    _step_matches_eager(fd, SHAPES, **on_cpu)
    assert counting.counts["derive"] == 2


@needs_cpp
def test_the_evaluator_picked_by_the_environment_is_checked_on_every_call(monkeypatch):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = _mlp()
    _step_matches_eager(fd, SHAPES)
    (record,) = fd._training_calls.values()
    assert record.training.forward.last_runner.name == "cpp"
    assert record.training.backward.last_runner.name == "cpp"
    monkeypatch.setenv("HOSTIR_EVALUATOR", "python")
    _step_matches_eager(fd, SHAPES)
    assert record.training.forward.last_runner.name == "python"
    assert record.training.backward.last_runner.name == "python"
    monkeypatch.delenv("HOSTIR_EVALUATOR")
    _step_matches_eager(fd, SHAPES)
    assert record.training.forward.last_runner.name == "cpp"


@needs_cpp
def test_the_cpp_executor_binds_and_converts_back_a_prepared_call(plain_process, monkeypatch):
    monkeypatch.delenv("HOSTIR_EVALUATOR", raising=False)
    fd = one_rank_linear("K")
    seen = []
    bind = executor.FusionExecutor._bind
    monkeypatch.setattr(executor.FusionExecutor, "_bind", lambda self, call: seen.append(bind(self, call)) or seen[-1])
    for _ in range(3):
        x, w = torch.randn(6, 8), torch.randn(5, 8)
        (y,) = fd.execute([x, w], backend="gloo")
        torch.testing.assert_close(y, x @ w.T)
        assert y.shape == (6, 5)
    assert seen[-1] is executor._LOGICAL
    # The same on the Python evaluator, which binds through `Binding`.
    monkeypatch.setenv("HOSTIR_EVALUATOR", "python")
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    (expected,) = fd.execute([x, w], backend="gloo")
    assert seen[-1] is not executor._LOGICAL
    monkeypatch.delenv("HOSTIR_EVALUATOR")
    (y,) = fd.execute([x, w], backend="gloo")
    torch.testing.assert_close(y, expected)
    # Preallocated outputs are viewed by `Binding` and written in place.
    out = torch.empty(6, 5)
    (written,) = fd.execute([x, w], [out], backend="gloo")
    assert written is out and seen[-1] is not executor._LOGICAL
    torch.testing.assert_close(out, x @ w.T)


@needs_cpp
@pytest.mark.parametrize("sharded", ["K", "N"], ids=["rowwise", "colwise"])
def test_views_are_the_bindings_conversions(plain_process, sharded):
    """`Binding.views` says in numbers what `Binding.inputs` and `unbind`
    do, and the C++ executor's run on logical tensors returns what the
    Binding's conversions around its run return."""
    fd = one_rank_linear(sharded)
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    fd.execute([x, w], backend="gloo")
    (program,) = fd.executor._programs.values()
    binding = program.binding
    inputs, outputs = binding.views()
    for tv, t, plan in zip(binding.input_tvs, (x, w), inputs):
        runtime = binding.inputs([x, w])[binding.input_tvs.index(tv)]
        expected = [1 if axis < 0 else t.shape[axis] for axis in plan] if plan else list(t.shape)
        assert list(runtime.shape) == expected
    # Both fusions have a tensor whose runtime axes differ.
    assert any(inputs) or any(outputs)
    (result,) = program.evaluator.run_tensors(binding.inputs([x, w]), [], 1)
    (logical,) = binding.unbind([result])
    (held,) = outputs
    if held:
        assert list(logical.shape) == [int(torch.tensor([result.shape[d] for d in dims]).prod()) for dims in held]
    else:
        assert logical.shape == result.shape
    (direct,) = program.evaluator.run_logical([x, w], 1)
    assert direct.shape == logical.shape == (6, 5)
    torch.testing.assert_close(direct, logical)
    torch.testing.assert_close(direct, x @ w.T)


def test_dtensor_gradients_keep_their_placements_call_after_call(plain_process):
    from torch.distributed.tensor import DTensor, Shard

    mesh = MESH.to_torch("cpu")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.linear(x, w))
    W = torch.randn(5, 4)
    wd = DTensor.from_local(W.clone(), mesh, [Shard(0)]).requires_grad_()
    specs = []
    for _ in range(3):
        X = torch.randn(3, 4, requires_grad=True)
        wd.grad = None
        (y,) = fd.execute([X, wd], return_dtensors=False)
        G = torch.randn(3, 5)
        y.backward(G)
        assert isinstance(wd.grad, DTensor) and wd.grad.placements == (Shard(0),)
        assert wd.grad._spec is not wd._spec
        torch.testing.assert_close(wd.grad.full_tensor(), G.T @ X.detach())
        torch.testing.assert_close(X.grad, G @ W)
        specs.append(wd.grad._spec)
    assert len(fd._training_calls) == 1
    # Another placement of the same shapes is another signature.
    wr = DTensor.from_local(W.clone(), mesh, [Shard(1)]).requires_grad_()
    with pytest.raises(Exception, match="placement"):
        fd.execute([torch.randn(3, 4, requires_grad=True), wr], return_dtensors=False)


def test_environment_is_none_where_a_call_takes_the_full_path(monkeypatch):
    monkeypatch.delenv("HOSTIR_FAKE", raising=False)
    assert prepared.environment() is not None
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    assert prepared.environment() is None
    monkeypatch.setenv("HOSTIR_FAKE", "auto")
    monkeypatch.setenv("HOSTIR_TRACE", "/tmp/trace")
    assert prepared.environment() is None
