"""The root of every error hostir raises.

Each hostir error class derives from `HostIrError` and, where a built-in
exception describes the failure (a bad value, a failed run), from that too,
so `except hostir.HostIrError` catches everything hostir raises and
`except ValueError` keeps working for bad input.
"""


class HostIrError(Exception):
    """Base class of every error hostir raises."""


class DefinitionError(HostIrError, ValueError):
    """A fusion definition or schedule that hostir cannot take."""


class DefinitionTypeError(HostIrError, TypeError):
    """A value of the wrong type given while defining a fusion."""


class UsageError(HostIrError, RuntimeError):
    """An API call made in the wrong state (outside or after the
    definition block, twice)."""


class DefinitionIndexError(HostIrError, IndexError):
    """An axis index out of range for a tensor of the fusion."""


class ScheduleError(HostIrError, ValueError):
    """A forced schedule that is malformed or cannot run on these inputs."""
