"""A block of two hostir.parallel Linears (colwise, then rowwise) for the
torch.compile tests, one process and many: the block, its compiled run
with the graph breaks and dynamo warnings it caused, and the comparison of
outputs and gradients."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

# 12 and 24 features divide among 1, 2, 3 and 4 ranks alike.
HIDDEN, FFN = 12, 24


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def parallel_block(base: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hostir.parallel import parallelize_module

    model = copy.deepcopy(base)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def compiled_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, backend: str, fullgraph: bool):
    """One forward and backward of `torch.compile(model)` from a fresh
    dynamo: (output, input gradient, graph breaks, dynamo's warnings)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    warnings = _Warnings()
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(warnings)
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
        xc = x.clone().requires_grad_()
        y = compiled(xc)
        y.backward(grad)
    finally:
        dynamo_log.removeHandler(warnings)
        breaks = dict(counters["graph_break"])
        torch._dynamo.reset()
    return y, xc.grad, breaks, warnings.messages


def eager_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    xe = x.clone().requires_grad_()
    y = model(xe)
    y.backward(grad)
    return y, xe.grad


def parameter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in model.named_parameters()
    }


def assert_same_step(ours, ours_model, ref, ref_model) -> None:
    """Outputs, input gradients and every parameter's gradient alike."""
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1])
    ref_grads = parameter_grads(ref_model)
    for name, g in parameter_grads(ours_model).items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m: f"{name}: {m}")
