"""Run a `torch.nn.Module` with its weights in pinned host memory.

`hostir.offload(module, device)` moves the module's parameters to pinned
host memory (in place: `param.data` becomes the pinned copy, so the host
holds one copy) and returns a module to call on inputs on `device`:

- A stack (`nn.Sequential`, nested or not, of `nn.Linear` and the
  activations hostir has: GELU, ReLU, SiLU, Tanh, Sigmoid, and Identity or
  Dropout in eval mode) becomes one hostir program whose weights are inputs
  in host memory (`memory="host"`): each layer's weights are transfers,
  hoisted by `hoist_transfers` so that layer l+1's move while layer l
  computes, within the budget (by default two layers' weights and biases
  on the device, `OffloadedStack.two_layers_bytes`, whether a weight moves
  whole or in pieces), or left sequential where the machine model says hiding them
  cannot pay. `OffloadedStack.fusion` is the FusionDefinition (its
  `host_ir()` shows the choice).
- Any other module (a Hugging Face model, say) streams per submodule: each
  module that owns parameters gets them on the device just before its
  forward and drops them after it, and the next module's (in the order of
  the first forward) are copied on a copy stream while this one computes,
  so at most this module's and the next one's parameters are on the
  device. Buffers (position ids, norms' statistics) move to the device once.

Offloaded modules run inference: call them under `torch.no_grad()` or
`torch.inference_mode()` (the parameters' device copies live only for one
forward, which autograd would need kept). On a CPU device the "device
copies" are copies on the CPU, so the whole path runs without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from hostir import planner
from hostir.errors import UsageError
from hostir.arguments import host_positions
from hostir.executor import ExecutorParams
from hostir.frontend import FusionDefinition
from hostir.lower.hoist_transfers import ENV
from hostir.runtime import prepared

__all__ = ["OffloadedStack", "offload"]

_MAX_SIGNATURES = 64

_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}


def offload(module: nn.Module, device: torch.device | str | None = None, *, hoist: object = "auto",
            cuda_graph: bool = False) -> nn.Module:
    """`module` with its parameters in pinned host memory, ready to call on
    inputs on `device` (default: the current CUDA device, else the CPU).
    `hoist` is the hoisting of a stack's program (as `execute` takes it);
    `cuda_graph=True` replays a stack's program as a CUDA graph per input
    shape. See the module's docstring for what runs where."""
    if not isinstance(module, nn.Module):
        raise UsageError(f"offload takes a torch.nn.Module, got {type(module).__name__}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    layers = _stack_layers(module)
    if layers is not None:
        return OffloadedStack(layers, device, hoist=hoist, cuda_graph=cuda_graph)
    if cuda_graph:
        raise UsageError("cuda_graph=True is for stacks of Linear layers and activations; this module streams per submodule")
    _ModuleStreamer(module, device)
    return module


def _pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.detach().to("cpu")
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t


# ---------------------------------------------------------------- stacks


def _stack_layers(module: nn.Module) -> list[nn.Module] | None:
    """The layers of a stack of Linear and activations, or None."""
    if not isinstance(module, nn.Sequential):
        return None
    layers: list[nn.Module] = []
    for m in module:
        inner = _stack_layers(m) if isinstance(m, nn.Sequential) else None
        if inner is not None:
            layers += inner
        elif isinstance(m, nn.Linear) or _activation(m) is not None or _is_identity(m):
            layers.append(m)
        else:
            return None
    linears = [m for m in layers if isinstance(m, nn.Linear)]
    if not linears or len({m.weight.dtype for m in linears}) != 1:
        return None
    return layers


def _activation(m: nn.Module) -> str | None:
    if isinstance(m, nn.GELU):
        return "gelu" if m.approximate == "none" else None
    return next((kind for cls, kind in _ACTIVATIONS.items() if isinstance(m, cls)), None)


def _is_identity(m: nn.Module) -> bool:
    return isinstance(m, nn.Identity) or (isinstance(m, nn.Dropout) and not m.training)


class OffloadedStack(nn.Module):
    """A stack of Linear layers and activations run as one hostir program
    with its weights in pinned host memory (see `hostir.offload`)."""

    def __init__(self, layers: list[nn.Module], device: torch.device, hoist: object = "auto", cuda_graph: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.device = device
        self.hoist = hoist
        self.cuda_graph = cuda_graph
        self.dtype = next(m.weight.dtype for m in layers if isinstance(m, nn.Linear))
        for m in layers:
            for p in m.parameters(recurse=False):
                p.data = _pin(p.data, device)
        self._fusions: dict[int, FusionDefinition] = {}
        # The hoisting per input signature (shape, dtype, device, option):
        # chosen once, not on every call.
        self._hoistings: dict[tuple, Any] = {}
        # The detached weights and biases, and what they were detached from
        # (`host_tensors`).
        self._host_kept: tuple[list, list] | None = None

    def host_tensors(self) -> list[torch.Tensor]:
        """The weights and biases in host memory, in the program's order.

        Detached once and kept while they still are the parameters' data:
        each call checks that every Linear still holds the same parameter
        objects (and no bias appeared or went) and that each parameter still
        has the memory, sizes and strides of its detached tensor
        (`Tensor.is_set_to`). An update in place is seen through the shared
        memory; `p.data = ...` or a new parameter makes the list anew."""
        kept = self._host_kept
        if kept is not None:
            tensors, held = kept
            for owned, name, p, detached in held:
                if owned.get(name) is not p or (p is not None and not p.is_set_to(detached)):
                    break
            else:
                return list(tensors)
        tensors, held = [], []
        for m in self.layers:
            if isinstance(m, nn.Linear):
                for name in ("weight", "bias"):
                    p = getattr(m, name)
                    detached = None if p is None else p.detach()
                    held.append((m._parameters, name, p, detached))
                    if detached is not None:
                        tensors.append(detached)
        self._host_kept = (tensors, held)
        return list(tensors)

    def fusion(self, ndim: int = 2) -> FusionDefinition:
        """The program for inputs of `ndim` dims (built on first use)."""
        fd = self._fusions.get(ndim)
        if fd is None:
            fd = self._fusions[ndim] = self._define(ndim)
        return fd

    def _define(self, ndim: int) -> FusionDefinition:
        first = next(m for m in self.layers if isinstance(m, nn.Linear))
        with FusionDefinition() as fd:
            y = fd.define_tensor([-1] * (ndim - 1) + [first.in_features], self.dtype)
            for m in self.layers:
                if isinstance(m, nn.Linear):
                    w = fd.define_tensor([m.out_features, m.in_features], self.dtype, memory="host")
                    b = None if m.bias is None else fd.define_tensor([m.out_features], self.dtype, memory="host")
                    y = fd.ops.linear(y, w, b)
                elif (kind := _activation(m)) is not None:
                    y = getattr(fd.ops, kind)(y)
            fd.add_output(y)
        return fd

    def two_layers_bytes(self) -> int:
        """The bytes of the two consecutive Linear layers' weights and
        biases that weigh most: the default budget of the hoisting, so that
        at most two layers' weights are on the device at once."""
        sizes = [
            sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            for m in self.layers
            if isinstance(m, nn.Linear)
        ]
        return max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0])

    def hoisting(self, x: torch.Tensor) -> Any:
        """The `Hoisting` a call on `x` runs with (forced, or the machine
        model's choice for its shape): sequential, hoisted, or in chunks,
        within two layers' weights (`two_layers_bytes`) unless the hoisting
        names a budget of its own."""
        key = (x.shape, x.dtype, x.device, self.hoist, prepared.environ(ENV))
        chosen = self._hoistings.get(key)
        if chosen is None:
            if len(self._hoistings) >= _MAX_SIGNATURES:
                self._hoistings.pop(next(iter(self._hoistings)))
            chosen = self._hoistings[key] = self._choose_hoisting(x)
        return chosen

    def _choose_hoisting(self, x: torch.Tensor) -> Any:
        fd = self.fusion(x.dim())
        inputs = [x.to(self.dtype), *self.host_tensors()]
        host = host_positions(fd.fusion, inputs)
        # As a call would run it: on the C++ executor unless told otherwise.
        cpp_posts = ExecutorParams().evaluator_choice()[0] == "cpp"
        chosen = planner.hoisting_for_inputs(fd.fusion, inputs, x.device, None, host, self.hoist, cpp_posts=cpp_posts)
        if chosen is not None and chosen.mode == "hoist" and chosen.budget_bytes is None:
            chosen = dataclasses.replace(chosen, budget_bytes=self.two_layers_bytes())
        return chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise UsageError(f"an offloaded stack takes a tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise UsageError(f"the input is on {x.device} but the stack runs on {self.device}; move it there first")
        _inference_only(self)
        params: dict[str, Any] = {"hoist": self.hoisting(x)}
        if self.cuda_graph:
            params["cuda_graph"] = True
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        (out,) = self.fusion(x.dim()).execute([x, *self.host_tensors()], **params)
        return out


def _inference_only(module: nn.Module) -> None:
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        raise UsageError(
            "offloaded modules run inference: call them under torch.no_grad() or torch.inference_mode()"
        )


# ---------------------------------------------------------------- any module


class _ModuleStreamer:
    """Per-submodule streaming of a module's parameters (see the module's
    docstring): hooks on every submodule that owns parameters."""

    def __init__(self, root: nn.Module, device: torch.device):
        self.root = root
        self.device = device
        self.units = [m for m in root.modules() if next(m.parameters(recurse=False), None) is not None]
        self.host: dict[int, torch.Tensor] = {}
        for m in self.units:
            for p in m.parameters(recurse=False):
                if id(p) not in self.host:
                    p.data = self.host[id(p)] = _pin(p.data, device)
        for m in root.modules():
            for name, b in list(m.named_buffers(recurse=False)):
                if b is not None:
                    setattr(m, name, b.to(device))
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # param id -> (device copy, event of its copy or None)
        self.fetched: dict[int, tuple[torch.Tensor, Any]] = {}
        self.order: list[nn.Module] = []
        self.recording = True
        self.position = 0
        root.register_forward_pre_hook(self._begin)
        root.register_forward_hook(self._end)
        for m in self.units:
            m.register_forward_pre_hook(self._before)
            m.register_forward_hook(self._after)
        root._hostir_streamer = self

    def _begin(self, module, args):
        _inference_only(self.root)
        self.position = 0
        if self.order:
            self.recording = False
            self._fetch(self.order[0])

    def _end(self, module, args, out):
        self.recording = False

    def _fetch(self, unit: nn.Module) -> None:
        """Post the copies of `unit`'s parameters that are not on the device."""
        current = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for p in unit.parameters(recurse=False):
            if id(p) in self.fetched:
                continue
            host = self.host[id(p)]
            if current is None:
                self.fetched[id(p)] = (host.clone(), None)
                continue
            # Allocated on the compute stream, which frees it after use; the
            # copy stream starts after the work already enqueued there.
            copy = torch.empty_like(host, device=self.device)
            self.copy_stream.wait_stream(current)
            with torch.cuda.stream(self.copy_stream):
                copy.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self.fetched[id(p)] = (copy, event)

    def _before(self, unit, args):
        if self.recording:
            self.order.append(unit)
        elif self.position < len(self.order) and self.order[self.position] is unit:
            self.position += 1
            if self.position < len(self.order):
                following = self.order[self.position]
                self._fetch(unit)
                self._fetch(following)
        self._fetch(unit)
        current = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for p in unit.parameters(recurse=False):
            copy, event = self.fetched[id(p)]
            if event is not None:
                current.wait_event(event)
            p.data = copy

    def _after(self, unit, args, out):
        for p in unit.parameters(recurse=False):
            p.data = self.host[id(p)]
            self.fetched.pop(id(p), None)
