"""hostir: a Host-IR runtime that runs tensor programs sharded across
devices and pipelined across CUDA streams, with communication overlapped
by computation.

Write a program with `FusionDefinition`, place tensors on a `DeviceMesh`,
shard axes with `ParallelType.mesh_x` and pipeline them with
`ParallelType.stream`, run it with `fd.execute` on every rank (under
mpirun or torchrun), and read the lowered host program with `fd.host_ir()`.
"""

from hostir._version import __version__
from hostir.communicator import (
    CommunicatorError,
    CommunicatorTimeout,
    LaunchError,
    PeerLostError,
    local_rank,
    rank,
    world_size,
)
from hostir.container import AliasError, HostIrContainer
from hostir.analysis.dry_run import CommunicationMismatchError, DryRunError, DryRunReport, dry_run
from hostir.dtensor import DTensorPlacementError
from hostir.errors import DefinitionError, HostIrError, UsageError
from hostir.runtime.evaluator import HostIrEvaluator, HostIrRuntimeError
from hostir.executor import ExecutorParams, InputError, InputTypeError, RankMismatchError
from hostir.frontend import FusionDefinition, shard_tensor
from hostir.ir import DeviceMesh, IterType, MemoryType, ParallelType
from hostir.lower import LoweringError
from hostir.offload import OffloadedStack, offload
from hostir.options import OptionError
from hostir.analysis.races import Race, check_races

__all__ = [
    "AliasError",
    "CommunicationMismatchError",
    "DryRunError",
    "DryRunReport",
    "Race",
    "check_races",
    "dry_run",
    "CommunicatorError",
    "CommunicatorTimeout",
    "DTensorPlacementError",
    "DefinitionError",
    "HostIrError",
    "InputError",
    "InputTypeError",
    "UsageError",
    "DeviceMesh",
    "LaunchError",
    "PeerLostError",
    "RankMismatchError",
    "local_rank",
    "rank",
    "shard_tensor",
    "world_size",
    "ExecutorParams",
    "FusionDefinition",
    "HostIrContainer",
    "HostIrEvaluator",
    "HostIrRuntimeError",
    "IterType",
    "LoweringError",
    "MemoryType",
    "OffloadedStack",
    "offload",
    "OptionError",
    "ParallelType",
    "__version__",
]
