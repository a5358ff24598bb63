"""A multi-device fusion on a one-rank communicator: no peer to agree
with, so its repeated calls are prepared like a single device's (one
lowering, the memo of the first stages), and a new communicator lowers
and checks again."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import FusionDefinition, communicator


def _linear_on_one_rank():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], torch.float32)
        w = fd.define_tensor([-1, -1], torch.float32)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    for tv in (x, w, y):
        tv.set_device_mesh(hostir.DeviceMesh([0]))
    return fd


def test_repeated_calls_on_one_rank_are_prepared(plain_process):
    fd = _linear_on_one_rank()
    x, w = torch.randn(6, 4), torch.randn(5, 4)
    for _ in range(3):
        (y,) = fd.execute([x, w], backend="gloo")
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
    assert fd.executor._multi_device()
    assert fd.executor.lowerings == 1
    assert len(fd.executor._prepared) == 1
    # Other values of the same signature take the record; another shape is
    # a new signature, checked on the full path.
    x2 = torch.randn(6, 4)
    (y,) = fd.execute([x2, w], backend="gloo")
    torch.testing.assert_close(y, torch.nn.functional.linear(x2, w))
    (y,) = fd.execute([torch.randn(3, 4), w], backend="gloo")
    assert y.shape == (3, 5)
    assert len(fd.executor._prepared) == 2
    with pytest.raises(hostir.HostIrError):
        fd.execute([torch.randn(3, 7), w], backend="gloo")


def test_a_new_communicator_lowers_again(plain_process):
    fd = _linear_on_one_rank()
    x, w = torch.randn(6, 4), torch.randn(5, 4)
    fd.execute([x, w], backend="gloo")
    fd.execute([x, w], backend="gloo")
    communicator.shutdown()
    (y,) = fd.execute([x, w], backend="gloo")
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
    assert fd.executor.lowerings == 2
