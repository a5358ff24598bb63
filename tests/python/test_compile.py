"""torch.compile over hostir.parallel Linears in one process (a mesh of
rank 0): each Linear is one opaque op (`torch.ops.hostir.linear`, its
backward `torch.ops.hostir.linear_backward`), so dynamo traces no hostir
code: no graph break, no dynamo warning, and `fullgraph=True` compiles.
Outputs and gradients against eager hostir and eager torch, random data.
The same at 2 to 4 ranks: tests/python/multidevice/test_compile.py."""

from __future__ import annotations

import pytest
import torch

from compiled_blocks import HIDDEN, Block, assert_same_step, compiled_step, eager_step, parallel_block
from one_rank_linears import MESH


@pytest.fixture
def block(plain_process):
    torch.manual_seed(0)
    return Block()


def test_a_compiled_block_has_no_graph_break_and_no_dynamo_warning(block):
    model = parallel_block(block, MESH.to_torch("cpu"))
    x, grad = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    _, _, breaks, warnings = compiled_step(model, x, grad, backend="eager", fullgraph=False)
    assert breaks == {}
    assert warnings == []


def test_a_compiled_block_matches_eager_hostir_and_eager_torch(block):
    mesh = MESH.to_torch("cpu")
    compiled_model, eager_model = parallel_block(block, mesh), parallel_block(block, mesh)
    x, grad = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    ours = compiled_step(compiled_model, x, grad, backend="aot_eager", fullgraph=True)
    assert ours[2] == {}
    assert_same_step(ours, compiled_model, eager_step(eager_model, x, grad), eager_model)
    assert_same_step(ours, compiled_model, eager_step(block, x, grad), block)


def test_the_compiled_op_runs_the_linears_program(block):
    # The op is hostir's program, not a stand-in: an input the program
    # refuses is refused with the module's name.
    from hostir.errors import HostIrError

    model = parallel_block(block, MESH.to_torch("cpu"))
    up = model.up
    with pytest.raises(HostIrError) as err:
        torch.ops.hostir.linear(up._hostir_linear.handle, torch.randn(4, HIDDEN + 1), up.weight.to_local(), None, -1)
    assert "in module 'up' (colwise nn.Linear, hostir.parallel)" in "\n".join(err.value.__notes__)
