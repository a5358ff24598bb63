"""The root of every error hostir raises.

Each hostir error class derives from `HostIrError` and, where a built-in
exception describes the failure (a bad value, a failed run), from that too,
so `except hostir.HostIrError` catches everything hostir raises and
`except ValueError` keeps working for bad input.
"""


class HostIrError(Exception):
    """Base class of every error hostir raises."""
