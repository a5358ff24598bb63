"""`hostir.offload`: a module run with its weights in host memory gives what
the module gives with its weights in place. A stack of Linear layers and
activations runs as one hostir program (its transfers hoisted, at most two
layers' weights on the device); any other module, such as a Hugging Face
model built from a config, streams per submodule. On the CPU the device
copies are copies, so the whole path runs here."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hostir
from hostir import ir
from hostir.lower import lower
from hostir.lower.hoist_transfers import parse


def stack(layers: int = 3, width: int = 32, bias: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods += [nn.Linear(width, width, bias=bias), nn.GELU() if i % 2 == 0 else nn.ReLU()]
    return nn.Sequential(*mods)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_offloaded_stack_matches_the_module(bias):
    module = stack(bias=bias)
    expected_module = copy.deepcopy(module)
    x = torch.randn(7, 32)
    offloaded = hostir.offload(module, "cpu")
    assert isinstance(offloaded, hostir.OffloadedStack)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(x), expected_module(x))
        # Batched inputs get a program of their own.
        xb = torch.randn(2, 3, 32)
        torch.testing.assert_close(offloaded(xb), expected_module(xb))


def test_offloaded_stack_moves_each_layer_while_the_previous_computes():
    offloaded = hostir.offload(stack(layers=4), "cpu")
    program = lower(offloaded.fusion().fusion).program
    transfers = [e for e in program.exprs if isinstance(e, ir.Transfer)]
    assert len(transfers) == 4
    assert all("hoisted above" in t.schedule for t in transfers[1:])
    assert hostir.check_races(program) == []


def test_nested_sequential_stacks_are_one_program():
    module = nn.Sequential(stack(layers=2), nn.Sequential(nn.Linear(32, 8), nn.Tanh()), nn.Dropout(0.5)).eval()
    expected = copy.deepcopy(module)
    x = torch.randn(4, 32)
    offloaded = hostir.offload(module, "cpu")
    assert isinstance(offloaded, hostir.OffloadedStack)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(x), expected(x))


def test_offloaded_modules_run_inference_only():
    offloaded = hostir.offload(stack(), "cpu")
    with pytest.raises(hostir.UsageError, match="torch.no_grad"):
        offloaded(torch.randn(2, 32))


class Residual(nn.Module):
    """Not a stack: a module that streams per submodule."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.register_buffer("scale", torch.full((32,), 0.5))

    def forward(self, x):
        return x + self.scale * self.down(torch.relu(self.up(self.norm(x))))


def test_any_module_streams_per_submodule():
    torch.manual_seed(0)
    module = Residual()
    expected = copy.deepcopy(module)
    x = torch.randn(5, 32)
    offloaded = hostir.offload(module, "cpu")
    assert offloaded is module
    with torch.no_grad():
        for _ in range(3):  # the first call records the order, the next prefetch by it
            torch.testing.assert_close(offloaded(x), expected(x))
    streamer = module._hostir_streamer
    assert streamer.order == [module.norm, module.up, module.down]
    assert streamer.fetched == {}  # nothing left on the device between calls


def test_hugging_face_model_offloaded_matches_the_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    expected = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 11))
    offloaded = hostir.offload(model, "cpu")
    with torch.no_grad():
        want = expected(ids).logits
        for _ in range(2):
            torch.testing.assert_close(offloaded(ids).logits, want)


def test_offload_refuses_what_is_not_a_module():
    with pytest.raises(hostir.UsageError, match="torch.nn.Module"):
        hostir.offload(lambda x: x)


@pytest.mark.parametrize("hoist", ["auto", "hoist", "hoist:chunks=2", "hoist:chunks=4", "sequential"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_offloaded_stack_keeps_two_layers_weights_whatever_the_chunking(hoist, bias):
    # The dry run follows every device storage until its last view is
    # dropped, as a GPU's allocator does: a weight moved in pieces is
    # freed only once its pieces are.
    layers, width, rows = 4, 64, 8
    offloaded = hostir.offload(stack(layers=layers, width=width, bias=bias), "cpu", hoist=hoist)
    layer = width * width * 4 + (width * 4 if bias else 0)
    assert offloaded.two_layers_bytes() == 2 * layer
    x = torch.randn(rows, width)
    hoisting = offloaded.hoisting(x)
    inputs = [x, *offloaded.host_tensors()]
    peak = offloaded.fusion().dry_run(inputs, hoisting=hoisting)[0].peak_bytes
    sequential = offloaded.fusion().dry_run(inputs, hoisting=parse("sequential"))[0].peak_bytes
    activations = sequential - layer  # the sequential program holds one layer's weights
    assert activations > 0
    assert peak <= 2 * layer + activations, (peak, layer, activations)
    if hoisting.mode == "hoist":
        # And the layers do overlap: the next layer's weights are there.
        assert peak > layer + activations, (peak, layer, activations)


@pytest.mark.cuda
@pytest.mark.parametrize("hoist", ["auto", "hoist", "hoist:chunks=4", "sequential"])
def test_offloaded_stack_on_cuda_keeps_two_layers_weights(cuda_device, hoist):
    module = stack(layers=4, width=256).to(torch.bfloat16)
    expected = copy.deepcopy(module).to(cuda_device)
    offloaded = hostir.offload(module, cuda_device, hoist=hoist)
    assert all(m.weight.is_pinned() for m in offloaded.layers if isinstance(m, nn.Linear))
    x = torch.randn(64, 256, device=cuda_device, dtype=torch.bfloat16)
    with torch.no_grad():
        offloaded(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = offloaded(x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        torch.testing.assert_close(out, expected(x), rtol=2e-2, atol=2e-2)
    weight = 256 * 256 * 2
    activation = 64 * 256 * 2
    assert peak <= 2 * weight + 4 * activation, peak


@pytest.mark.cuda
def test_hugging_face_model_offloaded_on_cuda(cuda_device):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    expected = copy.deepcopy(model).to(cuda_device)
    ids = torch.randint(0, 97, (2, 11), device=cuda_device)
    offloaded = hostir.offload(model, cuda_device)
    with torch.no_grad():
        want = expected(ids).logits
        for _ in range(2):
            torch.testing.assert_close(offloaded(ids).logits, want)


def test_offloaded_stack_in_chunks_matches_the_module():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    expected = copy.deepcopy(module)
    offloaded = hostir.offload(module, "cpu", hoist="hoist:chunks=4")
    with torch.no_grad():
        for x in (torch.randn(2, 3, 32), torch.randn(5, 32)):
            torch.testing.assert_close(offloaded(x), expected(x), rtol=1e-4, atol=1e-5)
    program = lower(offloaded.fusion().fusion, hoisting=parse("hoist:chunks=4")).program
    assert sum(isinstance(e, ir.Transfer) for e in program.exprs) == 2 * 4 + 2  # the weights in pieces, the biases whole


@pytest.mark.cuda
def test_offloaded_stack_from_a_cuda_graph(cuda_device):
    module = stack(layers=3, width=256).to(torch.bfloat16)
    expected = copy.deepcopy(module).to(cuda_device)
    offloaded = hostir.offload(module, cuda_device, cuda_graph=True)
    x = torch.randn(32, 256, device=cuda_device, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):  # capture, then replays
            out = offloaded(x)
        torch.testing.assert_close(out, expected(x), rtol=2e-2, atol=2e-2)
        # The graph reads the pinned weights in place: a change shows.
        offloaded.layers[0].weight.mul_(2.0)
        expected[0].weight.mul_(2.0)
        torch.testing.assert_close(offloaded(x), expected(x), rtol=2e-2, atol=2e-2)
