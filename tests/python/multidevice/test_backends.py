"""Each backend carries only what it can carry: a program whose ring names
the other backend than the communicator's (NCCL on a gloo communicator's
host memory, gloo sends of a GPU's memory under NCCL) is refused before
anything is posted, on every rank, with an error that names the op and the
backend; the rank's own backend runs the same ring."""

from __future__ import annotations

import os

import pytest
import torch

import hostir
import hostir.cpp
from hostir import RankMismatchError, communicator, overlap
from hostir.runtime.transports.base import TransportUnsupported
from multidevice.test_decompositions import rand_int


def _inputs(world, device):
    D, m, K, N = world.size, 4, 6, 5
    return overlap.allgather_matmul_inputs(rand_int([D, m, K], device), rand_int([K, N], device), world.rank)


def test_a_ring_on_the_other_backend_is_refused_on_every_rank(world, device):
    fd = overlap.allgather_matmul(world.size)
    inputs, expected = _inputs(world, device)
    # The first call makes the communicator; its backend is the rank's own.
    out, = fd.execute(inputs, schedule="ring")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    own = communicator.live().backend
    other = "gloo" if own == "nccl" else "nccl"
    # The ring on the rank's own backend, named: on GPUs `ring:transport=nccl`,
    # run by the C++ executor where it is built, its result checked.
    out, = fd.execute(inputs, schedule=f"ring:transport={own}")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    if hostir.cpp.available() and os.environ.get("HOSTIR_EVALUATOR", "auto") != "python":
        assert fd.executor.last_runner.name == "cpp", fd.executor.last_runner
    # Every rank fails its own check (nothing is disagreed on): each raises
    # that check's error, of the type one rank alone would raise.
    with pytest.raises(TransportUnsupported) as err:
        fd.execute(inputs, schedule=f"ring:transport={other}")
    text = str(err.value)
    assert not isinstance(err.value, RankMismatchError)
    assert "P2PCommunication" in text
    if other == "nccl":
        assert "backend=NCCL" in text and "NCCL carries device memory only" in text
    else:
        assert "backend=gloo" in text and "gloo sends and receives only host memory" in text
    # Nothing was posted: the ranks are still in step, and the own backend runs.
    out, = fd.execute(inputs, schedule="ring")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
