"""Reverse-mode differentiation of a fusion: its backward is another fusion.

`derive(fusion, wrt)` returns a `Derivation`:

- `forward`: a copy of the fusion whose outputs are the user's, then the
  intermediates the backward reads (saved between the two programs);
- `backward`: an ordinary `Fusion` whose inputs are the cotangents of the
  forward's outputs, then the saved forward inputs and intermediates (and
  scalar inputs an op reads), and whose outputs are the gradients of the
  inputs `wrt`.

Both go through the same lowering as any fusion (stream and ring
decompositions, dry run, race check, both evaluators, dumps).

The derivative is of the fusion's math on whole tensors; the shardings only
say where the pieces live. Each cotangent is sharded as its primal (the
forward tensor it is the gradient of, as sharding propagation placed it), so
the backward's lowering inserts the communications that transpose the
forward's: a sequence-parallel input gathered before a column-parallel
linear gets its gradient through partial sums and a ReduceScatter (where
the forward walked the sequence, a GEMM+ReduceScatter ring walking it
too: the product reads the output's cotangent a second time, as a backward
input split as the forward walked it, see `derivation.Deriver.walking`); a
row-parallel linear's replicated output gives a replicated cotangent that
each rank multiplies by its own rows, and its sequence-sharded output a
cotangent gathered once for both products (walking the sequence where the
forward walked it: an AG+GEMM ring, see `derivation.Deriver.gathered_walking`). A
resharding `set` has no op in the
backward: the cotangent of its output is made directly in its input's
sharding. Where a contraction is sharded on a mesh dimension that another
axis of the same product also uses (a weight gradient of a sequence-parallel
layer), the rule gathers that operand first, once per tensor.

What the forward saves: the inputs the rules read are passed as they are
(each rank's shard); an operand that the forward gathered with a `set` is
saved as the shard and gathered again in the backward (where a stream axis
on the gathered tensor makes it a ring overlapped with the first backward
matmul), unless `keep_gathered` asks for the gathered tensor itself. A
`set` that only moves a sharded axis (an all-to-all) makes a tensor no
larger than its input's shard: that tensor is saved, and nothing is sent
again.

Rules: set; every unary kind, by the gradient its declaration carries
(`UnaryKind.grad`, `hostir.kinds`); binary add, sub, mul, div (with
broadcasting); sum, max, min (ties share the gradient equally, as torch's
amax/amin do); matmul (a weight broadcast over batch axes gets its gradient summed over
them); linear (bias included); permute, reshape, slice, select,
broadcast_in_dim and expand; take and put_add (each the other's
transpose); topk and route, whose integer outputs carry no gradient. An op without a rule is a
`NoTransposeRuleError` naming the op's dump line when the backward is first
derived.

The pass is split in two: `derivation.py` holds the walk and its state
(`Deriver`, `Layout`, `Derivation`), `transpose_rules.py` the rule of each
op class, which `derive` hands to the walk.
"""

from __future__ import annotations

from hostir import ir, transpose_rules
from hostir.derivation import Derivation, Deriver, NoTransposeRuleError
from hostir.errors import HostIrError

__all__ = ["BackwardError", "Derivation", "NoTransposeRuleError", "derive"]


class BackwardError(HostIrError, RuntimeError):
    """A backward that cannot run as asked (double backward, a released graph)."""


def derive(fusion: ir.Fusion, wrt, keep_gathered: bool = False) -> Derivation:
    """The training forward and the backward of `fusion` for the gradients of
    its inputs at positions `wrt`."""
    return Deriver(fusion, list(wrt), keep_gathered).run(transpose_rules.RULES)
