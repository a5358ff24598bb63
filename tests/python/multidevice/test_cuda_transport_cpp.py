"""The copy-engine (`cuda`) transport in the C++ executor against the Python
evaluator: every ring decomposition of AG+matmul and matmul+reduce-scatter
(both directions, 1 and 2 chunks per peer) with transport=cuda, run by each
runner over several consecutive calls (both call parities of the
double-buffered windows, new random data each call), eager and captured in
CUDA graphs (one per parity, `hostir.runtime.graphs.capture`) then
replayed, each result compared with eager torch. GPU only (`cuda`): on 2
GPUs under the multi-device suite, and with two ranks sharing one GPU
(CUDA_VISIBLE_DEVICES=0; the ranks then use gloo for the control group and
CUDA IPC windows). Every failure names the runner, the decomposition, the
call and the rank."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import cpp, overlap
from hostir.runtime import graphs

pytestmark = [
    # Deselected without a GPU (the multi-device conftest); on one it needs
    # CUDA-visible ranks and the C++ executor.
    pytest.mark.cuda,
    pytest.mark.skipif(hostir.world_size() < 2, reason="a ring needs two ranks or more"),
    pytest.mark.skipif(not cpp.available(), reason=f"the C++ executor is not built: {cpp.reason()}"),
]

DECOMPOSITIONS = [
    "ring:transport=cuda",
    "ring:direction=-1,transport=cuda",
    "ring:chunks=2,transport=cuda",
    "ring:chunks=2,direction=-1,transport=cuda",
]
RUNNERS = ["cpp", "python"]
CALLS = 4  # two of each call parity
TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32 GEMMs summed in another order than eager


@pytest.fixture
def gpu(world) -> torch.device:
    """This rank's GPU: its own where there are enough, else shared."""
    device = torch.device("cuda", world.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _params(world, sched: str, runner: str) -> dict:
    params = {"schedule": sched, "evaluator": runner, "number_of_streams": 2}
    if torch.cuda.device_count() < world.size:
        # NCCL refuses two ranks on one GPU; gloo carries the control group.
        params["backend"] = "gloo"
    return params


def _ag_case(world, gpu):
    D, m, K, N = world.size, 8, 16, 12
    fd = overlap.allgather_matmul(D)

    def data():
        inputs, expected = overlap.allgather_matmul_inputs(
            torch.randn(D, m, K, device=gpu), torch.randn(K, N, device=gpu), world.rank
        )
        return inputs, expected

    return fd, data


def _rs_case(world, gpu):
    D, m, k, N = world.size, 8, 6, 12
    fd = overlap.matmul_reduce_scatter(D)

    def data():
        A, B = torch.randn(D * m, D * k, device=gpu), torch.randn(D * k, N, device=gpu)
        inputs, expected = overlap.matmul_reduce_scatter_inputs(A, B, D, world.rank)
        return inputs, expected

    return fd, data


CASES = {"allgather_matmul": _ag_case, "matmul_reduce_scatter": _rs_case}


def _check(got, expected, what: str) -> None:
    got = got.reshape(expected.shape)
    try:
        torch.testing.assert_close(got, expected, **TOL)
    except AssertionError as err:
        bad = (got - expected).abs() > TOL["atol"] + TOL["rtol"] * expected.abs()
        rows = sorted({int(i) for i in bad.nonzero()[:, -2].tolist()}) if bad.dim() >= 2 else []
        raise AssertionError(f"{what}: wrong result (rows {rows[:16]} differ)\n{err}") from None


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("sched", DECOMPOSITIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_consecutive_calls_match_eager(world, gpu, case, sched, runner):
    fd, data = CASES[case](world, gpu)
    params = _params(world, sched, runner)
    for call in range(CALLS):
        inputs, expected = data()
        (out,) = fd.execute(inputs, **params)
        torch.cuda.synchronize(gpu)
        what = f"rank {world.rank}, {case}, {sched}, runner {runner}, call {call} (parity {call % 2})"
        assert fd.last_runner.name == runner, f"{what}: ran on {fd.last_runner}"
        _check(out, expected, what)


@pytest.mark.parametrize("sched", DECOMPOSITIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_back_to_back_without_a_host_sync(world, gpu, case, sched):
    """Calls enqueued back to back: a push of call n+2 into a window of
    call n must wait on the GPU for the peer's reads, never on the host."""
    fd, data = CASES[case](world, gpu)
    params = _params(world, sched, "cpp")
    made = [data() for _ in range(6)]
    outs = [fd.execute(inputs, **params)[0] for inputs, _ in made]
    torch.cuda.synchronize(gpu)
    for call, (out, (_, expected)) in enumerate(zip(outs, made)):
        _check(out, expected, f"rank {world.rank}, {case}, {sched}, C++ runner, call {call} of 6 back to back")


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("sched", DECOMPOSITIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_replays_match_eager(world, gpu, case, sched, runner):
    fd, data = CASES[case](world, gpu)
    params = _params(world, sched, runner)
    inputs, _ = data()
    replay = graphs.capture(fd, inputs, **params)
    assert fd.last_runner.name == runner, f"rank {world.rank}: captured on {fd.last_runner}"
    for k in range(CALLS):
        fresh, expected = data()
        for baked, new in zip(inputs, fresh):
            baked.copy_(new)
        (out,) = replay()
        torch.cuda.synchronize(gpu)
        _check(
            out, expected, f"rank {world.rank}, {case}, {sched}, runner {runner}, replay {k} (graph of parity {k % 2})"
        )
