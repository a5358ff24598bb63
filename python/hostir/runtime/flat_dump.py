"""The text of a flat program (`FlatProgram.dump()`, `HOSTIR_DUMP=flat_program`),
and of the collectives a C++ run posted (`HOSTIR_DUMP=communication`).

One line per instruction, nested by loops and conditionals, each field
printed by its kind: tensor slots `%t<n>`, scalar nodes as expressions over
integer slots `$<n>`, streams, groups, layouts. Golden dumps
(`tests/python/golden/flat_*.hir`) hold it.
"""

from __future__ import annotations

from hostir import ir, printer

# The C++ core's communication types, in its order (as `flat.COMMUNICATION_TYPES`).
_COMMUNICATION_TYPES = tuple(t.value for t in ir.CommunicationType if t.in_cpp)


def _scalar_text(p, node: int) -> str:
    kind = p.scalars[node]
    if kind[0] == "const":
        return str(kind[1])
    if kind[0] == "slot":
        return f"${kind[1]}"
    return f"( {_scalar_text(p, kind[1])} {kind[0]} {_scalar_text(p, kind[2])} )"


def _field_text(p, name: str, value) -> str:
    if name in ("start", "stop", "index", "peer", "stream_index", "cond", "parts") and isinstance(value, int):
        return "-" if value < 0 else _scalar_text(p, value)
    if name in ("shape", "in_shape", "out_shape", "in_full", "out_full"):
        return "(" + ", ".join(_scalar_text(p, n) for n in value) + ")"
    if name in ("out", "input", "a", "b", "bias", "buffer", "into", "like", "counts", "rows", "rows_in") and isinstance(
        value, int
    ):
        return "-" if value < 0 else f"%t{value}"
    if name == "locals":
        return "(" + " ".join(f"%t{v}" for v in value) + ")"
    if name == "group":
        return f"g{value}"
    if name == "backend":
        return value or "-"
    if name == "slot":
        return f"%s{value}"
    if name in ("dtype", "dtype_in", "dtype_out"):
        return ir.dtype_name(ir.SUPPORTED_DTYPES[value])
    if name == "type":
        return _COMMUNICATION_TYPES[value]
    if name == "views":
        return "(" + " ".join(_view_text(v) for v in value) + ")"
    if name in ("in_view", "out_view", "rows_view", "rows_in_view"):
        return _view_text(value)
    if name == "store":
        flags = [f for f in ("partial", "slice") if value[f]]
        runtime = "[" + " ".join("1" if k < 0 else f"a{k}" for k in value["runtime"]) + "]" if value["runtime"] else ""
        logical = _groups_text(value["logical"])
        return (
            "{"
            + " ".join(flags + [x for x in (runtime and f"runtime={runtime}", logical and f"logical={logical}") if x])
            + "}"
        )
    if isinstance(value, dict):
        if "tensor" in value:
            return f"%t{value['tensor']}"
        if "scalar" in value:
            return _scalar_text(p, value["scalar"])
        return f"{value['kind']}({value['number']!r})"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "(" + " ".join(map(str, value)) + ")"
    return str(value)


def _groups_text(groups: list) -> str:
    return "".join("[" + " ".join(map(str, g)) + "]" for g in groups)


def _view_text(v: dict) -> str:
    """An operand's view: its logical axes as groups of runtime dims, then
    each cut as pos:sizes@(dim index ...)."""
    parts = [_groups_text(v["logical"]) or "="]
    for c in v["cuts"]:
        sizes = ",".join("?" if x < 0 else str(x) for x in c["sizes"])
        narrows = ",".join(f"{c['narrows'][k]}={c['narrows'][k + 1]}" for k in range(0, len(c["narrows"]), 2))
        parts.append(f"cut{c['pos']}:{sizes}@{narrows}")
    return "{" + " ".join(parts) + "}"


_HIDDEN = {"stream_index", "stream_slot", "stream_key", "text", "rows_text", "rows_in_text"}


def _stream_text(fields: dict) -> str:
    if fields["stream_index"] >= 0:
        return None
    return f"%s{fields['stream_slot']} or pool[{fields['stream_key']}]"


def dump(p) -> str:
    """The text of flat program `p`."""
    head = (
        f"%FlatProgram {{ ({', '.join(f'%t{i}' if i >= 0 else f'${-2 - i}' for i in p.inputs)}) -> "
        f"({', '.join('-' if o < 0 else f'%t{o}' for o in p.outputs)}) :"
    )
    lines = [head]
    slots = ", ".join(f"%t{i}={name.split('[')[0]}" for i, name in enumerate(p.tensor_names))
    lines.append(f"  tensors: {slots}")
    lines.append("  ints: " + ", ".join(f"${i}={name}" for i, name in enumerate(p.int_names)))
    for slot, rules in p.extent_rules.items():
        parts = []
        for r in rules:
            if r["mesh_size"]:
                parts.append(f"1 (mesh {r['mesh_size']})")
            elif r["bind_slot"] >= 0:
                parts.append(f"${r['bind_slot']}" + (f" * {r['factor']}" if r["factor"] != 1 else ""))
            elif r["extent"] < 0:
                parts.append("1")
            else:
                parts.append(f"= {_scalar_text(p, r['extent'])}")
            if r["scale"] != 1:
                parts[-1] += f" (size * {r['scale']})"
        lines.append(f"  bind %t{slot}: [{', '.join(parts)}]")
    depth_end: list[int] = []
    for i, instr in enumerate(p.instrs):
        while depth_end and depth_end[-1] <= i:
            depth_end.pop()
        pad = "  " * (len(depth_end) + 1)
        fields = []
        for name, value in instr.fields.items():
            if name in _HIDDEN:
                continue
            fields.append(f"{name}={_field_text(p, name, value)}")
        if "stream_index" in instr.fields:
            stream = _stream_text(instr.fields) or f"pool[{_scalar_text(p, instr.fields['stream_index'])}]"
            fields.insert(0, f"stream={stream}")
        lines.append(f"{pad}{i}: {instr.op} " + " ".join(fields))
        if instr.op == "for":
            depth_end.append(instr.fields["end"])
        elif instr.op == "if":
            depth_end.append(instr.fields["else_end"])
    lines.append("} // %FlatProgram")
    return "\n".join(lines) + "\n"


def dump_postings(dumper, exprs: list, records: list) -> None:
    """The `communication` dump of a C++ run's collectives, from its
    records (instruction, ..., input sizes, output sizes), as the Python
    evaluator prints them when it posts them."""
    for instr, _, _, _, _, input_sizes, output_sizes in records:
        e = exprs[instr]
        if not isinstance(e, ir.Communication) or len(e.team) == 1:
            continue  # a team of one posts nothing (as in the Python evaluator)
        sizes = [(name, s) for name, s in (("input", input_sizes), ("output", output_sizes)) if s]
        text = ", ".join(f"{name} {list(s)}" for name, s in sizes)
        dumper.emit("communication", f"Posting {printer.format_expr_head(e)}", f"  with {text}")
