"""Prepared calls: the fast path of a repeated single-device `execute`.

Everything `FusionExecutor.execute` decides before it runs a program — the
checks of the inputs and preallocated outputs, the program for the inputs'
signature, the dry run of their shapes, the evaluator, the conversions to
runtime and logical axes — depends on the call's exact *signature* alone:
for each tensor argument its type, shape, strides, dtype, device and
requires_grad; the execution parameters (each with its type); the
environment variables that pick the evaluator, the dry run and the hoisting
(HOSTIR_EVALUATOR, HOSTIR_FAKE, HOSTIR_HOIST); and the fusion's version. Once a call has
taken the full path and run, a `Prepared` record keeps what that path
decided, under its signature; a later call with the same signature runs
from it. A call that a profiler or trace watches, or that a DEBUG log
reports, always takes the full path. A call with any other signature — a different shape, dtype,
stride, device, a scalar or non-tensor argument, a tensor subclass — takes
the full path, so every bad input gets the full path's error.

One check depends on more than the signature: that no preallocated output
shares memory with an input or another output (the addresses). A prepared
call makes it on every call, with the full path's message.

A multi-device call is prepared too, per communicator (a record holds
it): one rank has no peer to agree with; many ranks agree on the full
record (`runtime/agreement.py`) when a signature first runs, and the
record keeps the token of what they agreed on. With
`check_ranks="always"` a prepared call of many ranks still checks, before it
binds, that every rank is at the same call with the same token (a step of
a few words, one all-gather), so a rank that skipped or repeated a call, or
holds other shapes, dtypes or another program, fails on every rank as on
the full path; with "first" it checks nothing.
With `cuda_graph=True` a prepared single-device call holds the captured
graph and goes straight to its replay; one of many ranks looks its graph up
on each call.

A record holds no runner of its own: the executor runs a prepared call
through the same stages as the full path (bind, run, convert back).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from hostir.runtime import profiling
from hostir.log import logger

_MAX_PREPARED = 64

# HOSTIR_FAKE values under which the full path runs the program (the others
# return meta tensors, or warn on every call).
_RUNNING_FAKE_MODES = (None, b"auto", b"0")


def environ(name: str) -> bytes | None:
    """The raw value of environment variable `name`: `os.environ.get`
    costs a microsecond for a variable that is not set (it raises and
    catches KeyError), this a few dozen nanoseconds."""
    data = getattr(os.environ, "_data", None)
    if type(data) is dict:
        return data.get(name.encode())
    value = os.environ.get(name)
    return None if value is None else value.encode()


def signature(inputs, outputs, params, kwargs: dict) -> tuple | None:
    """The exact signature of a call, or None where the call must take the
    full path (arguments other than plain tensors in lists, a dry-run mode
    other than running, a watching profiler or trace, a debug log that
    reports every cache lookup, an unhashable parameter, a CUDA device named
    without an index)."""
    env = environment()
    if env is None:
        return None
    if type(inputs) not in (list, tuple) or (outputs is not None and type(outputs) not in (list, tuple)):
        return None
    arguments = tensor_signatures(inputs)
    if arguments is None:
        return None
    given = None
    if outputs is not None:
        given = tensor_signatures(outputs)
        if given is None:
            return None
    if params is not None:
        fields = getattr(params, "__dict__", None)
        if kwargs or fields is None:
            return None
    else:
        fields = kwargs
    # With each value's type: True == 1 and 4.0 == 4 hash alike, but the
    # full path refuses number_of_streams=True or 4.0, and cuda_graph=0.
    settings = tuple([(name, type(value), value) for name, value in fields.items()])
    device = fields.get("device")
    if device is not None and not _device_is_exact(device):
        return None
    # Hashed once, by the lookup: an unhashable parameter makes the lookup
    # find nothing and the store keep nothing.
    return (arguments, given, settings, env)


def environment() -> tuple | None:
    """The part of every call's signature that is not its arguments: the
    environment variables that pick the evaluator, the dry run and the
    hoisting; None where the call must take the full path (a dry-run mode
    other than running, a watching profiler or trace, a debug log that
    reports every cache lookup). A holder of a record checks it again
    before each call it makes from that record."""
    fake = environ("HOSTIR_FAKE")
    if fake not in _RUNNING_FAKE_MODES or logger.isEnabledFor(logging.DEBUG):
        return None
    if torch.autograd._profiler_enabled() or profiling.tracing_active() or environ("HOSTIR_TRACE"):
        return None
    return (fake, environ("HOSTIR_EVALUATOR"), environ("HOSTIR_HOIST"))


def tensor_signatures(values) -> tuple | None:
    """Each value's type, shape, strides, dtype, device and requires_grad;
    None if one is not a plain strided tensor."""
    found = []
    for t in values:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return None
        found.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
    return tuple(found)


def _device_is_exact(device) -> bool:
    """Whether `device` names one device whatever the current one is."""
    try:
        d = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        return False
    return d.type != "cuda" or d.index is not None


@dataclasses.dataclass
class Prepared:
    """What the full path's first four stages decided for one signature
    (normalize, check, program, agree): a call of that signature enters at
    bind with it, through the same stages as the full path."""

    version: int  # the fusion's version it was made for
    program: Any  # the executor's program: its container, binding, evaluator and runner
    number_of_streams: int
    # Whether an input requires grad: the run then needs the no-grad guard.
    grad: bool
    # With cuda_graph=True: the captured graph, and its own input buffers
    # as the caller passes inputs (a call that passes them copies nothing).
    graph: Any = None
    graph_inputs: list | None = None
    # A call of many ranks: the communicator, the token of the signature
    # they agreed on (0: check_ranks="first", no step is checked) and the
    # device a CUDA graph is captured on (None without cuda_graph).
    comm: Any = None
    token: int = 0
    capture: Any = None

    @property
    def runner(self):
        return self.program.runner


class PreparedCalls:
    """The prepared calls of one fusion, by signature (the newest
    `_MAX_PREPARED`)."""

    def __init__(self, lock):
        self._calls: dict[tuple, Prepared] = {}
        self._lock = lock

    def __len__(self) -> int:
        return len(self._calls)

    def get(self, key: tuple, version: int) -> Prepared | None:
        try:
            found = self._calls.get(key)
        except TypeError:  # an unhashable parameter
            return None
        if found is None or found.version != version:
            return None
        return found

    def put(self, key: tuple, prepared: Prepared) -> None:
        try:
            hash(key)
        except TypeError:
            return
        with self._lock:
            if len(self._calls) >= _MAX_PREPARED and key not in self._calls:
                self._calls.pop(next(iter(self._calls)))
            self._calls[key] = prepared

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()
