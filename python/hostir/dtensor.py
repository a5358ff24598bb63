"""DTensor in, DTensor out: `fd.execute` on `torch.distributed.tensor.DTensor`s.

A DTensor input's placements on its torch `DeviceMesh` say how the fusion
input is sharded. `Replicate()` is an unsharded input; `Shard(d)` on the
mesh's last dimension is a `mesh_x` sharding of logical axis `d` (hostir's
`mesh_x` shards along a mesh's last dimension, so on an n-D mesh the other
dimensions must be `Replicate()`). An input the user did not place
(`set_device_mesh`) takes the DTensor's mesh and sharding: axis `d` is
`outer_split` by the mesh size and its outer part is `mesh_x` (an axis whose
extent is the mesh size is made `mesh_x` as it is). An input the user placed
is checked instead, and a mismatch is a `DTensorPlacementError` naming the
input, the placement and the sharding. A `Shard(d)` whose axis does not
divide evenly is rejected with the sizes, since hostir's shards are equal.
Each rank then passes its local shard, and the outputs come back as
DTensors with the placements their (propagated) shardings imply.
`torch.distributed.tensor` is imported only when DTensors are in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hostir import ir, layout
from hostir.errors import HostIrError
from hostir.log import logger
from hostir.lower.build_host_program import build_host_program
from hostir.lower.propagate_shardings import propagate_shardings

__all__ = ["DTensorPlacementError", "has_dtensors", "is_dtensor", "is_torch_mesh"]


class DTensorPlacementError(HostIrError, ValueError):
    """A DTensor's placement cannot be, or is not, the sharding of the
    fusion input it is passed as."""


# Where DTensor is defined: bound there before any DTensor can exist, even
# while another thread is still importing the package that re-exports it.
_DTENSOR_MODULE = "torch.distributed.tensor._api"


def is_dtensor(value: object) -> bool:
    cls = ir.loaded_class(_DTENSOR_MODULE, "DTensor")
    return cls is not None and isinstance(value, cls)


def has_dtensors(values: object) -> bool:
    if not isinstance(values, (list, tuple)):
        return False
    cls = ir.loaded_class(_DTENSOR_MODULE, "DTensor")
    if cls is None:
        return False
    return any(isinstance(v, cls) for v in values)


def is_torch_mesh(value: object) -> bool:
    cls = ir.loaded_class("torch.distributed.device_mesh", "DeviceMesh")
    return cls is not None and isinstance(value, cls)


def _placement_text(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _sharding_text(tv: ir.TensorView) -> str:
    return ir.format_tv(tv)


class Adapter:
    """The DTensor side of one FusionDefinition: applies or checks input
    placements, and wraps outputs. Caches the torch meshes it made and the
    outputs' shardings per fusion version."""

    def __init__(self, fusion: ir.Fusion) -> None:
        self.fusion = fusion
        self._torch_meshes: dict[ir.DeviceMesh, Any] = {}
        self._outputs_at: int | None = None
        self._outputs: list[ir.TensorView] = []
        # Input signatures whose placements were applied or checked at a
        # fusion version, with the torch meshes they name (kept alive, so
        # their ids stay theirs).
        self._checked: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    # -- inputs
    def local_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        """The local shards of `inputs`, after applying or checking the
        placements of the DTensors among them (plain tensors pass as they are)."""
        self.place_inputs(inputs)
        return [v.to_local() if is_dtensor(v) else v for v in inputs]

    def place_inputs(self, inputs: Sequence[Any]) -> None:
        """Apply or check the placements of the DTensors among `inputs`."""
        if len(inputs) != len(self.fusion.inputs):
            # The executor reports the count with the fusion's signature.
            return
        placed = tuple(
            (i, id(v.device_mesh), tuple(v.placements), tuple(v.shape)) for i, v in enumerate(inputs) if is_dtensor(v)
        )
        if (self.fusion.version, placed) in self._checked:
            # The same meshes, placements and shapes on the same fusion:
            # the checks below would pass and change nothing.
            return
        plans = []
        for i, (tv, value) in enumerate(zip(self.fusion.inputs, inputs)):
            if is_dtensor(value):
                plans.append((i, tv, value, self._plan(i, tv, value)))
        # Every check passes before the fusion changes.
        for i, tv, value, plan in plans:
            self._torch_meshes.setdefault(ir.DeviceMesh(value.device_mesh.mesh), value.device_mesh)
            before = _sharding_text(tv)
            plan()
            after = _sharding_text(tv)
            if before != after:
                logger.info("input %d: DTensor placement %s made T%d %s", i, _placement_text(value.placements), tv.name, after)
        if len(self._checked) >= 64:
            self._checked.clear()
        self._checked[(self.fusion.version, placed)] = tuple(v.device_mesh for v in inputs if is_dtensor(v))

    def _plan(self, i: int, tv: ir.TensorView, dt: Any) -> Any:
        what = f"input {i} (T{tv.name})"
        mesh = ir.DeviceMesh(dt.device_mesh.mesh)
        placements = tuple(dt.placements)
        axis = self._sharded_axis(what, dt, mesh, placements)
        logical = tv.logical_runtime()
        if dt.dim() != len(logical):
            raise DTensorPlacementError(
                f"{what}: the fusion input has {len(logical)} dims but the DTensor has shape {list(dt.shape)}"
            )
        if tv.mesh is not None:
            self._check(what, tv, mesh, placements, axis)
            return lambda: None
        if axis is None:
            return lambda: tv.set_device_mesh(mesh)
        d = logical[axis]
        if d.leaves is not None:
            raise DTensorPlacementError(
                f"{what}: placement {_placement_text(placements)} shards axis {axis}, which the fusion "
                f"input splits ({_sharding_text(tv)}); place and shard this input yourself "
                f"(set_device_mesh, outer_split, parallelize mesh_x) to match the DTensor"
            )
        n = mesh.x_size

        def apply() -> None:
            tv.set_device_mesh(mesh)
            if d.extent.is_constant and d.extent.value == n:
                d.parallelize(ir.ParallelType.mesh_x)
                return
            at = tv.domain.index(d)
            tv.outer_split(at, n)
            tv.axis(at).parallelize(ir.ParallelType.mesh_x)

        return apply

    @staticmethod
    def _sharded_axis(what: str, dt: Any, mesh: ir.DeviceMesh, placements: tuple[Any, ...]) -> int | None:
        """The logical axis a `Shard` places on the mesh's last dimension, or
        None for a replicated DTensor; anything else is an error."""
        axis: int | None = None
        for mesh_dim, p in enumerate(placements):
            if p.is_replicate():
                continue
            if not p.is_shard():
                raise DTensorPlacementError(
                    f"{what}: placement {p!r} on mesh dimension {mesh_dim} "
                    f"{_placement_text(placements)} is not supported; redistribute the DTensor to "
                    f"Replicate() or Shard(d) first"
                )
            if mesh_dim != mesh.ndim - 1:
                raise DTensorPlacementError(
                    f"{what}: placement {_placement_text(placements)} shards along mesh dimension "
                    f"{mesh_dim} of {mesh.ndim}; hostir shards (mesh_x) along the mesh's last dimension "
                    f"only, so the other dimensions must be Replicate()"
                )
            axis = int(p.dim) % dt.dim()
        if axis is None:
            return None
        size, n = dt.shape[axis], mesh.x_size
        if size % n:
            sizes = [len(c) for c in torch.arange(size).chunk(n)]
            sizes += [0] * (n - len(sizes))
            raise DTensorPlacementError(
                f"{what}: placement {_placement_text(placements)} shards axis {axis} of size {size} "
                f"unevenly over {n} ranks (shard sizes {sizes}); hostir needs equal shards: use a size "
                f"divisible by {n}"
            )
        return axis

    @staticmethod
    def _check(
        what: str, tv: ir.TensorView, mesh: ir.DeviceMesh, placements: tuple[Any, ...], axis: int | None
    ) -> None:
        def mismatch(why: str) -> DTensorPlacementError:
            return DTensorPlacementError(
                f"{what}: the DTensor's placement {_placement_text(placements)} on {mesh!r} does not match "
                f"the input's sharding {_sharding_text(tv)}: {why}"
            )

        if tv.mesh != mesh:
            raise mismatch(f"the input lives on {tv.mesh!r}")
        if _has_mesh_y(tv):
            raise mismatch("the input is sharded along the mesh's dimension before the last (mesh_y), "
                           "which the DTensor adapter does not map yet")
        sharded = layout.sharded_axis(tv)
        if sharded is None:
            if axis is not None:
                raise mismatch(f"the DTensor shards axis {axis}, the input is replicated")
            return
        index, outer = sharded[0], sharded[1] == 0
        if axis is None:
            raise mismatch(f"the input is sharded on axis {index}, the DTensor is replicated")
        if index != axis:
            raise mismatch(f"the DTensor shards axis {axis}, the input axis {index}")
        if not outer:
            raise mismatch(
                f"axis {index} is sharded by an inner split (interleaved rows), which no DTensor "
                f"placement describes; shard the outer part of an outer_split"
            )

    # -- outputs
    def check_outputs(self) -> None:
        """Raise, before any work, if an output has no mesh to be a DTensor on."""
        for tv in self._output_tvs():
            if tv.mesh is None:
                raise DTensorPlacementError(
                    f"output T{tv.name} is on no mesh, so it cannot be a DTensor; place the fusion's "
                    f"tensors on a DeviceMesh (or pass return_dtensors=False)"
                )

    def wrap_outputs(self, results: Sequence[Any]) -> list[Any]:
        """Each local result as a DTensor on its output's mesh, placed as its
        sharding says (None stays None: this rank does not hold it)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        wrapped: list[Any] = []
        for tv, local in zip(self._output_tvs(), results):
            if local is None or is_dtensor(local):
                wrapped.append(local)
                continue
            mesh = tv.mesh
            if mesh is None:
                raise DTensorPlacementError(
                    f"output T{tv.name} is on no mesh, so it cannot be a DTensor; place the fusion's "
                    f"tensors on a DeviceMesh (or pass return_dtensors=False)"
                )
            if _has_mesh_y(tv):
                raise DTensorPlacementError(
                    f"output T{tv.name} is sharded along its mesh's dimension before the last (mesh_y), "
                    f"which the DTensor adapter does not map yet; pass return_dtensors=False"
                )
            torch_mesh = self._torch_mesh(mesh, local.device.type)
            placements: list[Any] = [Replicate()] * mesh.ndim
            sharded = layout.sharded_axis(tv)
            if sharded is not None:
                placements[-1] = Shard(sharded[0])
            wrapped.append(DTensor.from_local(local, torch_mesh, placements, run_check=False))
        return wrapped

    def _torch_mesh(self, mesh: ir.DeviceMesh, device_type: str) -> Any:
        found = self._torch_meshes.get(mesh)
        if found is None or found.device_type != device_type:
            found = self._torch_meshes[mesh] = mesh.to_torch(device_type)
        return found

    def _output_tvs(self) -> list[ir.TensorView]:
        """The fusion's outputs with the meshes and shardings that lowering
        propagates to them (computed once per fusion version)."""
        if self._outputs_at != self.fusion.version:
            self._outputs = list(propagate_shardings(build_host_program(self.fusion)).outputs)
            self._outputs_at = self.fusion.version
        return self._outputs


def _has_mesh_y(tv: ir.TensorView) -> bool:
    return any(d.parallel_type is ir.ParallelType.mesh_y for d in tv.domain)
