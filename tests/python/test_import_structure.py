"""The package's import structure, read from its source with `ast`: no
import circle between its modules, and the run machinery below everything
that builds programs.

Every import counts, those made inside a function included: an import
moved into a function to dodge a circle is still a circle. The only
exceptions are listed in ALLOWED, each with its reason, and are limited to
function-level imports of optional dependencies.
"""

from __future__ import annotations

import ast
import pathlib

import hostir

PACKAGE = pathlib.Path(hostir.__file__).parent

# (importing module, imported module) -> why a function-level import of it
# is allowed even where it would close a circle. Only optional dependencies.
ALLOWED: dict[tuple[str, str], str] = {}

# Compiled modules of the package (the C++ core): leaves of the graph.
EXTENSIONS = {"hostir._C"}

# hostir.runtime is what one call passes through; it sits below whatever
# builds or checks programs and imports none of it.
RUNTIME = "hostir.runtime"
ABOVE_RUNTIME = ("hostir.executor", "hostir.frontend", "hostir.lower", "hostir.analysis")


def _modules(package: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


class _Imports(ast.NodeVisitor):
    """The hostir modules one module imports, each with its line and
    whether the import is made inside a function."""

    def __init__(self, name: str, is_package: bool, modules):
        self.name = name
        self.package = name if is_package else name.rpartition(".")[0]
        self.modules = modules
        self.found: list[tuple[str, int, bool]] = []
        self._depth = 0

    def _resolve(self, dotted: str) -> str | None:
        while dotted and dotted not in self.modules and dotted not in EXTENSIONS:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _add(self, dotted: str, node: ast.AST) -> None:
        if dotted != "hostir" and not dotted.startswith("hostir."):
            return
        target = self._resolve(dotted)
        if target is not None and target != self.name:
            self.found.append((target, node.lineno, self._depth > 0))

    def visit_FunctionDef(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            # `from hostir import layout` imports the module hostir.layout;
            # `from hostir import HostIrError` imports the package.
            full = f"{module}.{alias.name}"
            self._add(full if full in self.modules or full in EXTENSIONS else module, node)


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported module, line, inside a function)]."""
    modules = _modules(package)
    graph = {}
    for name, (path, is_package) in sorted(modules.items()):
        visitor = _Imports(name, is_package, modules)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = visitor.found
    return graph


def cycles(graph: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (and any
    module importing itself), each as a sorted list: every circle lies in
    one of them."""
    edges = {
        m: sorted({t for t, _, inside in found if not (inside and (m, t) in ALLOWED)})
        for m, found in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _describe(graph, component: list[str]) -> str:
    inside = set(component)
    lines = [" <-> ".join(component)]
    for m in component:
        for t, line, in_function in graph[m]:
            if t in inside:
                where = "inside a function" if in_function else "at module level"
                lines.append(f"  {m} imports {t} (line {line}, {where})")
    return "\n".join(lines)


def test_the_package_has_no_import_circle():
    graph = import_graph()
    for (module, target), reason in ALLOWED.items():
        imports = [inside for t, _, inside in graph.get(module, []) if t == target]
        assert reason and imports, f"ALLOWED names {module} -> {target}, which is not imported: drop the entry"
        assert all(imports), f"ALLOWED names {module} -> {target}, imported at module level"
    found = cycles(graph)
    assert not found, "import circles in the package:\n" + "\n".join(_describe(graph, c) for c in found)


def test_the_runtime_imports_nothing_that_builds_programs():
    graph = import_graph()
    runtime = [m for m in graph if m == RUNTIME or m.startswith(RUNTIME + ".")]
    assert runtime, "hostir.runtime is missing"
    climbs = [
        f"{m} imports {t} (line {line})"
        for m in runtime
        for t, line, _ in graph[m]
        if any(t == above or t.startswith(above + ".") for above in ABOVE_RUNTIME)
    ]
    assert not climbs, "hostir.runtime imports code above it:\n" + "\n".join(climbs)


def test_the_checker_finds_a_circle_closed_inside_a_function(tmp_path):
    """The checker itself: a circle whose second import is made inside a
    function is found, and so is one through a package's `__init__`."""
    package = tmp_path / "hostir"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from hostir import b\n")
    (package / "b.py").write_text("def f():\n    from hostir.a import thing\n")
    (package / "sub" / "__init__.py").write_text("from hostir.sub.c import x\n")
    (package / "sub" / "c.py").write_text("from . import d\n")
    (package / "sub" / "d.py").write_text("def g():\n    from hostir.sub import x\n")
    graph = import_graph(package)
    assert cycles(graph) == [["hostir.a", "hostir.b"], ["hostir.sub", "hostir.sub.c", "hostir.sub.d"]]


def test_the_ir_imports_neither_its_builders_nor_its_axis_graphs():
    """ir.py is the IR's data: the op builders and the axis graphs import
    it, never the reverse."""
    graph = import_graph()
    assert not {t for t, _, _ in graph["hostir.ir"]} & {"hostir.builders", "hostir.axis_graph", "hostir.layout"}
    for module in ("hostir.builders", "hostir.axis_graph"):
        assert "hostir.ir" in {t for t, _, _ in graph[module]}
