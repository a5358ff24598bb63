"""The host program: `HostIrContainer` and its alias map.

A container owns an ordered list of top-level exprs (loop bodies nest), the
program's inputs and outputs, and the map that makes one TensorView use
another's buffer. `verify` checks what every pass must leave true.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from hostir import ir, printer, unannotated
from hostir.errors import DefinitionTypeError, HostIrError


class AliasError(HostIrError, ValueError):
    pass


class AliasMap:
    """Which TensorViews use another's buffer.

    `mark(original, alias)` records one edge alias → original; reading or
    binding an alias reads or binds the end of its chain. Chains resolve in
    whichever order their edges were marked. An alias has one original; a
    cycle is an error.
    """

    def __init__(self):
        self._edges: dict[ir.TensorView, ir.TensorView] = {}

    def mark(self, original: ir.TensorView, alias: ir.TensorView) -> None:
        for v, role in ((original, "original"), (alias, "alias")):
            if not isinstance(v, ir.TensorView):
                raise DefinitionTypeError(f"only TensorViews can be aliased; the {role} is {type(v).__name__}")
        if alias is original:
            raise AliasError(f"T{alias.name} cannot be an alias of itself")
        if alias.dtype != original.dtype or alias.ndim != original.ndim:
            raise AliasError(
                f"T{alias.name} ({alias.dtype}, {alias.ndim} axes) cannot alias "
                f"T{original.name} ({original.dtype}, {original.ndim} axes): dtype and rank must match"
            )
        known = self._edges.get(alias)
        if known is not None and known is not original:
            raise AliasError(f"T{alias.name} is already an alias of T{known.name}")
        chain = [original]
        while chain[-1] in self._edges:
            chain.append(self._edges[chain[-1]])
            if chain[-1] is alias:
                path = " -> ".join(f"T{t.name}" for t in [alias] + chain)
                raise AliasError(f"marking T{alias.name} as an alias of T{original.name} forms a cycle: {path}")
        self._edges[alias] = original

    def resolve(self, tv):
        """The TensorView whose buffer `tv` uses (itself if not an alias)."""
        while tv in self._edges:
            tv = self._edges[tv]
        return tv

    def is_alias(self, tv) -> bool:
        return tv in self._edges

    def items(self) -> list[tuple[ir.TensorView, ir.TensorView]]:
        """(alias, original) edges in the order they were marked."""
        return list(self._edges.items())

    def resolved(self) -> dict[ir.TensorView, ir.TensorView]:
        """Every alias mapped straight to the end of its chain."""
        return {a: self.resolve(a) for a in self._edges}

    def __len__(self) -> int:
        return len(self._edges)


class VerifyError(HostIrError, ValueError):
    pass


class HostIrContainer(ir.IrContainer):
    """A host program. Built by `lower` from a fusion, or by hand in tests."""

    def __init__(self, counters: dict[str, int] | None = None):
        super().__init__(counters)
        self.inputs: list[ir.TensorView] = []
        self.outputs: list[ir.TensorView] = []
        self.exprs: list[ir.Expr] = []
        self.aliases = AliasMap()
        self._named: dict[str, ir.Scalar] = {}
        # What the program runs, for its trace events: set by the executor
        # that lowered it from its label ("(q, colwise nn.Linear)" for a
        # hostir.parallel Linear), empty for a plain fusion.
        self.label = ""

    def derive(self) -> HostIrContainer:
        """An empty program with this one's inputs, outputs, aliases, named
        scalars and name counters: what a pass fills with its new list."""
        new = HostIrContainer(counters=self._counters)
        new.inputs, new.outputs = list(self.inputs), list(self.outputs)
        new.aliases = self.aliases
        new._named = self._named
        return new

    # -- building
    def add_input(self, tv: ir.TensorView) -> None:
        self.check_inputs_unaliased(inputs=[tv])
        self.inputs.append(tv)

    def add_output(self, tv: ir.TensorView) -> None:
        self.outputs.append(tv)

    def push_back(self, e: ir.Expr) -> None:
        self.exprs.append(e)

    def mark_alias(self, original: ir.TensorView, alias: ir.TensorView) -> None:
        """`alias` uses `original`'s buffer from now on."""
        if alias in self.inputs:
            raise AliasError(f"Inputs cannot be aliased: T{alias.name} is an input")
        self.aliases.mark(original, alias)

    def named_scalar(self, name: str) -> ir.Scalar:
        """The one scalar of this program called `name` (bound per run)."""
        s = self._named.get(name)
        if s is None:
            s = self._named[name] = ir.Scalar(label=name)
        return s

    def named_scalars(self) -> dict[str, ir.Scalar]:
        return dict(self._named)

    def walk(self) -> Iterator[ir.Expr]:
        return ir.walk(self.exprs)

    def teams(self) -> list[tuple[int, ...]]:
        """The teams of the program's communications, sorted: the process
        groups every rank creates, in this order, before the first run."""
        found = {tuple(e.team) for e in self.walk() if isinstance(e, ir.Communication)}
        return sorted(found, key=lambda t: (len(t), t))

    def meshes(self) -> list[ir.DeviceMesh]:
        found = {}
        for tv in self.inputs + self.outputs:
            if isinstance(tv, ir.TensorView) and tv.mesh is not None:
                found[tv.mesh] = None
        for e in self.walk():
            for v in e.inputs() + e.outputs():
                if isinstance(v, ir.TensorView) and v.mesh is not None:
                    found[v.mesh] = None
        return list(found)

    def __str__(self) -> str:
        return printer.print_container(self)

    # -- checking
    def verify(self, rank: int | None = None) -> None:
        """Raise VerifyError unless every TensorView an expr reads is bound
        before it (an input, or defined earlier in an enclosing scope),
        every output is defined, no input is an alias, and every
        communication says, by annotations or by its type and team, which
        piece each rank holds (`hostir.unannotated`). `rank`: the rank the
        program is pruned for, if it is: a tensor that rank does not hold
        need not be defined."""
        self.check_inputs_unaliased(VerifyError)
        resolve = self.aliases.resolve
        defined = {resolve(t) for t in self.inputs}
        self._verify_scope(self.exprs, defined, resolve, rank)
        for e in self.walk():
            if isinstance(e, ir.Communication):
                try:
                    unannotated.check(e)
                except unannotated.UnannotatedCommunicationError as err:
                    raise VerifyError(str(err)) from err
        for tv in self.outputs:
            if not tv.held_by(rank):
                continue
            if resolve(tv) not in defined:
                raise VerifyError(f"output {printer.format_tv(tv)} is never defined")

    def check_inputs_unaliased(self, error: type[Exception] | None = None, inputs=None) -> None:
        """Raise `error` (AliasError by default) if an input (of `inputs`,
        by default the program's) is an alias: an input is bound by the
        caller, so its buffer is its own."""
        for tv in self.inputs if inputs is None else inputs:
            if self.aliases.is_alias(tv):
                raise (error or AliasError)(f"Inputs cannot be aliased: T{tv.name} is an alias")

    def _verify_scope(self, exprs: Sequence[ir.Expr], defined: set, resolve, rank: int | None) -> None:
        for e in exprs:
            for v in ir.read_vals(e):
                if isinstance(v, ir.TensorView) and resolve(v) not in defined and v.held_by(rank):
                    raise VerifyError(
                        f"{printer.format_tv(v)} is read before it is defined, by:\n"
                        f"{printer.format_expr_head(e)}"
                    )
            # A loop may run zero times and a branch may not run: what
            # their bodies define is not visible after them.
            for body in ir.bodies(e):
                self._verify_scope(body, set(defined), resolve, rank)
            defined.update(resolve(t) for t in ir.defined_tvs(e))


def body_locals(container: HostIrContainer) -> dict[int, list]:
    """For each loop, the buffers first defined in its body (unbound at
    every iteration so that each writes fresh ones); program inputs and
    outputs excepted, since the caller may bind those."""
    resolve = container.aliases.resolve
    keep = {resolve(t) for t in container.inputs + container.outputs}
    found: dict[int, list] = {}

    def scan(exprs, before: set) -> None:
        # `before`: buffers bound ahead of this scope; an op in a loop
        # that writes one of them (a communication into a slice made
        # outside) writes it, it does not define a fresh one.
        seen = set(before)
        for e in exprs:
            if isinstance(e, ir.ForLoop):
                local = {resolve(t) for inner in ir.walk(e.body) for t in ir.defined_tvs(inner)}
                found[id(e)] = list(local - keep - seen)
                scan(e.body, seen)
            elif isinstance(e, ir.IfThenElse):
                scan(e.then_body, seen)
                scan(e.else_body, seen)
            seen.update(resolve(t) for t in ir.defined_tvs(e))

    scan(container.exprs, set())
    return found
