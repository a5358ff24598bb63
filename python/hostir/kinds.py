"""The kinds of the elementwise and reduction ops, each declared once with
every fact the package needs about it: its name in the dump, the torch
function that computes it, and for a reduction the `torch.distributed` op
and the identity a reduction over no values starts from.

Each kind is a `StrEnum`: it compares and hashes as its name ("relu",
"sum"), so an op made with a plain string and one made with the kind are
alike, and the dump prints the name. A new unary op that trains is one
line here (its torch function and its gradient, `UnaryGrad`), and, to run
in C++, its ATen call in `csrc/host_ir/compute.cpp` with its `OpKind` in
`csrc/host_ir/program.h`; `fd.ops`, the evaluator, the printer, the
checks and the backward read the facts from here
(`docs/architecture.md`, "What a new op, collective or transport costs").
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["BinaryKind", "ReductionKind", "UnaryGrad", "UnaryKind"]


@dataclasses.dataclass(frozen=True)
class UnaryGrad:
    """How the backward of a unary op makes its input's cotangent from its
    output's, `g`: `binary(kind, g, saved)`, where `saved` is the op's
    forward `input` or `out` (`reads`), kept for the backward; or, where
    `reads` is None, `unary(kind, g)` (a cast: back to the input's dtype).
    `kind` names a `BinaryKind` (torch's backward kernels are declared
    there) or, without `reads`, a `UnaryKind`."""

    kind: str
    reads: str | None = None


class UnaryKind(enum.StrEnum):
    """`out = <kind>(input)`. `torch_fn` computes it (None for `cast`,
    which converts to the output's dtype); `floating`: defined for
    floating-point inputs only; `grad`: its backward (`UnaryGrad`);
    `in_ops`: `fd.ops` has a method of its name taking one tensor (false
    for a variant reached through another method's parameter)."""

    torch_fn: Callable | None
    floating: bool
    grad: UnaryGrad | None
    in_ops: bool

    def __new__(
        cls,
        name: str,
        torch_fn: Callable | None,
        floating: bool = False,
        grad: UnaryGrad | None = None,
        in_ops: bool = True,
    ):
        member = str.__new__(cls, name)
        member._value_ = name
        member.torch_fn = torch_fn
        member.floating = floating
        member.grad = grad
        member.in_ops = in_ops
        return member

    relu = "relu", torch.relu, False, UnaryGrad("relu_grad", "out")
    neg = "neg", torch.neg, False, UnaryGrad("neg")
    abs = "abs", torch.abs, False, UnaryGrad("abs_grad", "input")
    cast = "cast", None, False, UnaryGrad("cast")
    # The exact (erf) form; gelu_tanh is `fd.ops.gelu(x, approximate="tanh")`.
    gelu = "gelu", torch.nn.functional.gelu, True, UnaryGrad("gelu_grad", "input")
    gelu_tanh = (
        "gelu_tanh",
        lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        True,
        UnaryGrad("gelu_tanh_grad", "input"),
        False,
    )
    silu = "silu", torch.nn.functional.silu, True, UnaryGrad("silu_grad", "input")
    exp = "exp", torch.exp, True, UnaryGrad("mul", "out")
    tanh = "tanh", torch.tanh, True, UnaryGrad("tanh_grad", "out")
    sigmoid = "sigmoid", torch.sigmoid, True, UnaryGrad("sigmoid_grad", "out")


def _into(fn: Callable) -> Callable:
    """A two-operand function given an `out=` variant that copies."""

    def run(a, b, out=None):
        r = fn(a, b)
        return r if out is None else out.copy_(r)

    return run


_aten = torch.ops.aten


class BinaryKind(enum.StrEnum):
    """`out = lhs <symbol> rhs`, computed by `torch_fn` (with torch's
    broadcasting and type promotion). The kinds without a symbol are the
    derivatives backward programs use (`hostir.autodiff`), torch's own
    backward kernels: `kind(grad, saved)` on operands of one shape, in the
    grad's dtype (`eq`: the 0/1 mask of lhs == rhs in lhs's dtype); the
    dump prints them as calls. A unary kind's gradient (`UnaryGrad`) names
    the one it is made with."""

    symbol: str | None
    torch_fn: Callable

    def __new__(cls, name: str, symbol: str | None, torch_fn: Callable):
        member = str.__new__(cls, name)
        member._value_ = name
        member.symbol = symbol
        member.torch_fn = torch_fn
        return member

    add = "add", "+", torch.add
    sub = "sub", "-", torch.sub
    mul = "mul", "*", torch.mul
    div = "div", "/", torch.div
    relu_grad = "relu_grad", None, _into(lambda g, x: _aten.threshold_backward(g, x, 0))
    gelu_grad = "gelu_grad", None, _into(lambda g, x: _aten.gelu_backward(g, x))
    gelu_tanh_grad = "gelu_tanh_grad", None, _into(lambda g, x: _aten.gelu_backward(g, x, approximate="tanh"))
    silu_grad = "silu_grad", None, _into(lambda g, x: _aten.silu_backward(g, x))
    tanh_grad = "tanh_grad", None, _into(lambda g, y: _aten.tanh_backward(g, y))
    sigmoid_grad = "sigmoid_grad", None, _into(lambda g, y: _aten.sigmoid_backward(g, y))
    abs_grad = "abs_grad", None, _into(lambda g, x: g * torch.sgn(x))
    eq = "eq", None, _into(lambda a, b: (a == b).to(a.dtype))


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
