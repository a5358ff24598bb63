"""Random small programs for the fuzz tests, with their eager-torch meaning.

A program draws one to three 2-D inputs and applies a chain of ops to them
(elementwise ops with tensors or numbers, a copy, then at most one of a
reduction, a matmul or a linear), schedules a stream axis or not, and runs
with preallocated outputs or not. `build` makes the FusionDefinition,
`reference` computes the same in eager torch. The multi-device variant adds
a mesh and a sharded axis (tests/python/multidevice/test_fuzz.py).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from hostir import FusionDefinition, ParallelType

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32]
SIZES = [0, 1, 2, 3, 5]


@dataclasses.dataclass
class Program:
    dtype: torch.dtype
    m: int
    n: int
    k: int
    chain: list[tuple[str, object]]  # ("add"|"sub"|"mul", "y"|number), ("div", number), ("set", None)
    tail: tuple[str, object] | None  # ("sum"|"max"|"min", dim), ("matmul", None), ("linear", bias?)
    stream: bool
    streams: int
    preallocate: bool

    def inputs(self, gen: torch.Generator, device="cpu") -> list[torch.Tensor]:
        def draw(*shape):
            if self.dtype.is_floating_point:
                return torch.randn(*shape, generator=gen, dtype=self.dtype).to(device)
            return torch.randint(-6, 7, shape, generator=gen, dtype=self.dtype).to(device)

        xs = [draw(self.m, self.n), draw(self.m, self.n)]
        if self.tail is not None and self.tail[0] == "matmul":
            xs.append(draw(self.n, self.k))
        if self.tail is not None and self.tail[0] == "linear":
            xs.append(draw(self.k, self.n))
            if self.tail[1]:
                xs.append(draw(self.k))
        return xs


@st.composite
def programs(draw) -> Program:
    dtype = draw(st.sampled_from(DTYPES))
    floating = dtype.is_floating_point
    elementwise = [("add", "y"), ("sub", "y"), ("mul", "y"), ("set", None)]
    numbers = st.sampled_from([2, 3, -1]) if not floating else st.sampled_from([0.5, 2.0, -1.5])
    chain = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(elementwise + [("mul", "number"), ("add", "number")] + ([("div", "number")] if floating else [])))
        if op[1] == "number":
            op = (op[0], draw(numbers))
        chain.append(op)
    tails = [None, ("sum", 0), ("sum", 1), ("max", 0), ("min", 1)]
    if floating:
        tails += [("matmul", None), ("linear", False), ("linear", True)]
    tail = draw(st.sampled_from(tails))
    return Program(
        dtype=dtype,
        m=draw(st.sampled_from(SIZES)),
        n=draw(st.sampled_from(SIZES)),
        k=draw(st.sampled_from([1, 3])),
        chain=chain,
        tail=tail,
        stream=draw(st.booleans()),
        streams=draw(st.integers(1, 3)),
        preallocate=draw(st.booleans()),
    )


def build(p: Program):
    """The FusionDefinition of `p` and its output TensorView."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=p.dtype)
        y = fd.define_tensor([-1, -1], dtype=p.dtype)
        extra = []
        if p.tail is not None and p.tail[0] == "matmul":
            extra.append(fd.define_tensor([-1, -1], dtype=p.dtype))
        if p.tail is not None and p.tail[0] == "linear":
            extra.append(fd.define_tensor([-1, -1], dtype=p.dtype))
            if p.tail[1]:
                extra.append(fd.define_tensor([-1], dtype=p.dtype))
        cur = x
        for op, arg in p.chain:
            if op == "set":
                cur = fd.ops.set(cur)
            else:
                cur = getattr(fd.ops, op)(cur, y if arg == "y" else arg)
        if p.tail is not None:
            kind, arg = p.tail
            if kind in ("sum", "max", "min"):
                cur = getattr(fd.ops, kind)(cur, [arg])
            elif kind == "matmul":
                cur = fd.ops.matmul(cur, extra[0])
            else:
                cur = fd.ops.linear(cur, *extra)
        fd.add_output(cur)
    if p.stream and cur.logical_ndim >= 1 and (p.tail is None or p.tail[0] not in ("sum", "max", "min") or p.tail[1] != 0):
        cur.axis(0).parallelize(ParallelType.stream)
    return fd, cur


def reference(p: Program, inputs: list[torch.Tensor]) -> torch.Tensor:
    x, y, *extra = inputs
    cur = x
    for op, arg in p.chain:
        if op == "set":
            cur = cur.clone()
        else:
            cur = getattr(torch, op)(cur, y if arg == "y" else arg)
    if p.tail is None:
        return cur
    kind, arg = p.tail
    if kind == "sum":
        return cur.sum(arg, dtype=cur.dtype if cur.dtype.is_floating_point else torch.int64)
    if kind in ("max", "min"):
        return cur.amax(arg) if kind == "max" else cur.amin(arg)
    if kind == "matmul":
        return cur @ extra[0]
    return torch.nn.functional.linear(cur, *extra)
