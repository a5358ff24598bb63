"""The code blocks of the documentation (docs/*.md, README.md) and what is
done with each, by the convention written in docs/writing-docs.md:

- a ```python block runs on the CPU, in a fresh process, in order with the
  page's other CPU blocks, all in one namespace;
- `<!-- docs: mpirun -np N -->` on the line before a ```python block runs it
  under `mpirun -np N` (gloo), in order with the page's other blocks of that
  launch, one namespace per rank;
- `<!-- docs: run -->` before a ```bash block runs it with bash from the
  repository root; other shell blocks are shown, not run;
- `<!-- docs: output -->` before a ```text block makes it the standard output
  of the nearest block above it that runs (rank 0's under mpirun), compared
  up to the numbering of tensors, axes and extents (`normalize`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*docs:\s*(?P<what>.*?)\s*-->\s*$")
_MPIRUN = re.compile(r"^mpirun -np (\d+)$")


class DocConventionError(ValueError):
    """A marker or block the convention does not know."""


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    launch: str | None  # "cpu", "mpirun-N", "bash", or None (shown only)
    output_of: int | None = None  # for an output block: the index of the block it shows
    length: int = 0  # lines between the fences

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    """Every fenced block of `page`, with its launch and output links."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    mark: str | None = None
    last_run: int | None = None
    i = 0
    while i < len(lines):
        m = _MARK.match(lines[i])
        if m:
            mark = m.group("what")
            i += 1
            continue
        f = _FENCE.match(lines[i])
        if not f:
            if lines[i].strip():
                if mark is not None:
                    raise DocConventionError(f"{page.name}:{i + 1}: the docs marker {mark!r} is not followed by a code block")
            i += 1
            continue
        lang, start = f.group(1), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise DocConventionError(f"{page.name}:{start + 1}: a code block that never closes")
        i += 1
        code = "\n".join(body) + "\n"
        block = Block(page, start + 1, lang, code, None, length=len(body))
        if mark is None:
            block.launch = "cpu" if lang == "python" else None
        elif mark == "output":
            if lang != "text":
                raise DocConventionError(f"{block.where}: an output block must be ```text, not ```{lang}")
            if last_run is None:
                raise DocConventionError(f"{block.where}: an output block with no block above it that runs")
            block.output_of = last_run
        elif mark == "run":
            if lang not in ("bash", "sh", "console"):
                raise DocConventionError(f"{block.where}: `docs: run` marks shell blocks; this one is ```{lang}")
            block.launch = "bash"
        elif _MPIRUN.match(mark):
            if lang != "python":
                raise DocConventionError(f"{block.where}: `docs: {mark}` marks ```python blocks; this one is ```{lang}")
            block.launch = f"mpirun-{_MPIRUN.match(mark).group(1)}"
        else:
            raise DocConventionError(f"{block.where}: unknown docs marker {mark!r} (python blocks: `mpirun -np N`; shell blocks: `run`; text blocks: `output`)")
        if block.launch is not None:
            last_run = len(found)
        found.append(block)
        mark = None
    if mark is not None:
        raise DocConventionError(f"{page.name}: the docs marker {mark!r} at the end is not followed by a code block")
    return found


_NUMBERED = [
    (re.compile(r"\bT\d+_"), "T#_"),  # tensors: T12_g_float
    (re.compile(r"\bT\d+\b"), "T#"),  # tensors in reports: T3 float32[...]
    (re.compile(r"(?<=[A-Za-z.])\d+(?=\{)"), "#"),  # axes: iS17{...}, ideviceIdx.x16{2}
    (re.compile(r"\bi\d+\b"), "i#"),  # symbolic extents: i0
    (re.compile(r"\bCommunication \d+\b"), "Communication #"),
]


def normalize(text: str) -> str:
    """`text` up to numbering: tensors, axes, symbolic extents and
    communications renumbered away; trailing spaces and blank ends dropped."""
    for pattern, repl in _NUMBERED:
        text = pattern.sub(repl, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
