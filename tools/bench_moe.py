"""Expert-parallel Mixture-of-Experts layer across ranks: torch's baselines (and hostir's rows, through a hook).

The layer, on each rank r of D (one GPU per rank, NCCL; ``--cpu``: 2 gloo
ranks on the CPU at tiny shapes):

* tokens ``x`` [T, H], different random tokens on every rank; the router
  ``Wr`` [E, H], the same on every rank; the E experts sharded: rank r holds
  experts ``r*E/D .. (r+1)*E/D - 1`` (E_l = E/D of them) as ``gate_up``
  [E_l, 2F, H] (rows ``0..F-1`` the gate, ``F..2F-1`` the up projection) and
  ``down`` [E_l, H, F]; an expert is Qwen3-MoE's / DeepSeek's SwiGLU
  ``h = silu(x @ Wg^T) * (x @ Wu^T); y = h @ Wd^T``;
* routing: ``probs = softmax(x @ Wr^T)`` in float32, ``topk(k)`` gives
  ``weights`` [T, k] and ``indices`` [T, k], the weights renormalised to sum
  to 1; ``out[t] = sum_j weights[t, j] * expert_{indices[t, j]}(x[t])``
  (summed in float32, returned in the layer's dtype: bf16 on a GPU, float32
  with ``--cpu``).

Variants (each timed forward, under ``torch.no_grad()``, and forward+backward
through torch autograd, every input and weight requiring grad):

* ``reference_local`` (``--check`` only): no communication; each rank runs
  its own tokens through all E experts (every rank builds the same full
  weights from per-expert seeds), densely: every expert on every token,
  weighted by the routing gates (0 where not routed).
* ``torchtitan``: torchtitan's expert parallelism, sequential: the token
  copies sorted by expert (stable argsort of the flattened indices), the
  counts per expert exchanged first (``all_to_all_single`` of the counts),
  then the tokens (``all_to_all_single`` with ``input_split_sizes`` /
  ``output_split_sizes``, which needs the counts on the host: a ``.tolist()``
  that synchronizes, as in torchtitan), the received rows permuted to
  expert-major order (each expert's group padded to 16 bytes of rows, as
  torchtitan's ``generate_permute_indices`` does for ``torch._grouped_mm``),
  the local experts as one grouped GEMM (``torch._grouped_mm`` where it runs
  on this device and dtype, else a Python loop of matmuls over the local
  experts; the table's note says which), then the reverse
  ``all_to_all_single``, unpermute and the weighted sum. Differentiable
  through ``torch.distributed.nn.functional.all_to_all_single`` (its
  backward is the reverse all-to-all), or a small autograd.Function of ours
  where that one lacks split sizes.
* ``allgather_rs``: Megatron's "allgather" token dispatcher: all-gather the
  tokens and the routing (indices, weights) of every rank; each rank runs
  its local experts on every token routed to them (the selection needs a
  host sync, as Megatron's ``masked_select``), weights and sums them into
  [D*T, H], and a reduce-scatter (sum) returns each rank its own tokens.
* ``padded_a2a``: capacity-padded all-to-all: a send buffer
  [D, E_l, C, H] (C: the slots per (source rank, expert); ``--capacity-factor``
  unset: C = T, the worst case, nothing dropped; set: C = ceil(factor*T*k/E),
  the (token, slot) pairs past an expert's C dropped in token order), one
  ``all_to_all_single`` of equal splits, one batched matmul over
  [E_l, D*C, H] (the grouped GEMM in padded form), the reverse all-to-all,
  a gather per (token, slot) and the weighted sum. The slots come from a
  stable argsort by expert, counts by ``scatter_add`` and rank within the
  expert = position - offset: no host sync, so the layer can be captured in
  a CUDA graph; ``padded_a2a_graph`` (CUDA, forward only) replays one.
* hostir's rows: whatever ``tools/bench_moe_hostir.py``'s
  ``hostir_variants(args, ctx, check)`` returns, run like the rows above.

The Variant contract (for ``bench_moe_hostir.py``): ``Variant(name,
forward, forward_backward=None, note="", modes=("fwd", "fwd+bwd"),
optional=False)``. ``forward(inputs)`` and ``forward_backward(inputs)`` take
the rank's ``Inputs`` (``x`` [T, H], ``router`` [E, H], ``gate_up``
[E_l, 2F, H], ``down`` [E_l, H, F], all requiring grad, and ``grad_out``
[T, H]) and return the layer's output [T, H] in the layer's dtype;
``forward_backward`` also runs the backward with ``inputs.grad_out``,
leaving the gradients in the inputs' ``.grad`` (the runner sets them to
None before each call); ``None`` means ``forward`` then
``torch.autograd.backward(out, inputs.grad_out)``. ``forward`` is called
under ``torch.no_grad()`` when timed. ``modes`` says which of the two are
timed; ``optional``: a failure does not fail the run. Every rank must build
the same variants in the same order; the default process group (NCCL, or
gloo with ``--cpu``) exists before they are built.

Also measured, per token count: dispatch alone and combine alone, in GB/s
(bytes each rank sends to the other ranks / time, mean over ranks, slowest
rank's time), for ``all_to_all_single`` with the splits of this routing and
for the padded equal-split ``all_to_all_single``; and once, on a GPU
machine, the copy engine's peer bandwidth (rank 0 copies a large buffer
``dst.copy_(src)`` from cuda:0 to cuda:1, one direction, then both
directions at once, while the other ranks wait), the reference for the
all-to-alls' "% of the copy engine's peer bandwidth".

Timing: per variant and mode, ``--warmup`` calls, then ``--repeats`` windows
of ``--iters`` calls each, the variants' windows interleaved (each round
runs one window of every variant, starting one further along each round, so
that a drift of the clocks hits them alike); before each window every rank
synchronizes its GPU and meets the others at a barrier (gloo), CUDA events
around the window (wall clock on the CPU) give ms per call; per window the
slowest rank counts, the median over windows is reported. ``host ms``: the
time the host spends in one call issued onto an idle device
(``time.perf_counter`` around the call, after the windows: ``--iters``
calls per variant, each after a synchronize and a barrier), median over
calls, slowest rank (torchtitan's and allgather_rs's host ms include their
host syncs, hostir's exact form its read of the counts). Back to back, a
host that runs ahead of the device blocks once the launch queue is full,
so its time per call there is the device's, not its own. Before timing, every
variant's forward output is compared with torchtitan's (``match``).

``--check``: no timing; every variant's forward output and its gradients of
x, the router and the local experts' weights must match ``reference_local``
(``torch.testing.assert_close``; the reference's expert gradients summed
over the ranks) on random data, at small shapes unless given. Besides the
rows above it checks the other paths of each: ``torchtitan_loop`` and
``allgather_rs_loop`` (the experts' loop, where ``torch._grouped_mm`` is the
default), ``torchtitan_a2a_function`` (our autograd.Function for the
all-to-all) and ``padded_a2a_cf<f>`` (capacity factor ``--capacity-factor``,
else 1: pairs dropped, against a reference that drops the same pairs,
found independently by a one-hot cumsum); and that the padded slots have
no data-dependent shapes (traced under ``FakeTensorMode``) and, on CUDA,
that padded_a2a's forward makes no host sync
(``torch.cuda.set_sync_debug_mode("error")``, reported, not fatal) and
replays from a CUDA graph (``padded_a2a_graph``). Exits 1 if anything
mismatches (the optional graph row aside).

Run from the repository root. Without a launcher the script starts itself
under ``torchrun --standalone`` (``--ranks``, default 2 with ``--cpu``, else
every visible GPU) in a process group of its own, which it ends when the
ranks exit or ``--time-limit`` passes; or run it under torchrun directly:

    python3 tools/bench_moe.py                                   # all GPUs, tokens 4096,8192,16384 per rank
    torchrun --standalone --nproc-per-node 2 tools/bench_moe.py --tokens 8192
    python3 tools/bench_moe.py --check                           # small shapes, GPUs
    python3 tools/bench_moe.py --cpu --check                     # 2 gloo ranks, T=64 H=32 F=48 E=8 k=2
    python3 tools/bench_moe.py --cpu --out-dir /tmp/moe          # the small timed form

gloo (``--cpu``) has every collective used here in torch 2.13:
``all_to_all_single`` with split sizes and equal splits,
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (where a torch's
gloo lacks ``reduce_scatter_tensor``, an all-reduce and a slice stand in,
and the output says so).

Rank 0 prints a Markdown table per token count and writes ``moe_<machine>.md``,
``.json`` and ``.png`` (ms against tokens per variant, fwd and fwd+bwd panels,
where matplotlib is installed) under ``--out-dir``, else ``$OUT``, else
``benchmarks/results`` (``<machine>``: ``h100x2`` for two H100s, ``cpu``;
``--tag`` overrides), rewritten after every token count.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import inspect
import json
import math
import os
import pathlib
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchlib import kill_session, machine_tag

# torch 2.13 deprecates the collectives the baselines call (torch 2.11's
# spelling), with one warning per call site and rank.
warnings.filterwarnings(
    "ignore", message=r".*(all_to_all_single|all_gather_into_tensor|reduce_scatter_tensor).* is deprecated"
)

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO / "benchmarks" / "results"
MODES = ("fwd", "fwd+bwd")
BASELINE = "torchtitan"
# (tokens, hidden, ffn, experts, topk) when not given: the GPU benchmark
# (DeepSeek-V3 / Qwen3-MoE scaled: 64 experts of 1536, top 8), --cpu, and
# --check on GPUs.
GPU_SHAPES = ("4096,8192,16384", 4096, 1536, 64, 8)
CPU_SHAPES = ("32,64", 32, 48, 8, 2)
CHECK_SHAPES = ("256", 256, 128, 16, 4)
TEARDOWN_SECONDS = 30.0


# ---------------------------------------------------------------- setup


@dataclasses.dataclass
class Context:
    """What every variant of one run shares."""

    rank: int
    world: int  # D
    local_rank: int
    device: torch.device
    dtype: torch.dtype
    cpu: bool
    hidden: int  # H
    ffn: int  # F, the moe intermediate size
    experts: int  # E
    topk: int  # k
    group: dist.ProcessGroup  # the default group: NCCL, or gloo with --cpu
    ctl: dist.ProcessGroup  # gloo: barriers and the ranks' agreement
    tokens: int = 0  # T of the current token count
    experts_impl: str = "loop"  # "grouped_mm" (torch._grouped_mm) or "loop"
    experts_note: str = ""
    a2a_impl: str = "torch.distributed.nn"  # or "function" (ours)
    reduce_scatter_fallback: str = ""  # why an all-reduce stands in, if it does

    @property
    def local_experts(self) -> int:
        return self.experts // self.world

    @property
    def expert_range(self) -> range:
        return range(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        # A CPU barrier on gloo: it queues nothing on the GPU being timed.
        dist.barrier(group=self.ctl)

    def gather(self, obj) -> list:
        everyone = [None] * self.world
        dist.all_gather_object(everyone, obj, group=self.ctl)
        return everyone


@dataclasses.dataclass
class Inputs:
    """One rank's inputs; every tensor but grad_out requires grad."""

    x: torch.Tensor  # [T, H]
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E_l, 2F, H]
    down: torch.Tensor  # [E_l, H, F]
    grad_out: torch.Tensor  # [T, H]

    def params(self) -> list[torch.Tensor]:
        return [self.x, self.router, self.gate_up, self.down]

    def zero_grad(self) -> None:
        for p in self.params():
            p.grad = None

    def clone(self) -> Inputs:
        fresh = [p.detach().clone().requires_grad_() for p in self.params()]
        return Inputs(*fresh, self.grad_out)


@dataclasses.dataclass
class Variant:
    """A row: see the module docstring for the contract."""

    name: str
    forward: Callable[[Inputs], torch.Tensor]
    forward_backward: Callable[[Inputs], torch.Tensor] | None = None
    note: str = ""
    modes: tuple[str, ...] = MODES
    optional: bool = False
    capacity: int | None = None  # padded variants: C, where it drops tokens (checked against a reference that drops)
    # Said of the row after its first forward (the schedule a planner chose), added to its note.
    describe: Callable[[], str] | None = None

    def step(self, mode: str) -> Callable[[Inputs], torch.Tensor]:
        if mode == "fwd":

            def fwd(inputs: Inputs) -> torch.Tensor:
                with torch.no_grad():
                    return self.forward(inputs)

            return fwd
        fb = self.forward_backward

        def fwd_bwd(inputs: Inputs) -> torch.Tensor:
            inputs.zero_grad()
            if fb is not None:
                return fb(inputs)
            out = self.forward(inputs)
            torch.autograd.backward(out, inputs.grad_out)
            return out

        return fwd_bwd


def normal(shape, seed: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale


def expert_weights(ctx: Context, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [n, 2F, H] and down [n, H, F] of `experts`, each expert from
    seeds of its own: every rank builds the same weights for an expert."""
    h, f = ctx.hidden, ctx.ffn
    gate_up = torch.stack([normal((2 * f, h), 100_000 + e, ctx.device, h**-0.5) for e in experts])
    down = torch.stack([normal((h, f), 200_000 + e, ctx.device, f**-0.5) for e in experts])
    return gate_up.to(ctx.dtype), down.to(ctx.dtype)


def make_inputs(ctx: Context, tokens: int) -> Inputs:
    """x and grad_out differ per rank; the router and the experts are the
    same wherever they exist. Scaled so that every activation is O(1)."""
    x = normal((tokens, ctx.hidden), 1000 + ctx.rank, ctx.device).to(ctx.dtype)
    router = normal((ctx.experts, ctx.hidden), 7, ctx.device, ctx.hidden**-0.5).to(ctx.dtype)
    gate_up, down = expert_weights(ctx, ctx.expert_range)
    grad_out = normal((tokens, ctx.hidden), 3000 + ctx.rank, ctx.device).to(ctx.dtype)
    return Inputs(*(t.requires_grad_() for t in (x, router, gate_up, down)), grad_out)


# ---------------------------------------------------------------- collectives


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse all_to_all_single:
    ours where torch.distributed.nn's lacks split sizes."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _a2a_raw(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _a2a_raw(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def _a2a_raw(x, output_splits, input_splits, group):
    rows = sum(output_splits) if output_splits is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


def nn_a2a_has_splits() -> bool:
    try:
        import torch.distributed.nn.functional as dist_nn

        params = inspect.signature(dist_nn.all_to_all_single).parameters
    except Exception:
        return False
    return "output_split_sizes" in params and "input_split_sizes" in params


def all_to_all(ctx: Context, x: torch.Tensor, output_splits=None, input_splits=None, impl: str | None = None):
    """Differentiable all_to_all_single of x's rows (equal splits where None)."""
    x = x.contiguous()
    if (impl or ctx.a2a_impl) == "torch.distributed.nn":
        import torch.distributed.nn.functional as dist_nn

        rows = sum(output_splits) if output_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        return dist_nn.all_to_all_single(out, x, output_splits, input_splits, group=ctx.group)
    return _AllToAll.apply(x, output_splits, input_splits, ctx.group)


def _all_gather_raw(ctx: Context, x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((ctx.world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=ctx.group)
    return out


def _reduce_scatter_raw(ctx: Context, x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0] // ctx.world
    if ctx.reduce_scatter_fallback:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank * rows : (ctx.rank + 1) * rows].clone()
    out = x.new_empty((rows, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=ctx.group)
    return out


class _AllGather(torch.autograd.Function):
    """all_gather_into_tensor along rows; backward: reduce_scatter (sum)."""

    @staticmethod
    def forward(ctx, x, bench_ctx):
        ctx.bench_ctx = bench_ctx
        return _all_gather_raw(bench_ctx, x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_raw(ctx.bench_ctx, grad), None


class _ReduceScatter(torch.autograd.Function):
    """reduce_scatter_tensor (sum) along rows; backward: all_gather."""

    @staticmethod
    def forward(ctx, x, bench_ctx):
        ctx.bench_ctx = bench_ctx
        return _reduce_scatter_raw(bench_ctx, x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_raw(ctx.bench_ctx, grad), None


def probe_reduce_scatter(ctx: Context) -> str:
    """'' where reduce_scatter_tensor runs on this group, else why not."""
    try:
        t = torch.ones(ctx.world, 1, device=ctx.device, dtype=ctx.dtype)
        _reduce_scatter_raw(ctx, t)
        ctx.sync()
        return ""
    except Exception as exc:
        return f"reduce_scatter_tensor unavailable on {dist.get_backend(ctx.group)} ({_error_text(exc)})"


# ---------------------------------------------------------------- the layer's pieces


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [T, k] (float32, renormalised to sum 1) and indices [T, k]."""
    probs = torch.softmax((x @ router.t()).float(), dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), indices


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert (or a batch of them, leading dims alike) on rows x [..., N, H]."""
    g, u = (x @ gate_up.transpose(-2, -1)).chunk(2, dim=-1)
    return (F.silu(g) * u) @ down.transpose(-2, -1)


def grouped_swiglu(buf: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The local experts as grouped GEMMs: group e is rows offs[e-1]..offs[e]-1
    of buf (rows past offs[-1] are left unwritten)."""
    g, u = torch._grouped_mm(buf, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)


def local_experts(
    rows: torch.Tensor, expert_of_row: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, impl: str
) -> torch.Tensor:
    """rows [N, H], row n for local expert expert_of_row[n] in 0..E_l-1:
    their expert outputs [N, H], in the rows' order. The rows are permuted to
    expert-major order (stably), each expert's group padded to 16 bytes of
    rows for torch._grouped_mm (as torchtitan pads for it), run as one
    grouped GEMM (or, impl "loop", a matmul per expert over host-known
    groups: a sync), and permuted back."""
    n, h = rows.shape
    n_local = gate_up.shape[0]
    align = max(1, 16 // rows.element_size()) if impl == "grouped_mm" else 1
    counts = torch.zeros(n_local, dtype=torch.int64, device=rows.device)
    counts.scatter_add_(0, expert_of_row, torch.ones_like(expert_of_row))
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(expert_of_row, stable=True)
    sorted_expert = expert_of_row[order]
    rank_in_expert = torch.arange(n, device=rows.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    dest = torch.empty_like(order).scatter_(0, order, (ends - padded)[sorted_expert] + rank_in_expert)
    buf = rows.new_zeros((n + n_local * (align - 1), h)).index_copy(0, dest, rows)
    if impl == "grouped_mm":
        y = grouped_swiglu(buf, ends.to(torch.int32), gate_up, down)
    else:
        parts = buf.split(counts.tolist())  # host sync, as torchtitan's loop
        y = torch.cat([swiglu(part, gate_up[e], down[e]) for e, part in enumerate(parts)])
    return y.index_select(0, dest)


def probe_grouped_mm(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int) -> str:
    """'' where torch._grouped_mm runs forward and backward here and matches
    the loop (an empty group and padding included), else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm does not exist in this torch"
    align = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    if hidden % align or ffn % align:
        return f"hidden {hidden} and ffn {ffn} must be multiples of {align} for torch._grouped_mm in {dtype}"
    try:
        h, f = 8 * align, 4 * align
        gen_dev = device
        w1 = normal((3, 2 * f, h), 1, gen_dev, h**-0.5).to(dtype)
        w2 = normal((3, h, f), 2, gen_dev, f**-0.5).to(dtype)
        rows = normal((11, h), 3, gen_dev).to(dtype)
        experts = torch.tensor([2, 0, 2, 0, 2, 2, 0, 0, 2, 0, 2], device=device)  # expert 1 gets none
        grad = normal((11, h), 4, gen_dev).to(dtype)
        outs = []
        for impl in ("grouped_mm", "loop"):
            a, b, c = (t.detach().clone().requires_grad_() for t in (rows, w1, w2))
            y = local_experts(a, experts, b, c, impl)
            y.backward(grad)
            outs.append([y, a.grad, b.grad, c.grad])
        tol = tolerances(dtype)
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, **tol)
        return ""
    except Exception as exc:
        return f"torch._grouped_mm failed here: {_error_text(exc)}"


def keep_mask(indices: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: the (token, slot) pairs within their expert's first
    `capacity`, in flat (token-major) order. Independent of padded_slots
    (a one-hot cumsum), for the reference."""
    onehot = F.one_hot(indices.reshape(-1), experts)
    rank = ((onehot.cumsum(0) - 1) * onehot).sum(1)
    return (rank < capacity).view(indices.shape)


def padded_slots(indices: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Each (token, slot)'s row e*C + rank-within-e of the padded send
    buffer [E*C, H], or E*C where dropped; static shapes, no host sync."""
    flat = indices.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    sorted_expert = flat[order]
    rank_sorted = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    return torch.where(rank < capacity, flat * capacity + rank, torch.full_like(flat, experts * capacity))


def capacity_of(args, tokens: int, factor: float | None) -> int:
    if factor is None:
        return tokens  # a token's k experts are distinct: at most T pairs per expert and source rank
    return max(1, math.ceil(factor * tokens * args.topk / args.experts))


# ---------------------------------------------------------------- variants


def reference_forward(
    inputs: Inputs, gate_up_all: torch.Tensor, down_all: torch.Tensor, k: int, capacity: int | None = None
) -> torch.Tensor:
    """reference_local: every expert on every token of this rank, no
    communication; `capacity` drops as padded_a2a does."""
    x = inputs.x
    weights, indices = route(x, inputs.router, k)
    if capacity is not None:
        weights = weights * keep_mask(indices, gate_up_all.shape[0], capacity)
    gates = torch.zeros(x.shape[0], gate_up_all.shape[0], device=x.device).scatter(1, indices, weights)
    out = torch.zeros(x.shape, device=x.device)
    for e in range(gate_up_all.shape[0]):
        out = out + gates[:, e : e + 1] * swiglu(x, gate_up_all[e], down_all[e]).float()
    return out.to(x.dtype)


def torchtitan_forward(ctx: Context, inputs: Inputs, impl: str, a2a_impl: str | None = None) -> torch.Tensor:
    x, k, world, n_local = inputs.x, ctx.topk, ctx.world, ctx.local_experts
    tokens, hidden = x.shape
    weights, indices = route(x, inputs.router, k)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = torch.div(order, k, rounding_mode="floor")
    weights_sorted = weights.reshape(-1)[order]
    with torch.no_grad():
        counts = torch.zeros(ctx.experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        # Counts first: block s of counts_recv is rank s's count for each of my experts.
        counts_recv = torch.empty_like(counts)
        dist.all_to_all_single(counts_recv, counts, group=ctx.group)
        # The device-to-host sync torchtitan makes for the split sizes.
        input_splits, output_splits = torch.stack(
            [counts.view(world, n_local).sum(1), counts_recv.view(world, n_local).sum(1)]
        ).tolist()
        received = sum(output_splits)
        expert_of_row = (
            torch.arange(n_local, device=x.device).repeat(world).repeat_interleave(counts_recv, output_size=received)
        )
    routed = all_to_all(ctx, x.index_select(0, token_of), output_splits, input_splits, a2a_impl)
    y = local_experts(routed, expert_of_row, inputs.gate_up, inputs.down, impl)
    back = all_to_all(ctx, y, input_splits, output_splits, a2a_impl)
    out = torch.zeros((tokens, hidden), device=x.device).index_add(0, token_of, back.float() * weights_sorted[:, None])
    return out.to(x.dtype)


def allgather_rs_forward(ctx: Context, inputs: Inputs, impl: str) -> torch.Tensor:
    x, k, n_local = inputs.x, ctx.topk, ctx.local_experts
    weights, indices = route(x, inputs.router, k)
    x_all = _AllGather.apply(x, ctx)  # [D*T, H]
    weights_all = _AllGather.apply(weights, ctx)  # [D*T, k]
    with torch.no_grad():
        local = _all_gather_raw(ctx, indices).reshape(-1) - ctx.rank * n_local
        # Megatron's masked_select: the host learns how many pairs are local (a sync).
        mine = ((local >= 0) & (local < n_local)).nonzero().squeeze(1)
        token_of = torch.div(mine, k, rounding_mode="floor")
    y = local_experts(x_all.index_select(0, token_of), local[mine], inputs.gate_up, inputs.down, impl)
    contrib = y.float() * weights_all.reshape(-1)[mine][:, None]
    out_all = torch.zeros((x_all.shape[0], x.shape[1]), device=x.device).index_add(0, token_of, contrib)
    return _ReduceScatter.apply(out_all.to(x.dtype), ctx)


def padded_forward(ctx: Context, inputs: Inputs, capacity: int) -> torch.Tensor:
    x, k, world, n_local, experts = inputs.x, ctx.topk, ctx.world, ctx.local_experts, ctx.experts
    tokens, hidden = x.shape
    weights, indices = route(x, inputs.router, k)
    slot = padded_slots(indices, experts, capacity)
    token_of = torch.div(torch.arange(tokens * k, device=x.device), k, rounding_mode="floor")
    # One spare row takes the dropped pairs; it is not sent.
    send = x.new_zeros((experts * capacity + 1, hidden)).index_copy(0, slot, x.index_select(0, token_of))
    recv = all_to_all(ctx, send[: experts * capacity])  # [D (source), E_l, C, H]
    rows = recv.view(world, n_local, capacity, hidden).transpose(0, 1).reshape(n_local, world * capacity, hidden)
    y = swiglu(rows, inputs.gate_up, inputs.down)  # batched matmuls over [E_l, D*C, H]
    back = all_to_all(ctx, y.view(n_local, world, capacity, hidden).transpose(0, 1).reshape(-1, hidden))
    kept = slot < experts * capacity
    picked = back.index_select(0, torch.where(kept, slot, torch.zeros_like(slot)))
    weights = weights * kept.view(tokens, k)
    return (picked.view(tokens, k, hidden).float() * weights[..., None]).sum(1).to(x.dtype)


class GraphedForward:
    """padded_a2a's forward captured in a CUDA graph on its first call for
    a set of inputs (eager warm-up on a side stream first), replayed after."""

    def __init__(self, ctx: Context, capacity: int) -> None:
        self.ctx, self.capacity = ctx, capacity
        self.key = None
        self.graph = None
        self.out = None

    def __call__(self, inputs: Inputs) -> torch.Tensor:
        key = tuple(t.data_ptr() for t in inputs.params())
        if key != self.key:
            self.release()
            # The graph's pool cannot reuse the blocks the caching allocator
            # keeps for eager calls: give those back first.
            torch.cuda.empty_cache()
            side = torch.cuda.Stream(self.ctx.device)
            side.wait_stream(torch.cuda.current_stream(self.ctx.device))
            with torch.no_grad(), torch.cuda.stream(side):
                for _ in range(2):
                    padded_forward(self.ctx, inputs, self.capacity)
            torch.cuda.current_stream(self.ctx.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                self.out = padded_forward(self.ctx, inputs, self.capacity)
            self.graph, self.key = graph, key
        self.graph.replay()
        return self.out

    def release(self) -> None:
        """Drop the graph and its memory pool."""
        self.graph, self.key, self.out = None, None, None


def baseline_variants(args, ctx: Context, check: bool = False) -> list[Variant]:
    """The torch rows; with `check`, also the other implementations of each
    (the experts' loop, our all-to-all Function, a dropping capacity)."""
    impl, note = ctx.experts_impl, ctx.experts_note
    capacity = capacity_of(args, ctx.tokens, None if check else args.capacity_factor)
    padded_note = f"C={capacity}" + (
        " (worst case, nothing dropped)"
        if args.capacity_factor is None or check
        else f" (capacity factor {args.capacity_factor:g}: pairs past C dropped)"
    )
    a2a_note = (
        "a2a: torch.distributed.nn.functional.all_to_all_single"
        if ctx.a2a_impl == "torch.distributed.nn"
        else "a2a: an autograd.Function (torch.distributed.nn's all_to_all_single lacks split sizes here)"
    )
    out = [
        Variant("torchtitan", lambda inp: torchtitan_forward(ctx, inp, impl), note=f"{note}; {a2a_note}"),
        Variant("allgather_rs", lambda inp: allgather_rs_forward(ctx, inp, impl), note=note),
        Variant(
            "padded_a2a",
            lambda inp: padded_forward(ctx, inp, capacity),
            note=padded_note,
            capacity=capacity if args.capacity_factor is not None and not check else None,
        ),
    ]
    if not ctx.cpu:
        out.append(
            Variant(
                "padded_a2a_graph",
                GraphedForward(ctx, capacity),
                note=f"{padded_note}; forward replayed from a CUDA graph",
                modes=("fwd",),
                optional=True,
                capacity=out[-1].capacity,
            )
        )
    if check:
        if impl != "loop":
            out.append(Variant("torchtitan_loop", lambda inp: torchtitan_forward(ctx, inp, "loop")))
            out.append(Variant("allgather_rs_loop", lambda inp: allgather_rs_forward(ctx, inp, "loop")))
        if ctx.a2a_impl != "function":
            out.append(Variant("torchtitan_a2a_function", lambda inp: torchtitan_forward(ctx, inp, impl, "function")))
        small = capacity_of(args, ctx.tokens, args.capacity_factor or 1.0)
        out.append(
            Variant(
                f"padded_a2a_cf{args.capacity_factor or 1.0:g}",
                lambda inp: padded_forward(ctx, inp, small),
                capacity=small,
            )
        )
    return out


def all_variants(args, ctx: Context, check: bool = False) -> list[Variant]:
    import bench_moe_hostir

    out = baseline_variants(args, ctx, check) + list(bench_moe_hostir.hostir_variants(args, ctx, check))
    if args.variants:
        out = [v for v in out if any(fnmatch.fnmatchcase(v.name, p) for p in args.variants)]
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"bench_moe: variant names repeat: {names}")
    return out


# ---------------------------------------------------------------- running


def _error_text(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


def tolerances(dtype: torch.dtype) -> dict:
    # bf16: 8 bits of mantissa, and the variants sum in different orders
    # (grouped GEMMs, index_add, the reduce-scatter); float32: the order only.
    if dtype == torch.bfloat16:
        return {"rtol": 2e-2, "atol": 2e-2}
    return {"rtol": 1e-4, "atol": 1e-4}


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float, str]:
    """assert_close with atol scaled by the expected tensor's largest magnitude."""
    if got.shape != want.shape:
        return False, float("inf"), f"shape {list(got.shape)} != {list(want.shape)}"
    got, want = got.detach().float(), want.detach().float()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    tol = tolerances(dtype)
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    try:
        torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale)
    except AssertionError as exc:
        return False, err, " ".join(str(exc).split())[:300]
    return True, err, ""


def agree(ctx: Context, error: str | None) -> list[str]:
    """Every rank's error, so that all ranks skip a variant that failed on one."""
    return [f"rank {r}: {e}" for r, e in enumerate(ctx.gather(error)) if e]


def time_rows(ctx: Context, steps: dict, inputs: Inputs, args) -> dict:
    """{name: (ms per call, host ms per call, per-window ms)} of `steps`
    ({name: step(inputs)}), in interleaved rounds of windows."""
    names = list(steps)
    for name in names:
        for _ in range(args.warmup):
            steps[name](inputs)
    ctx.sync()
    windows: dict[str, list[float]] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}
    start = end = None
    if not ctx.cpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(args.repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            step = steps[name]
            ctx.sync()
            ctx.barrier()
            t_window = time.perf_counter()
            if start is not None:
                start.record()
            for _ in range(args.iters):
                step(inputs)
            if end is not None:
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                elapsed = (time.perf_counter() - t_window) * 1e3
            windows[name].append(elapsed / args.iters)
    # The host's own cost of a call: each issued onto an idle device, the
    # ranks met first. Back to back (in the windows) a host that runs
    # ahead blocks once the launch queue is full, and its time per call
    # becomes the device's.
    for _ in range(args.iters):
        for name in names:
            ctx.sync()
            ctx.barrier()
            t0 = time.perf_counter()
            steps[name](inputs)
            host[name].append((time.perf_counter() - t0) * 1e3)
    ctx.sync()
    everyone = ctx.gather({n: (windows[n], statistics.median(host[n])) for n in names})
    out = {}
    for n in names:
        slowest = [max(ts) for ts in zip(*(e[n][0] for e in everyone))]
        out[n] = (statistics.median(slowest), max(e[n][1] for e in everyone), slowest)
    return out


def bench_tokens(args, ctx: Context, tokens: int) -> dict:
    """Every variant and the all-to-alls at T = tokens; rank 0's record."""
    ctx.tokens = tokens
    inputs = make_inputs(ctx, tokens)
    table = all_variants(args, ctx)
    rows: dict[str, dict] = {}
    reference = None  # torchtitan's forward output
    runnable: dict[str, Variant] = {}
    for v in table:
        row = rows.setdefault(v.name, {"variant": v.name, "note": v.note, "optional": v.optional})
        skip = memory_skip(args, ctx, v)
        if skip:
            row["status"] = f"skipped: {skip}"
            continue
        error, out = None, None
        try:
            out = v.step("fwd")(inputs)
            if "fwd+bwd" in v.modes:
                v.step("fwd+bwd")(inputs)
            ctx.sync()
        except Exception as exc:
            error = _error_text(exc)
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        errors = agree(ctx, error)
        if errors:
            row["status"] = "failed: " + "; ".join(errors)
            continue
        row["status"] = "ok"
        if v.describe is not None:
            row["note"] = f"{row['note']}; {v.describe()}"
        runnable[v.name] = v
        if v.name == BASELINE:
            reference = out.detach().clone()
        if reference is not None and v.capacity is None:
            ok, err, _ = compare(out, reference, ctx.dtype)
            everyone = ctx.gather((ok, err))
            row["match"], row["max_abs_err"] = all(o for o, _ in everyone), max(e for _, e in everyone)
        elif v.capacity is not None:
            row["match"] = None
            row["note"] = (row["note"] + "; drops pairs: not compared").lstrip("; ")
        del out
    if args.profile:
        profile_rows(ctx, runnable, inputs, args, tokens)
    for mode in args.modes:
        steps = {name: v.step(mode) for name, v in runnable.items() if mode in v.modes}
        for name, (ms, host_ms, windows) in time_rows(ctx, steps, inputs, args).items():
            rows[name][mode] = {"ms": ms, "host_ms": host_ms, "windows_ms": windows}
        # A variant timed in no later mode lets its memory go (the graph's pool).
        later = args.modes[args.modes.index(mode) + 1 :]
        for v in runnable.values():
            if not set(later) & set(v.modes) and hasattr(v.forward, "release"):
                v.forward.release()
        if not ctx.cpu:
            torch.cuda.empty_cache()
    for row in rows.values():
        base = rows.get(BASELINE, {})
        for mode in MODES:
            if mode in row and mode in base:
                row[mode]["speedup_vs_torchtitan"] = base[mode]["ms"] / row[mode]["ms"]
    comm = bench_all_to_all(args, ctx, inputs)
    del inputs
    if not ctx.cpu:
        torch.cuda.empty_cache()
    return {"tokens": tokens, "rows": list(rows.values()), "comm": comm}


def profile_rows(ctx: Context, runnable: dict, inputs: Inputs, args, tokens: int) -> None:
    """One call of each runnable variant in the last of ``--modes`` under
    torch.profiler (after its warm-ups); rank 0 writes the ops' table by
    device time, and that time by the host op that launched it
    (`by_range`), to ``<--profile>/T<tokens>_<variant>_<mode>.txt``: where
    a variant's time goes, op by op, beside the others of the same run."""
    mode = args.modes[-1]
    folder = pathlib.Path(args.profile)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not ctx.cpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name, v in runnable.items():
        if mode not in v.modes:
            continue
        step = v.step(mode)
        for _ in range(args.warmup):
            step(inputs)
        ctx.sync()
        ctx.barrier()
        with torch.profiler.profile(activities=activities) as prof:
            step(inputs)
            ctx.sync()
        if ctx.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            sort = "self_cpu_time_total" if ctx.cpu else "self_device_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
            text = table + "\n\nBy the range that launched it (a host op of hostir's program, an autograd node):\n"
            text += by_range(prof, not ctx.cpu)
            (folder / f"T{tokens}_{name}_{mode.replace('+', '_')}.txt").write_text(text)
        del prof
        ctx.barrier()


def by_range(prof, device: bool, rows: int = 60) -> str:
    """The profiled self time (device time where `device`) of each host-side
    torch op, summed under its nearest enclosing range that is not a torch
    op (a host op of hostir's program such as ``matmul T30``, or an
    autograd node), a line per (range, op), largest first. A host op's
    device time is that of the kernels and copies it launched; the device's
    own events (the kernels again, and each range's span on the device,
    which can take in other streams' work) are not counted twice."""
    totals: dict[tuple[str, str], list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        t = ev.self_device_time_total if device else ev.self_cpu_time_total
        if t <= 0:
            continue
        p = ev
        while p is not None and p.name.startswith(("aten::", "c10d::", "cudaLaunch", "cuda")):
            p = p.cpu_parent
        key = (p.name if p is not None else "-", ev.name)
        entry = totals.setdefault(key, [0.0, 0])
        entry[0] += t
        entry[1] += 1
    lines = [f"{'ms':>9} {'calls':>5}  range / op"]
    for (where, op), (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{t / 1e3:9.3f} {n:5d}  {where[:60]} / {op[:70]}")
    return "\n".join(lines) + "\n"


def memory_skip(args, ctx: Context, v: Variant) -> str:
    """Why a padded variant at this C would not fit in the GPU's memory
    (the same answer on every rank), or ''."""
    if ctx.cpu or not v.name.startswith("padded_a2a"):
        return ""
    capacity = v.capacity or capacity_of(args, ctx.tokens, args.capacity_factor)
    elem = torch.empty((), dtype=ctx.dtype).element_size()
    buffer = ctx.experts * capacity * ctx.hidden * elem  # [D, E_l, C, H]
    # forward+backward keeps about 3 buffers' worth (the received rows, the
    # gate/up activations) and makes about 3 more at its peak; the graph's
    # pool keeps a forward's (about 4) beside what the eager rows cache.
    need = (10 if isinstance(v.forward, GraphedForward) else 6) * buffer
    have = torch.cuda.get_device_properties(ctx.device).total_memory * 0.9
    if need > have:
        return (
            f"padded buffers need about {need / 2**30:.0f} GiB, more than 90% of the GPU's {have / 0.9 / 2**30:.0f} GiB"
        )
    return ""


def bench_all_to_all(args, ctx: Context, inputs: Inputs) -> list[dict]:
    """Dispatch alone and combine alone: all_to_all_single with this
    routing's splits, and the padded equal-split one."""
    if not ctx.cpu:
        torch.cuda.empty_cache()
    x, k = inputs.x.detach(), ctx.topk
    tokens, hidden = x.shape
    elem = x.element_size()
    with torch.no_grad():
        _, indices = route(x, inputs.router.detach(), k)
        counts = torch.zeros(ctx.experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, indices.reshape(-1), torch.ones_like(indices.reshape(-1)))
        counts_recv = torch.empty_like(counts)
        dist.all_to_all_single(counts_recv, counts, group=ctx.group)
        in_splits = counts.view(ctx.world, -1).sum(1).tolist()
        out_splits = counts_recv.view(ctx.world, -1).sum(1).tolist()
    send = x.new_ones((tokens * k, hidden))
    back = x.new_ones((sum(out_splits), hidden))
    capacity = capacity_of(args, tokens, args.capacity_factor)
    padded_bytes = ctx.experts * capacity * hidden * elem
    fits = ctx.cpu or 2 * padded_bytes < 0.8 * torch.cuda.mem_get_info(ctx.device)[0]
    # The same answer on every rank, or the ranks' all-to-alls would not pair.
    padded = x.new_ones((ctx.experts * capacity, hidden)) if all(ctx.gather(fits)) else None
    cases = {
        "a2a_splits_dispatch": (lambda _: _a2a_raw(send, out_splits, in_splits, ctx.group), in_splits),
        "a2a_splits_combine": (lambda _: _a2a_raw(back, in_splits, out_splits, ctx.group), out_splits),
    }
    rows_per_rank = ctx.local_experts * capacity
    if padded is not None:
        cases["a2a_padded_dispatch"] = (lambda _: _a2a_raw(padded, None, None, ctx.group), [rows_per_rank] * ctx.world)
        cases["a2a_padded_combine"] = (lambda _: _a2a_raw(padded, None, None, ctx.group), [rows_per_rank] * ctx.world)
    # Rows each rank sends to the other ranks.
    off_rank = {name: sum(s for r, s in enumerate(splits) if r != ctx.rank) for name, (_, splits) in cases.items()}
    # Token rows in the padded buffer that carry a token (the rest is padding).
    useful = sum(s for r, s in enumerate(in_splits) if r != ctx.rank)
    everyone = ctx.gather((off_rank, useful))
    timed = time_rows(ctx, {n: f for n, (f, _) in cases.items()}, inputs, args)
    out = []
    for name, (ms, host_ms, windows) in timed.items():
        rows = statistics.mean(e[0][name] for e in everyone)
        bytes_ = rows * hidden * elem
        row = {"transfer": name, "ms": ms, "host_ms": host_ms, "bytes_off_rank": bytes_, "gb_s": bytes_ / ms / 1e6}
        if name.startswith("a2a_padded"):
            token_bytes = statistics.mean(e[1] for e in everyone) * hidden * elem
            row["token_gb_s"] = token_bytes / ms / 1e6
            row["capacity"] = capacity
        out.append(row)
    if padded is None:
        out.append({"transfer": "a2a_padded_*", "skipped": "two padded buffers would take over 80% of the free memory"})
    return out


def copy_engine_bandwidth(ctx: Context, nbytes: int, iters: int) -> dict:
    """Rank 0 copies `nbytes` cuda:0 -> cuda:1 (dst.copy_(src): the copy
    engine, peer to peer where P2P access works), one direction, then both
    at once on two streams; the other ranks wait at the barrier."""
    result: dict = {}
    if ctx.cpu:
        result["skipped"] = "--cpu"
    elif torch.cuda.device_count() < 2:
        result["skipped"] = f"{torch.cuda.device_count()} GPU visible"
    elif ctx.rank == 0:
        try:
            d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
            result["p2p"] = torch.cuda.can_device_access_peer(0, 1)
            result["bytes"] = nbytes
            a0 = torch.empty(nbytes, dtype=torch.uint8, device=d0)
            b1 = torch.empty(nbytes, dtype=torch.uint8, device=d1)
            a1 = torch.empty(nbytes, dtype=torch.uint8, device=d1)
            b0 = torch.empty(nbytes, dtype=torch.uint8, device=d0)
            s0, s1 = torch.cuda.Stream(d0), torch.cuda.Stream(d1)

            def sync():
                torch.cuda.synchronize(d0)
                torch.cuda.synchronize(d1)

            def one_way():
                with torch.cuda.stream(s0):
                    b1.copy_(a0, non_blocking=True)

            def both_ways():
                with torch.cuda.stream(s0):
                    b1.copy_(a0, non_blocking=True)
                with torch.cuda.stream(s1):
                    b0.copy_(a1, non_blocking=True)

            for name, fn, moved in (("one_way_gb_s", one_way, nbytes), ("both_ways_gb_s", both_ways, 2 * nbytes)):
                for _ in range(3):
                    fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync()
                result[name] = moved * iters / (time.perf_counter() - t0) / 1e9
            result["per_direction_both_ways_gb_s"] = result["both_ways_gb_s"] / 2
            del a0, a1, b0, b1
            torch.cuda.empty_cache()
        except Exception as exc:
            result["error"] = _error_text(exc)
    ctx.barrier()
    return ctx.gather(result)[0]


# ---------------------------------------------------------------- --check


def run_check(args, ctx: Context) -> bool:
    """Every variant against reference_local: outputs and gradients."""
    ok_all = True
    lines = []
    gate_up_all, down_all = expert_weights(ctx, range(ctx.experts))
    lo, hi = ctx.expert_range.start, ctx.expert_range.stop
    for tokens in args.tokens:
        ctx.tokens = tokens
        base = make_inputs(ctx, tokens)
        references: dict[int | None, dict] = {}

        def reference(capacity):
            if capacity not in references:
                inp = base.clone()
                full = [t.detach().clone().requires_grad_() for t in (gate_up_all, down_all)]
                out = reference_forward(inp, *full, ctx.topk, capacity)
                torch.autograd.backward(out, inp.grad_out)
                grads = {"x": inp.x.grad, "router": inp.router.grad}
                # The local experts' gradient sums every rank's tokens.
                for name, t in zip(("gate_up", "down"), full):
                    g = t.grad.clone()
                    dist.all_reduce(g, group=ctx.group)
                    grads[name] = g[lo:hi]
                references[capacity] = {"out": out.detach(), **grads}
            return references[capacity]

        for v in all_variants(args, ctx, check=True):
            failures, error, worst = [], None, 0.0
            try:
                want = reference(v.capacity)
                for mode in v.modes:
                    inp = base.clone()
                    out = v.step(mode)(inp)
                    ctx.sync()
                    got = {"out": out}
                    if mode == "fwd+bwd":
                        got.update(x=inp.x.grad, router=inp.router.grad, gate_up=inp.gate_up.grad, down=inp.down.grad)
                    for what, tensor in got.items():
                        if tensor is None:
                            failures.append(f"{mode} {what}: no gradient")
                            continue
                        ok, err, msg = compare(tensor, want[what], ctx.dtype)
                        worst = max(worst, err)
                        if not ok:
                            failures.append(f"{mode} {what}: {msg}")
            except Exception as exc:
                error = _error_text(exc)
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
            everyone = ctx.gather((failures, error, worst))
            bad = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(everyone) if e]
            bad += [f"rank {r}: {f}" for r, (fs, _, _) in enumerate(everyone) for f in fs]
            passed = not bad
            ok_all &= passed or v.optional
            worst_all = max(w for _, _, w in everyone)
            verdict = "pass" if passed else ("FAIL (optional)" if v.optional else "FAIL")
            lines.append(
                f"| {tokens} | {v.name} | {', '.join(v.modes)} | {verdict} | {worst_all:.2e} | "
                f"{('; '.join(bad) or v.note).replace('|', '/')[:600]} |"
            )
        for line, failed in extra_checks(ctx, base):
            ok_all &= not failed
            lines.append(line)
    if ctx.rank == 0:
        print(
            f"\n# bench_moe --check: {ctx.world} ranks, {describe(ctx)}; {ctx.experts_note}; a2a: {ctx.a2a_impl}"
            + (f"; {ctx.reduce_scatter_fallback}: all-reduce stands in" if ctx.reduce_scatter_fallback else "")
            + "\n\nEach variant against reference_local (torch.testing.assert_close, atol scaled by the expected "
            "tensor's largest magnitude): the forward output, and after fwd+bwd the output and the gradients of "
            "x, the router and the local gate_up and down (the reference's summed over the ranks).\n\n"
            "| tokens | variant | modes | result | max abs err | note |\n|---:|---|---|---|---:|---|\n"
            + "\n".join(lines)
            + f"\n\n{'all checks passed' if ok_all else 'CHECK FAILED'}",
            flush=True,
        )
    return ok_all


def extra_checks(ctx: Context, inputs: Inputs) -> list[tuple[str, bool]]:
    """Rows of the --check table, each with whether it fails the check:
    padded_a2a's slots have static shapes; on CUDA, its forward makes no
    host sync (reported, not fatal: a sync inside NCCL's call would show
    here too; padded_a2a_graph is the capture itself)."""
    out = []
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fake = mode.from_tensor(torch.zeros((ctx.tokens, ctx.topk), dtype=torch.int64, device=ctx.device))
            padded_slots(fake, ctx.experts, ctx.tokens)
        line, failed = "pass | — | padded_slots traced under FakeTensorMode: no data-dependent shape", False
    except Exception as exc:
        line, failed = f"FAIL | — | padded_slots under FakeTensorMode: {_error_text(exc)}", True
    out.append((f"| {ctx.tokens} | padded_slots static shapes | — | {line} |", failed))
    if not ctx.cpu:
        error = None
        try:
            ctx.sync()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.no_grad():
                    padded_forward(ctx, inputs, ctx.tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ctx.sync()
        except Exception as exc:
            error = _error_text(exc)
        errors = agree(ctx, error)
        note = "; ".join(errors) or 'forward under torch.cuda.set_sync_debug_mode("error"): no host sync'
        result = "FAIL (optional)" if errors else "pass"
        out.append(
            (f"| {ctx.tokens} | padded_a2a no host sync | fwd | {result} | — | {note.replace('|', '/')} |", False)
        )
    return out


# ---------------------------------------------------------------- reporting


def describe(ctx: Context) -> str:
    return (
        f"hidden {ctx.hidden}, ffn {ctx.ffn}, {ctx.experts} experts ({ctx.local_experts} a rank), top {ctx.topk}, "
        f"{str(ctx.dtype).removeprefix('torch.')}, {dist.get_backend(ctx.group)}"
    )


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _num(value) -> str:
    """One decimal, or three significant digits below 10 (the --cpu form's tiny transfers)."""
    if value is None:
        return "—"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def md_header(record: dict) -> str:
    env, ce = record["environment"], record.get("copy_engine", {})
    lines = [
        f"# Expert-parallel MoE layer on {env['machine']}",
        "",
        f"{env['date'][:10]}, `tools/bench_moe.py`. Per rank: T tokens, {env['shapes']}; {env['experts_note']}; "
        f"all-to-all: {env['a2a_impl']}.",
        "",
    ]
    if "one_way_gb_s" in ce:
        lines.append(
            f"Copy-engine peer bandwidth, cuda:0 → cuda:1, {ce['bytes'] / 2**30:g} GiB copies (`dst.copy_(src)`, "
            f"P2P access {'on' if ce['p2p'] else 'off'}): {ce['one_way_gb_s']:.1f} GB/s one way, "
            f"{ce['per_direction_both_ways_gb_s']:.1f} GB/s per direction both ways at once."
        )
    else:
        lines.append(f"Copy-engine peer bandwidth: not measured ({ce.get('skipped') or ce.get('error')}).")
    return "\n".join(lines) + "\n"


def md_section(block: dict, ce_gb_s: float | None) -> str:
    lines = [
        f"## T = {block['tokens']} tokens per rank",
        "",
        "| variant | fwd ms | fwd host ms | fwd speedup vs torchtitan | fwd+bwd ms | fwd+bwd host ms "
        "| fwd+bwd speedup vs torchtitan | match | note |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    for row in block["rows"]:
        cells = []
        for mode in MODES:
            m = row.get(mode, {})
            cells += [
                _fmt(m.get("ms"), ".3f"),
                _fmt(m.get("host_ms"), ".3f"),
                _fmt(m.get("speedup_vs_torchtitan"), ".3f"),
            ]
        match = {True: "yes", False: "no"}.get(row.get("match"), "—")
        note = row["note"] if row["status"] == "ok" else f"{row['status']}; {row['note']}".rstrip("; ")
        lines.append(f"| {row['variant']} | {' | '.join(cells)} | {match} | {note.replace('|', '/')} |")
    lines += [
        "",
        "| transfer | ms | host ms | MB to other ranks (mean a rank) | GB/s | % of CE peer (one way) "
        "| tokens' GB/s (padded) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in block["comm"]:
        if "skipped" in c:
            lines.append(f"| {c['transfer']} | skipped: {c['skipped']} | | | | | |")
            continue
        pct = f"{100 * c['gb_s'] / ce_gb_s:.0f}%" if ce_gb_s else "—"
        lines.append(
            f"| {c['transfer']} | {c['ms']:.3f} | {c['host_ms']:.3f} | {_num(c['bytes_off_rank'] / 1e6)} "
            f"| {_num(c['gb_s'])} | {pct} | {_num(c.get('token_gb_s'))} |"
        )
    return "\n".join(lines) + "\n"


def md_footer(record: dict) -> str:
    env, a = record["environment"], record["args"]
    lines = [
        f"ms: per call, CUDA events around windows of {a['iters']} calls (wall clock on the CPU) after "
        f"{a['warmup']} warm-ups, the ranks synchronized and at a (gloo) barrier before each window, the "
        f"variants' windows interleaved; per window the slowest rank, median of {a['repeats']} windows. host ms: "
        "time.perf_counter around one call issued onto an idle device (synchronized and at a barrier first; "
        f"{a['iters']} such calls after the windows), median, slowest rank (torchtitan's includes "
        "its .tolist() of the split sizes, allgather_rs's its nonzero, hostir_exact's its read of the counts). fwd rows run under torch.no_grad(); "
        "fwd+bwd clears the gradients, runs the forward and torch.autograd.backward. speedup vs torchtitan: "
        "torchtitan's ms / the row's. match: the forward output equals torchtitan's on every rank (bf16 or "
        "float32 tolerances). Transfers: all_to_all_single alone, dispatch [T*k, H] with this routing's splits "
        "and combine [received, H] back, and the padded buffer [E*C, H] of equal splits; GB/s = bytes a rank "
        "sends to the other ranks (mean over ranks) / ms; tokens' GB/s counts only the rows of tokens routed to "
        "other ranks (drops not subtracted).",
        "",
        f"- device: {env['device']} ({env['gpu_count']} GPUs visible, {env['world_size']} ranks, {env['backend']})",
        f"- torch: {env['torch']}, CUDA: {env['cuda']}, NCCL: {env['nccl']}, python: {env['python']}, "
        f"launcher: {env['launcher']}, host: {env['host']}",
        f"- date (UTC): {env['date']}",
        f"- run: `{env['command']}`",
    ]
    lines += [f"- {n}" for n in env.get("notes", [])]
    return "\n".join(lines) + "\n"


def markdown(record: dict) -> str:
    ce_gb_s = record.get("copy_engine", {}).get("one_way_gb_s")
    parts = [md_header(record)] + [md_section(b, ce_gb_s) for b in record["tokens"]] + [md_footer(record)]
    return "\n".join(parts)


def plot(record: dict, path: pathlib.Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # matplotlib is optional
        return f"no plot: matplotlib unavailable ({exc})"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(dict.fromkeys(r["variant"] for b in record["tokens"] for r in b["rows"]))
    for ax, mode in zip(axes, MODES):
        for name in names:
            pts = [
                (b["tokens"], r[mode]["ms"])
                for b in record["tokens"]
                for r in b["rows"]
                if r["variant"] == name and mode in r
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ticks = [b["tokens"] for b in record["tokens"]]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("ms per call")
        ax.set_title(mode)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Expert-parallel MoE layer, {record['environment']['machine']}: {record['environment']['shapes']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def write(record: dict, out_dir: pathlib.Path, tag: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"moe_{tag}"
    # Write then rename, so that a run cut short never leaves a torn file.
    for path, text in (
        (stem.with_suffix(".md"), markdown(record)),
        (stem.with_suffix(".json"), json.dumps(record, indent=1, default=str) + "\n"),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    print(plot(record, stem.with_suffix(".png")), flush=True)


def environment(args, ctx: Context, notes: list[str]) -> dict:
    names = ctx.gather("cpu" if ctx.cpu else torch.cuda.get_device_name(ctx.device))
    cuda = not ctx.cpu
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a"
    except Exception as exc:
        nccl = f"unknown ({exc})"
    return {
        "machine": f"{ctx.world} × {names[0]}" if cuda else f"CPU, {ctx.world} gloo ranks",
        "tag": args.tag or ("cpu" if ctx.cpu else machine_tag(names)),
        "device": names[0] if cuda else (platform.processor() or "cpu"),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "world_size": ctx.world,
        "backend": dist.get_backend(ctx.group),
        "shapes": describe(ctx),
        "experts_impl": ctx.experts_impl,
        "experts_note": ctx.experts_note,
        "a2a_impl": ctx.a2a_impl,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "n/a",
        "nccl": nccl,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "launcher": "torchrun"
        if "TORCHELASTIC_RUN_ID" in os.environ
        else "mpirun"
        if "OMPI_COMM_WORLD_RANK" in os.environ
        else "env",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["tools/bench_moe.py", *sys.argv[1:]]),
        "notes": notes,
    }


# ---------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokens",
        default=None,
        help="comma list of tokens per rank (default 4096,8192,16384; --cpu 32,64; --check 256)",
    )
    ap.add_argument("--hidden", type=int, default=None, help="H (default 4096; --cpu 32; --check 256)")
    ap.add_argument("--ffn", type=int, default=None, help="F, each expert's intermediate size (default 1536; --cpu 48)")
    ap.add_argument(
        "--experts", type=int, default=None, help="E, divisible by the ranks (default 64; --cpu 8; --check 16)"
    )
    ap.add_argument("--topk", type=int, default=None, help="k experts per token (default 8; --cpu 2; --check 4)")
    ap.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="padded_a2a's C = ceil(factor*T*k/E), pairs past it dropped (default: none, C = T, nothing dropped)",
    )
    ap.add_argument("--dtype", default=None, help="default bfloat16 on GPUs, float32 with --cpu")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per variant first (default 5; --cpu 1)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timed window (default 10; --cpu 2)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed windows per variant, median reported (default 5; --cpu 3)"
    )
    ap.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd (default both)")
    ap.add_argument(
        "--variants", default="", help="comma list of shell patterns: only the matching rows run (default all)"
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also profile one call per variant (the last of --modes) into DIR, a table of ops per variant",
    )
    ap.add_argument("--check", action="store_true", help="check every variant against reference_local; no timing")
    ap.add_argument("--cpu", action="store_true", help="the small form: gloo, float32, CPU, tiny shapes")
    ap.add_argument(
        "--experts-impl",
        choices=("auto", "grouped_mm", "loop"),
        default="auto",
        help="the local experts: torch._grouped_mm where it runs (auto), or a loop of matmuls",
    )
    ap.add_argument("--ce-bytes", type=int, default=2**30, help="bytes per copy of the copy-engine measurement (1 GiB)")
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where rank 0 writes moe_<tag>.{md,json,png} (default $OUT, else benchmarks/results)",
    )
    ap.add_argument("--tag", default=None, help="file name suffix (default: the machine, h100x2, or cpu)")
    ap.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="without a launcher: ranks to start (default 2 with --cpu, else every GPU)",
    )
    ap.add_argument(
        "--time-limit", type=float, default=1800, help="without a launcher: seconds before the ranks are ended (1800)"
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("HOSTIR_TIMEOUT", 300)),
        help="seconds a collective may wait (default $HOSTIR_TIMEOUT, else 300)",
    )
    args = ap.parse_args(argv)

    shapes = CPU_SHAPES if args.cpu else CHECK_SHAPES if args.check else GPU_SHAPES
    for name, default in zip(("tokens", "hidden", "ffn", "experts", "topk"), shapes):
        if getattr(args, name) is None:
            setattr(args, name, default)
    small = args.cpu
    for name, full, tiny in (("warmup", 5, 1), ("iters", 10, 2), ("repeats", 5, 3)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else full)
    try:
        args.tokens = [int(t) for t in str(args.tokens).split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tokens takes a comma list of integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error("--tokens needs at least one count, each at least 1")
    for name in ("hidden", "ffn", "experts", "topk", "iters", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    if args.topk > args.experts:
        ap.error(f"--topk {args.topk} is more than the {args.experts} experts")
    if args.capacity_factor is not None and args.capacity_factor <= 0:
        ap.error("--capacity-factor must be positive")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        ap.error(f"--modes takes a comma list of {MODES}, got {args.modes!r}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.variants and not any(fnmatch.fnmatchcase(BASELINE, p) for p in args.variants):
        args.variants.append(BASELINE)  # the ratio's denominator, and the match column's reference
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        ap.error(f"--dtype {args.dtype!r} is not a torch dtype")
    if not args.cpu and not torch.cuda.is_available():
        ap.error("CUDA is unavailable; pass --cpu for the small gloo form")
    if args.ranks is not None and args.ranks < 1:
        ap.error("--ranks must be at least 1")
    return args


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux's /proc; none found elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def launch(args, argv: list[str]) -> int:
    """Start the ranks under torchrun in a session of their own and end
    every process of it when they exit, fail or run out of time."""
    ranks = args.ranks or (2 if args.cpu else torch.cuda.device_count())
    if not args.cpu and ranks > torch.cuda.device_count():
        print(f"bench_moe: --ranks {ranks} but {torch.cuda.device_count()} GPUs visible", file=sys.stderr)
        return 2
    if args.experts % ranks:
        print(f"bench_moe: --experts {args.experts} is not divisible by the {ranks} ranks", file=sys.stderr)
        return 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        os.path.abspath(__file__),
    ]
    cmd += argv
    env = os.environ.copy()
    env["PYTHONUNBUFFERED"] = "1"
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # keep the gloo ranks off any GPU
    print(f"bench_moe: {' '.join(cmd[1:])} (limit {args.time_limit:.0f} s)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=args.time_limit)
    except subprocess.TimeoutExpired:
        print(f"bench_moe: the ranks ran past --time-limit {args.time_limit:.0f} s; ended", file=sys.stderr, flush=True)
        return 124
    except KeyboardInterrupt as why:
        print(f"bench_moe: interrupted ({why or 'Ctrl-C'}); ending the ranks", file=sys.stderr, flush=True)
        return 130
    finally:
        # torchrun starts each rank in a session of its own: note them before
        # ending torchrun's, and end any that outlive it.
        ranks_left = _descendants(proc.pid)
        kill_session(proc)
        for pid in ranks_left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def init(args) -> Context:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:  # mpirun: torch's env:// variables
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", os.environ.get("HOSTIR_MASTER_ADDR", "127.0.0.1"))
        os.environ.setdefault("MASTER_PORT", os.environ.get("HOSTIR_MASTER_PORT", "29500"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.experts % world:
        raise SystemExit(f"bench_moe: --experts {args.experts} is not divisible by the {world} ranks")
    timeout = timedelta(seconds=args.timeout)
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    ctl = dist.new_group(backend="gloo", timeout=timeout)
    ctx = Context(
        rank,
        world,
        local,
        device,
        getattr(torch, args.dtype),
        args.cpu,
        args.hidden,
        args.ffn,
        args.experts,
        args.topk,
        dist.group.WORLD,
        ctl,
    )
    why = "" if args.experts_impl == "loop" else probe_grouped_mm(device, ctx.dtype, args.hidden, args.ffn)
    # Every rank must take the same path (the loop syncs, the ranks' collectives must pair).
    whys = ctx.gather(why)
    if args.experts_impl == "loop":
        ctx.experts_impl, ctx.experts_note = "loop", "experts: a loop of matmuls (--experts-impl loop)"
    elif any(whys):
        if args.experts_impl == "grouped_mm":
            raise SystemExit(f"bench_moe: --experts-impl grouped_mm: {next(w for w in whys if w)}")
        ctx.experts_impl = "loop"
        ctx.experts_note = f"experts: a loop of matmuls ({next(w for w in whys if w)})"
    else:
        ctx.experts_impl, ctx.experts_note = "grouped_mm", "experts: torch._grouped_mm"
    ctx.a2a_impl = "torch.distributed.nn" if nn_a2a_has_splits() else "function"
    whys = ctx.gather(probe_reduce_scatter(ctx))
    ctx.reduce_scatter_fallback = next((w for w in whys if w), "")
    return ctx


def teardown(ctx: Context) -> None:
    """Destroy the groups, but never hang on it (the results are written)."""

    def give_up():
        print(f"rank {ctx.rank}: process-group teardown did not finish in {TEARDOWN_SECONDS:g} s; exiting", flush=True)
        os._exit(0)

    watchdog = threading.Timer(TEARDOWN_SECONDS, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        ctx.barrier()
        dist.destroy_process_group()
    except Exception as exc:
        print(f"rank {ctx.rank}: teardown: {_error_text(exc)}", file=sys.stderr, flush=True)
    watchdog.cancel()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not launched():
        return launch(args, argv)
    # bench_moe_hostir imports Variant and Inputs from "bench_moe": this module.
    sys.modules.setdefault("bench_moe", sys.modules[__name__])
    ctx = init(args)
    notes = []
    if ctx.reduce_scatter_fallback:
        notes.append(f"{ctx.reduce_scatter_fallback}: an all-reduce and a slice stand in")
    if ctx.rank == 0:
        print(f"bench_moe: {ctx.world} ranks, {describe(ctx)}; {ctx.experts_note}; a2a: {ctx.a2a_impl}", flush=True)
        for n in notes:
            print(f"bench_moe: {n}", flush=True)
    if args.check:
        ok = run_check(args, ctx)
        teardown(ctx)
        return 0 if ok else 1
    record = {
        "environment": environment(args, ctx, notes),
        "args": {k: v for k, v in vars(args).items()},
        "copy_engine": copy_engine_bandwidth(ctx, args.ce_bytes, 20),
        "tokens": [],
    }
    out_dir = pathlib.Path(args.out_dir or os.environ.get("OUT") or DEFAULT_OUT_DIR)
    bad = []
    for tokens in args.tokens:
        block = bench_tokens(args, ctx, tokens)
        record["tokens"].append(block)
        bad += [
            f"{r['variant']}@T={tokens}"
            for r in block["rows"]
            if not r["optional"] and (r["status"].startswith("failed") or r.get("match") is False)
        ]
        if ctx.rank == 0:
            if len(record["tokens"]) == 1:
                print("\n" + md_header(record), flush=True)
            print(md_section(block, record["copy_engine"].get("one_way_gb_s")), flush=True)
            write(record, out_dir, record["environment"]["tag"])
    if ctx.rank == 0:
        print(f"wrote {out_dir / ('moe_' + record['environment']['tag'])}.md and .json", flush=True)
        if bad:
            print(f"FAILED or mismatched: {', '.join(bad)}", flush=True)
    teardown(ctx)
    return 1 if bad else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Under a launcher the groups are gone by now: skip the interpreter's
    # teardown, where NCCL's cached state could still hang a finished rank.
    if launched():
        os._exit(code)
    sys.exit(code)
