"""The kinds of the elementwise and reduction ops, each declared once with
every fact the package needs about it: its name in the dump, the torch
function that computes it, and for a reduction the `torch.distributed` op
and the identity a reduction over no values starts from.

Each kind is a `StrEnum`: it compares and hashes as its name ("relu",
"sum"), so an op made with a plain string and one made with the kind are
alike, and the dump prints the name. A new unary op is one line here and
its builder in the frontend; the evaluator, the printer and the checks read
the facts from here.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["BinaryKind", "ReductionKind", "UnaryKind"]


class UnaryKind(enum.StrEnum):
    """`out = <kind>(input)`. `torch_fn` computes it (None for `cast`,
    which converts to the output's dtype); `floating`: defined for
    floating-point inputs only."""

    torch_fn: Callable | None
    floating: bool

    def __new__(cls, name: str, torch_fn: Callable | None, floating: bool = False):
        member = str.__new__(cls, name)
        member._value_ = name
        member.torch_fn = torch_fn
        member.floating = floating
        return member

    relu = "relu", torch.relu
    neg = "neg", torch.neg
    abs = "abs", torch.abs
    cast = "cast", None
    gelu = "gelu", torch.nn.functional.gelu, True  # the exact (erf) form
    silu = "silu", torch.nn.functional.silu, True
    exp = "exp", torch.exp, True
    tanh = "tanh", torch.tanh, True
    sigmoid = "sigmoid", torch.sigmoid, True


class BinaryKind(enum.StrEnum):
    """`out = lhs <symbol> rhs`, computed by `torch_fn` (with torch's
    broadcasting and type promotion)."""

    symbol: str
    torch_fn: Callable

    def __new__(cls, name: str, symbol: str, torch_fn: Callable):
        member = str.__new__(cls, name)
        member._value_ = name
        member.symbol = symbol
        member.torch_fn = torch_fn
        return member

    add = "add", "+", torch.add
    sub = "sub", "-", torch.sub
    mul = "mul", "*", torch.mul
    div = "div", "/", torch.div


def _sum(src, dims, dtype=None, **out):
    return torch.sum(src, dims, dtype=dtype, **out)


def _amax(src, dims, dtype=None, **out):
    return torch.amax(src, dims, **out)


def _amin(src, dims, dtype=None, **out):
    return torch.amin(src, dims, **out)


class ReductionKind(enum.StrEnum):
    """A reduction over axes, or across ranks (a communication's `red_op`).
    `dump_name`: the op the dump prints; `initial`: the dump's initial value;
    `torch_fn(src, dims, dtype=None, **out)` computes it over `dims`;
    `dist_op`: the `torch.distributed.ReduceOp` across ranks."""

    dump_name: str
    initial: str
    torch_fn: Callable
    dist_op: object
    ignores_nan: bool

    def __new__(cls, name: str, dump_name: str, initial: str, torch_fn: Callable, dist_name: str, ignores_nan: bool):
        member = str.__new__(cls, name)
        member._value_ = name
        member.dump_name = dump_name
        member.initial = initial
        member.torch_fn = torch_fn
        member.dist_op = getattr(dist.ReduceOp, dist_name) if dist.is_available() else None
        member.ignores_nan = ignores_nan
        return member

    # ignores_nan: torch.distributed's max and min compare, and a NaN loses;
    # a transport carries NaN flags beside the data for them.
    sum = "sum", "add", "0", _sum, "SUM", False
    max = "max", "max", "-inf", _amax, "MAX", True
    min = "min", "min", "inf", _amin, "MIN", True

    def identity(self, dtype: torch.dtype) -> float | int:
        """The value a reduction over no values starts from in `dtype`
        (exact: an int for an integer dtype)."""
        if self is ReductionKind.sum:
            return 0.0 if dtype.is_floating_point else 0
        if dtype.is_floating_point:
            return float("-inf") if self is ReductionKind.max else float("inf")
        if dtype == torch.bool:
            # A bool max is a logical or, a min a logical and.
            return 0 if self is ReductionKind.max else 1
        info = torch.iinfo(dtype)
        return info.min if self is ReductionKind.max else info.max


