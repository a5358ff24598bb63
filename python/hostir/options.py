"""Debug dump options, read from the environment in this one place.

`HOSTIR_DUMP` (and `NVFUSER_DUMP`, read the same way) is a comma list:

  host_ir           print the lowered host program when it is first executed
  host_ir_lowering  print the host program after every lowering pass
  fusion_ir         print the fusion before lowering
  communication     log every posted collective
  flat_program      print the flat program the C++ executor runs, when compiled

`HOSTIR_DUMP_RANKS` is `all` or a comma list of ranks that print (default 0).

`HOSTIR_CHECK` is a comma list of analyses run after every lowering pass:

  races             the stream-race checker; a race fails the lowering

`HOSTIR_FAKE` chooses when `execute` runs on fake tensors: `1` returns fake
(meta) results without running, `auto` (the default) dry-runs each new
input shape of a multi-device program once before its first real run (a
single-device program runs without: it has no cross-rank error to catch),
`0` never dry-runs. Any
other value is warned about and read as `auto`.

`HOSTIR_EVALUATOR` (`auto`, `cpp` or `python`) is the evaluator `execute`
uses when its `evaluator` parameter is not given (default `auto`).
An unknown option in `HOSTIR_DUMP` is an error; in `NVFUSER_DUMP`, which a
user of both nvFuser and hostir may set for nvFuser, it is ignored with one
warning.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

from hostir.errors import HostIrError

DUMP_OPTIONS = {
    "host_ir": "print the lowered host program when it is first executed",
    "host_ir_lowering": "print the host program after every lowering pass",
    "fusion_ir": "print the fusion before lowering",
    "communication": "log every posted collective",
    "flat_program": "print the flat program the C++ executor runs, when compiled",
}
EVALUATORS = ("auto", "cpp", "python")

_NAME = re.compile(r"^[a-z_]+$")


CHECK_OPTIONS = {
    "races": "check every lowered program for stream races",
}
FAKE_MODES = ("auto", "1", "0")


class OptionError(HostIrError, ValueError):
    """A dump option hostir does not know, or a malformed option list."""

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
    """The options chosen in HOSTIR_DUMP (strict: a bad one is an error)
    and NVFUSER_DUMP (lenient: a user who has nvFuser too may set options
    only nvFuser knows; those are ignored with one warning)."""
    env = os.environ if environ is None else environ
    chosen = set(parse_dump(env.get("HOSTIR_DUMP", ""), "HOSTIR_DUMP"))
    text = env.get("NVFUSER_DUMP", "")
    ignored = []
    for raw in text.split(","):
        item = raw.strip()
        if item in DUMP_OPTIONS:
            chosen.add(item)
        elif item:
            ignored.append(item)
    if ignored and text not in _warned_nvfuser:
        _warned_nvfuser.add(text)
        warnings.warn(
            f"NVFUSER_DUMP={text!r}: hostir ignores {', '.join(map(repr, ignored))} (options it does not know; "
            f"it reads {', '.join(DUMP_OPTIONS)})",
            stacklevel=2,
        )
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


_warned_nvfuser: set[str] = set()


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
