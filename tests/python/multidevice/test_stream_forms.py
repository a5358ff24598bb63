"""The stream form is an option of `assign_streams` for every stream loop,
a decomposition's included: AG+matmul and matmul+reduce-scatter, lowered
with each form (the ring's own chunk on the caller beside the workers, or
every iteration waiting for the caller), compute what eager torch computes,
exactly, on integer-valued random data, with the reference evaluator and,
where it is built, the C++ executor."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import cpp, overlap
from hostir.lower import lower
from hostir.lower.schedule import parse
from hostir.runtime.bind import Binding
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.streams import streams_for

FORMS = ["pipelined", "per_iteration"]
RUNS = [(sched, "python") for sched in ("ring", "ring:direction=-1", "ring:chunks=2", "collective")]
# The C++ executor runs the rings (not the collective form, whose roots
# are chosen at run time); the reduce rings of two chunks per peer at two
# ranks add the peer's partial in the local GEMM.
CPP_RUNS = [("ring", "cpp"), ("ring:direction=-1", "cpp")]
CPP_REDUCE_RUNS = [("ring", "cpp"), ("ring:chunks=2", "cpp")]


def _run(fd, inputs, world, device, sched, form, evaluator, pipelined_loops=2, iteration_loops=1):
    if evaluator == "cpp" and not cpp.available():
        # Every rank skips alike: the build is the same on every rank.
        pytest.skip("the C++ executor is not built")
    backend = "NCCL" if device.type == "cuda" else "gloo"
    lowered = lower(fd.fusion, rank=world.rank, backend=backend, schedule=parse(sched), stream_form=form)
    program = lowered.program
    text = str(program)
    loops = text.count("FOR StreamIdx")
    assert loops == (pipelined_loops if form == "pipelined" else iteration_loops), text
    assert "on worker streams" not in text, text
    communicator = hostir.communicator.get()
    communicator.ensure_groups(lowered.teams)
    runner = cpp.CppEvaluator if evaluator == "cpp" else HostIrEvaluator
    binding = Binding.of(program)
    run = runner(program, streams=streams_for(device), device=device, communicator=communicator, rank=lowered.rank)
    results = run.run(binding.bind(inputs), number_of_streams=2)
    (out,) = binding.unbind(results)
    return out


def _rand_int(shape, device) -> torch.Tensor:
    return torch.randint(-4, 4, tuple(shape)).to(torch.float32).to(device)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sched, evaluator", RUNS + CPP_RUNS)
def test_allgather_matmul_in_each_form(world, device, sched, form, evaluator):
    D, m, K, N = world.size, 4, 6, 5
    fd = overlap.allgather_matmul(D)
    inputs, expected = overlap.allgather_matmul_inputs(_rand_int([D, m, K], device), _rand_int([K, N], device), world.rank)
    out = _run(fd, inputs, world, device, sched, form, evaluator)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sched, evaluator", RUNS + CPP_REDUCE_RUNS)
def test_matmul_reduce_scatter_in_each_form(world, device, sched, form, evaluator):
    D, m, k, N = world.size, 4, 3, 5
    fd = overlap.matmul_reduce_scatter(D)
    A, B = _rand_int([D * m, D * k], device), _rand_int([D * k, N], device)
    inputs, expected = overlap.matmul_reduce_scatter_inputs(A, B, D, world.rank)
    # A reduce ring's pipelined form ends with a loop joining its workers
    # (the local partial runs on the caller before it). With one peer and
    # chunks, that loop adds each arrived chunk in the local GEMM, after
    # its worker's: a loop in the per-iteration form too.
    loops = 3 if sched.startswith("ring") else 2
    fused = D == 2 and "chunks=2" in sched
    out = _run(fd, inputs, world, device, sched, form, evaluator, loops, 2 if fused else 1)
    text = str(lower(fd.fusion, rank=world.rank, backend="gloo", schedule=parse(sched), stream_form=form).program)
    assert ("accumulate = true" in text) == fused, text
    assert ("reduction(" in text) == (sched.startswith("ring") and not fused), text
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
