"""DTensor adapter checks that need no process group (the multi-rank ones
are in tests/python/multidevice/test_dtensor.py)."""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, DTensorPlacementError, FusionDefinition
from hostir.errors import DefinitionTypeError


def test_dtensor_outputs_of_a_fusion_without_mesh_are_refused_before_running():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.add(x, x))
    with pytest.raises(DTensorPlacementError, match=r"output T\d+ is on no mesh, so it cannot be a DTensor"):
        fd.execute([torch.randn(2, 3)], return_dtensors=True)
    assert fd.executor.num_programs == 0, "nothing may run before the error"
    (out,) = fd.execute([torch.ones(2, 3)], return_dtensors=False)
    torch.testing.assert_close(out, torch.full((2, 3), 2.0))


def test_from_torch_takes_only_a_torch_mesh():
    with pytest.raises(DefinitionTypeError, match="DeviceMesh.from_torch takes a torch DeviceMesh, got list"):
        DeviceMesh.from_torch([0, 1])


def test_a_dtensor_module_another_thread_is_still_importing_is_no_error(monkeypatch):
    # Another thread's first import of torch.distributed.tensor leaves the
    # module in sys.modules before it binds DTensor: the checks a call makes
    # answer "not a DTensor" then, never AttributeError.
    import sys
    import types

    from hostir import dtensor, ir

    for name in ("torch.distributed.tensor._api", "torch.distributed.device_mesh"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    t = torch.randn(2)
    assert ir.loaded_class("torch.distributed.tensor._api", "DTensor") is None
    assert not dtensor.is_dtensor(t) and not dtensor.has_dtensors([t]) and not dtensor.is_torch_mesh(t)
