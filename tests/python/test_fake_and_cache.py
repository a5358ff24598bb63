"""HOSTIR_FAKE (fake results, dry runs before real ones) and shape-aware
cache keys (`mark_static`, `fd.num_programs`), with a property test over
random call sequences of varying shapes."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType
from hostir.options import fake_mode


def _matmul_fd(stream: bool = True):
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        c = fd.ops.matmul(fd.ops.mul(a, 0.5), b)
        fd.add_output(c)
    if stream:
        c.axis(0).parallelize(ParallelType.stream)
    return fd, a, b


# ---------------------------------------------------------------- HOSTIR_FAKE


def test_fake_mode_values(monkeypatch):
    assert fake_mode({}) == "auto"
    for v in ("auto", "1", "0"):
        assert fake_mode({"HOSTIR_FAKE": v}) == v
    with pytest.warns(RuntimeWarning, match="HOSTIR_FAKE='yes' is not one of auto, 1, 0; using auto"):
        assert fake_mode({"HOSTIR_FAKE": "yes"}) == "auto"


def test_fake_1_returns_meta_results_without_running(monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    fd, _, _ = _matmul_fd()
    runs = []
    run = hostir.HostIrEvaluator.run

    def spy(self, bindings, **kwargs):
        runs.append({t.device.type for t in bindings.values()})
        return run(self, bindings, **kwargs)

    monkeypatch.setattr("hostir.runtime.evaluator.HostIrEvaluator.run", spy)
    (out,) = fd.execute([torch.randn(6, 4), torch.randn(4, 7)])
    assert out.device.type == "meta" and out.shape == (6, 7) and out.dtype == torch.float32
    (out,) = fd.execute([torch.empty(3, 4, device="meta"), torch.empty(4, 2, device="meta")])
    assert out.shape == (3, 2)
    # Only the dry run's own evaluator ran, on meta tensors.
    assert runs == [{"meta"}, {"meta"}]


def test_fake_1_plans_a_multi_device_program_without_a_launcher(monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "1")
    d = 8
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, d, -1, 64])
        w = fd.define_tensor(shape=[64, -1])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    (out,) = fd.execute([torch.empty(4, 1, 8, 64, device="meta"), torch.empty(64, 32, device="meta")])
    assert out.device.type == "meta" and out.shape == (4, d, 8, 32)
    assert hostir.communicator.live() is None  # no process group was made


def test_auto_runs_a_single_device_program_without_a_dry_run(monkeypatch):
    """A single-device program has no cross-rank error for a dry run to
    catch, and its real run raises what the dry run would: `auto` skips it
    (tests/python/multidevice/test_first_call.py checks that multi-device
    programs are dry-run once per shape)."""
    fd, _, _ = _matmul_fd()
    a, b = torch.randn(6, 4), torch.randn(4, 7)
    monkeypatch.setenv("HOSTIR_FAKE", "auto")

    def planted(*args, **kwargs):
        raise AssertionError("a single-device call was dry-run")

    monkeypatch.setattr("hostir.analysis.dry_run.run_rank", planted)
    (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, (a * 0.5) @ b)
    fd.execute([torch.randn(5, 4), b])
    assert fd.executor.dry_runs == 0
    with pytest.raises(hostir.InputError):
        fd.execute([torch.randn(5, 3), b])


def test_bad_fake_value_runs_as_auto(monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "maybe")
    fd, _, _ = _matmul_fd()
    a, b = torch.randn(6, 4), torch.randn(4, 7)
    with pytest.warns(RuntimeWarning, match="HOSTIR_FAKE='maybe'"):
        (out,) = fd.execute([a, b])
    torch.testing.assert_close(out, (a * 0.5) @ b)
    assert fd.executor.dry_runs == 0  # auto: none for one device


# ---------------------------------------------------------------- cache keys


def test_programs_are_dynamic_by_default():
    fd, _, _ = _matmul_fd()
    for m in (2, 3, 5):
        fd.execute([torch.randn(m, 4), torch.randn(4, m + 1)])
    assert fd.num_programs == 1 and fd.executor.lowerings == 1


def test_mark_static_puts_those_sizes_in_the_key():
    fd, a, b = _matmul_fd()
    a.mark_static([0])
    for m, n in ((2, 3), (2, 5), (3, 3), (2, 7)):
        fd.execute([torch.randn(m, 4), torch.randn(4, n)])
    assert fd.num_programs == 2  # a's axis 0 was 2 or 3; b's sizes are dynamic
    b.mark_static()
    assert fd.num_programs == 0  # a new schedule: the cache starts over
    fd.execute([torch.randn(2, 4), torch.randn(4, 3)])
    fd.execute([torch.randn(2, 4), torch.randn(4, 5)])
    assert fd.num_programs == 2


def test_mark_static_rejects_non_inputs_and_bad_axes():
    fd, a, _ = _matmul_fd()
    out = fd.fusion.outputs[0]
    with pytest.raises(ValueError, match="is not a fusion input"):
        out.mark_static()
    with pytest.raises(IndexError, match="axis 2 is out of range"):
        a.mark_static([2])


_SHAPES = st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 5))


@settings(max_examples=25, deadline=None)
@given(
    static=st.tuples(st.sets(st.integers(0, 1)), st.sets(st.integers(0, 1))),
    calls=st.lists(_SHAPES, min_size=1, max_size=8),
    streams=st.integers(1, 3),
)
def test_cached_artifacts_serve_exactly_the_sizes_they_were_made_for(static, calls, streams):
    fd, a, b = _matmul_fd()
    for tv, dims in zip((a, b), static):
        if dims:
            tv.mark_static(sorted(dims))
    keys_seen = set()
    for m, k, n in calls:
        x, w = torch.randn(m, k), torch.randn(k, n)
        (out,) = fd.execute([x, w], number_of_streams=streams)
        torch.testing.assert_close(out, (x * 0.5) @ w)
        sizes = {(0, d): x.shape[d] for d in static[0]} | {(1, d): w.shape[d] for d in static[1]}
        keys_seen.add(tuple(sorted(sizes.items())))
        # One program per set of static sizes; only those re-lower.
        assert fd.num_programs == len(keys_seen)
        assert fd.executor.lowerings == len(keys_seen)
    # Every set of static sizes seen keeps its program: calling with each
    # again (K changed where it is dynamic) lowers nothing.
    lowered = fd.executor.lowerings
    k_static = 1 in static[0] or 0 in static[1]
    for m, k, n in calls:
        k = k if k_static else k + 1
        x, w = torch.randn(m, k), torch.randn(k, n)
        (out,) = fd.execute([x, w], number_of_streams=streams)
        torch.testing.assert_close(out, (x * 0.5) @ w)
    assert fd.executor.lowerings == lowered
