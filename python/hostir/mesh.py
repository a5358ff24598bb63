"""Where a program runs: the parallel types an axis may take (serial,
stream, and the two mesh dimensions), and the `DeviceMesh` of ranks a
tensor lives on. A mesh converts to torch's through the process layer
(`hostir.communicator` sets `_torch_mesh` when it is imported): the IR
itself knows no processes. Part of the IR; `hostir.ir` re-exports it.
"""

from __future__ import annotations

import enum
import sys
from typing import Any

import torch

from hostir.errors import DefinitionError, DefinitionTypeError


class ParallelType(enum.Enum):
    """How the iterations of one axis are spread."""

    serial = "S"
    stream = "StreamIdx"
    mesh_x = "deviceIdx.x"
    mesh_y = "deviceIdx.y"

    @property
    def is_device(self) -> bool:
        return self in (ParallelType.mesh_x, ParallelType.mesh_y)


DEVICE_PARALLEL_TYPES = (ParallelType.mesh_x, ParallelType.mesh_y)


# Set by hostir.communicator when it is imported: the conversion of a mesh
# to torch's, which may make the process groups.
_torch_mesh: Any = None


def loaded_class(module: str, name: str) -> type | None:
    """Class `name` of `module` if the program imported that module, else
    None; never imports it. A module that another thread is still importing
    may not have bound the class yet: no instance of it can exist then, and
    None is the answer (never the half-made module's AttributeError)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _is_torch_mesh(value) -> bool:
    # Only a program that imported torch's device_mesh can hold one.
    cls = loaded_class("torch.distributed.device_mesh", "DeviceMesh")
    return cls is not None and isinstance(value, cls)


class DeviceMesh:
    """The ranks a tensor lives on. A 1-D mesh is a list of ranks; an n-D
    mesh (a nested list or an n-D tensor) is accepted too, and `mesh_x` then
    shards along its last dimension (each row of that dimension is one
    team), `mesh_y` along the one before it (each column is one team).
    A mesh is a value: two meshes with the same shape and ranks are equal.
    A torch `DeviceMesh` is accepted wherever a mesh is, with its shape and
    ranks (`DeviceMesh.from_torch`, `to_torch` convert explicitly)."""

    __slots__ = ("shape", "devices")

    def __init__(self, devices: object) -> None:
        if isinstance(devices, DeviceMesh):
            self.shape, self.devices = devices.shape, devices.devices
            return
        if _is_torch_mesh(devices):
            devices = devices.mesh
        if isinstance(devices, range):
            devices = list(devices)
        if isinstance(devices, (list, tuple)) and not devices:
            raise DefinitionError("a DeviceMesh needs at least one rank")
        try:
            t = torch.as_tensor(devices)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DefinitionTypeError(f"DeviceMesh takes a list, range or tensor of ranks, got {devices!r}") from e
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype is torch.bool:
            raise DefinitionTypeError(f"DeviceMesh ranks must be integers, got {t.dtype}")
        if t.numel() == 0:
            raise DefinitionError("a DeviceMesh needs at least one rank")
        if t.dim() == 0:
            t = t.reshape(1)
        flat = [int(r) for r in t.flatten().tolist()]
        bad = [r for r in flat if r < 0]
        if bad:
            raise DefinitionError(f"DeviceMesh ranks must be >= 0, got {bad}")
        dup = sorted({r for r in flat if flat.count(r) > 1})
        if dup:
            raise DefinitionError(f"DeviceMesh ranks must be unique; {dup} appear more than once")
        self.shape = tuple(t.shape)
        self.devices = tuple(flat)

    @classmethod
    def from_torch(cls, mesh: object) -> DeviceMesh:
        """The hostir mesh of a `torch.distributed.device_mesh.DeviceMesh`:
        the same shape and ranks."""
        if not _is_torch_mesh(mesh):
            raise DefinitionTypeError(f"DeviceMesh.from_torch takes a torch DeviceMesh, got {type(mesh).__name__}")
        return cls(mesh.mesh)

    def to_torch(self, device_type: str | None = None) -> Any:
        """A `torch.distributed.device_mesh.DeviceMesh` of the same shape
        and ranks, on `device_type` ("cuda" where CUDA is available, else
        "cpu"). Every rank calls it (torch may create process groups);
        torch.distributed is initialized first if it is not yet (by the
        process layer, `hostir.communicator`, which gives the IR this
        conversion: the IR itself knows no processes)."""
        if _torch_mesh is None:
            raise DefinitionError("DeviceMesh.to_torch needs hostir.communicator: import hostir")
        return _torch_mesh(self.devices, self.shape, device_type)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def x_size(self) -> int:
        """How many ways `mesh_x` shards: the size of the last dimension."""
        return self.shape[-1]

    def __contains__(self, rank: int) -> bool:
        return rank in self.devices

    def teams(self) -> list[tuple[int, ...]]:
        """The rows along the last dimension: the teams of a `mesh_x` axis."""
        n = self.x_size
        return [self.devices[i : i + n] for i in range(0, self.size, n)]

    def team_of(self, rank: int) -> tuple[int, ...]:
        for team in self.teams():
            if rank in team:
                return team
        raise DefinitionError(f"rank {rank} is not in {self}")

    def _dim(self, parallel_type: ParallelType) -> int:
        if parallel_type is ParallelType.mesh_x:
            return self.ndim - 1
        if parallel_type is ParallelType.mesh_y:
            if self.ndim < 2:
                raise DefinitionError(f"{self!r} is 1-D: mesh_y needs a mesh of at least 2 dimensions")
            return self.ndim - 2
        raise DefinitionError(f"{parallel_type} does not shard across a mesh")

    def size_along(self, parallel_type: ParallelType) -> int:
        """How many ways `parallel_type` (mesh_x or mesh_y) shards."""
        return self.shape[self._dim(parallel_type)]

    def teams_along(self, parallel_type: ParallelType) -> list[tuple[int, ...]]:
        """The teams of a `parallel_type` axis: the slices of the mesh along
        its dimension (rows for mesh_x, columns for mesh_y)."""
        dim = self._dim(parallel_type)
        grid = torch.tensor(self.devices).reshape(self.shape).movedim(dim, -1)
        return [tuple(row) for row in grid.reshape(-1, self.shape[dim]).tolist()]

    def index_along(self, rank: int, parallel_type: ParallelType) -> int:
        """Which shard of a `parallel_type` axis `rank` holds."""
        for team in self.teams_along(parallel_type):
            if rank in team:
                return team.index(rank)
        raise DefinitionError(f"rank {rank} is not in {self}")

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and (self.shape, self.devices) == (other.shape, other.devices)

    def __hash__(self) -> int:
        return hash((self.shape, self.devices))

    def __repr__(self) -> str:
        if self.ndim == 1:
            return "DeviceMesh{" + " ".join(map(str, self.devices)) + "}"
        rows = " ".join("{" + " ".join(map(str, row)) + "}" for row in self.teams())
        return "DeviceMesh{" + rows + "}"
