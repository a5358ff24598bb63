"""Debug dump options, read from the environment in this one place.

`HOSTIR_DUMP` (and `NVFUSER_DUMP`, read the same way) is a comma list:

  host_ir           print the lowered host program when it is first executed
  host_ir_lowering  print the host program after every lowering pass
  fusion_ir         print the fusion before lowering
  communication     log every posted collective
  flat_program      print the flat program the C++ executor runs, when compiled

`HOSTIR_DUMP_RANKS` is `all` or a comma list of ranks that print (default 0).
`HOSTIR_EVALUATOR` (`auto`, `cpp` or `python`) is the evaluator `execute`
uses when its `evaluator` parameter is not given (default `auto`).
"""

from __future__ import annotations

import os
import re
import sys

DUMP_OPTIONS = {
    "host_ir": "print the lowered host program when it is first executed",
    "host_ir_lowering": "print the host program after every lowering pass",
    "fusion_ir": "print the fusion before lowering",
    "communication": "log every posted collective",
    "flat_program": "print the flat program the C++ executor runs, when compiled",
}
EVALUATORS = ("auto", "cpp", "python")
DUMP_VARIABLES = ("HOSTIR_DUMP", "NVFUSER_DUMP")

_NAME = re.compile(r"^[a-z_]+$")


class OptionError(ValueError):
    pass


def parse_dump(text: str, variable: str = "HOSTIR_DUMP") -> frozenset[str]:
    """The set of options in a comma list; an error names a bad one."""
    chosen = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if not _NAME.match(item):
            raise OptionError(
                f"{variable}={text!r}: {item!r} is not an option name; "
                f"write a comma list such as host_ir,host_ir_lowering"
            )
        if item not in DUMP_OPTIONS:
            valid = "\n".join(f"  {k:<18}{v}" for k, v in DUMP_OPTIONS.items())
            raise OptionError(f"{variable}: unknown option {item!r}. Valid options:\n{valid}")
        chosen.add(item)
    return frozenset(chosen)


def dump_options(environ=None) -> frozenset[str]:
    env = os.environ if environ is None else environ
    chosen: set[str] = set()
    for var in DUMP_VARIABLES:
        chosen |= parse_dump(env.get(var, ""), var)
    return frozenset(chosen)


def dump_ranks(environ=None) -> str | frozenset[int]:
    env = os.environ if environ is None else environ
    text = env.get("HOSTIR_DUMP_RANKS", "0").strip()
    if text == "all":
        return "all"
    try:
        return frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise OptionError(f"HOSTIR_DUMP_RANKS={text!r}: expected 'all' or a comma list of ranks") from None


def evaluator_choice(environ=None) -> str:
    """`HOSTIR_EVALUATOR`, checked: the evaluator used by default."""
    env = os.environ if environ is None else environ
    text = env.get("HOSTIR_EVALUATOR", "auto").strip() or "auto"
    if text not in EVALUATORS:
        raise OptionError(f"HOSTIR_EVALUATOR={text!r}: expected one of {list(EVALUATORS)}")
    return text


class Dumper:
    """Prints the dumps chosen in the environment, on the ranks chosen."""

    def __init__(self, rank: int = 0, environ=None, stream=None):
        self.options = dump_options(environ)
        ranks = dump_ranks(environ)
        self.active = ranks == "all" or rank in ranks
        self._stream = stream

    def enabled(self, option: str) -> bool:
        return self.active and option in self.options

    def emit(self, option: str, title: str, text: str) -> None:
        if not self.enabled(option):
            return
        out = self._stream or sys.stdout
        out.write(f"{title}\n{text}")
        if not text.endswith("\n"):
            out.write("\n")
        out.flush()
