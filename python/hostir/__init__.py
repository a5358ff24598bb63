"""hostir: a Host-IR runtime that runs tensor programs with their work
pipelined across CUDA streams (and, later, sharded across devices).

Write a program with `FusionDefinition`, mark stream-parallel axes with
`tv.axis(i).parallelize(ParallelType.stream)`, run it with `fd.execute`, and
read the lowered host program with `fd.host_ir()`.
"""

from hostir.container import AliasError, HostIrContainer
from hostir.evaluator import HostIrEvaluator, HostIrRuntimeError
from hostir.executor import ExecutorParams
from hostir.frontend import FusionDefinition
from hostir.ir import IterType, MemoryType, ParallelType
from hostir.lower import LoweringError
from hostir.options import OptionError

__all__ = [
    "AliasError",
    "ExecutorParams",
    "FusionDefinition",
    "HostIrContainer",
    "HostIrEvaluator",
    "HostIrRuntimeError",
    "IterType",
    "LoweringError",
    "MemoryType",
    "OptionError",
    "ParallelType",
]
__version__ = "0.1.0"
