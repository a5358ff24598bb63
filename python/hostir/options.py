"""Debug dump options, read from the environment in this one place.

`HOSTIR_DUMP` (and `NVFUSER_DUMP`, read the same way) is a comma list:

  host_ir           print the lowered host program when it is first executed
  host_ir_lowering  print the host program after every lowering pass
  fusion_ir         print the fusion before lowering
  communication     log every posted collective

`HOSTIR_DUMP_RANKS` is `all` or a comma list of ranks that print (default 0).

`HOSTIR_CHECK` is a comma list of analyses run after every lowering pass:

  races             the stream-race checker; a race fails the lowering

`HOSTIR_FAKE` chooses when `execute` runs on fake tensors: `1` returns fake
(meta) results without running, `auto` (the default) dry-runs each new
input signature once before its first real run, `0` never dry-runs. Any
other value is warned about and read as `auto`.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

DUMP_OPTIONS = {
    "host_ir": "print the lowered host program when it is first executed",
    "host_ir_lowering": "print the host program after every lowering pass",
    "fusion_ir": "print the fusion before lowering",
    "communication": "log every posted collective",
}
DUMP_VARIABLES = ("HOSTIR_DUMP", "NVFUSER_DUMP")

_NAME = re.compile(r"^[a-z_]+$")


CHECK_OPTIONS = {
    "races": "check every lowered program for stream races",
}
FAKE_MODES = ("auto", "1", "0")


class OptionError(ValueError):
    pass


def parse_dump(text: str, variable: str = "HOSTIR_DUMP", options: dict | None = None) -> frozenset[str]:
    """The set of options in a comma list; an error names a bad one."""
    options = DUMP_OPTIONS if options is None else options
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
        if item not in options:
            valid = "\n".join(f"  {k:<18}{v}" for k, v in options.items())
            raise OptionError(f"{variable}: unknown option {item!r}. Valid options:\n{valid}")
        chosen.add(item)
    return frozenset(chosen)


def dump_options(environ=None) -> frozenset[str]:
    env = os.environ if environ is None else environ
    chosen: set[str] = set()
    for var in DUMP_VARIABLES:
        chosen |= parse_dump(env.get(var, ""), var)
    return frozenset(chosen)


def check_options(environ=None) -> frozenset[str]:
    """The analyses `HOSTIR_CHECK` asks for after every lowering pass."""
    env = os.environ if environ is None else environ
    return parse_dump(env.get("HOSTIR_CHECK", ""), "HOSTIR_CHECK", CHECK_OPTIONS)


def fake_mode(environ=None) -> str:
    """`HOSTIR_FAKE`: "1", "0" or "auto"; anything else warns and is "auto"."""
    env = os.environ if environ is None else environ
    text = env.get("HOSTIR_FAKE", "auto").strip().lower()
    if text in FAKE_MODES:
        return text
    warnings.warn(
        f"HOSTIR_FAKE={text!r} is not one of auto, 1, 0; using auto", RuntimeWarning, stacklevel=3
    )
    return "auto"


def dump_ranks(environ=None) -> str | frozenset[int]:
    env = os.environ if environ is None else environ
    text = env.get("HOSTIR_DUMP_RANKS", "0").strip()
    if text == "all":
        return "all"
    try:
        return frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise OptionError(f"HOSTIR_DUMP_RANKS={text!r}: expected 'all' or a comma list of ranks") from None


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
