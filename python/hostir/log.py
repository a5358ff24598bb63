"""The `hostir` logger: what was lowered, program cache hits and misses,
which evaluator, device and transport were chosen, how DTensor placements
became shardings — everything that is neither a dump nor an error.

Every record is prefixed with the rank (`[rank 1/4] ...`), so the lines of
several ranks sharing a terminal can be told apart. hostir adds no handler
of its own unless `HOSTIR_LOG` names a level (`debug`, `info`, ...): then
records of that level and above go to stderr. Otherwise configure it as any
library's logger: `logging.getLogger("hostir").setLevel(logging.DEBUG)`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from hostir.options import OptionError

__all__ = ["logger", "set_rank_source"]

logger = logging.getLogger("hostir")


# Where the rank comes from: the communicator registers its own `rank()`
# and `world_size()` when it is imported (the log sits below it).
_rank_source: Callable[[], tuple[int, int]] | None = None


def set_rank_source(source: Callable[[], tuple[int, int]]) -> None:
    """Take each record's (rank, world size) from `source`."""
    global _rank_source
    _rank_source = source


class _RankPrefix(logging.Filter):
    """Prefixes each record's message with this process's rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "hostir_rank", None):
            try:
                rank, size = _rank_source()
                where = f"[rank {rank}/{size}] "
            except Exception:
                where = "[rank ?] "
            record.hostir_rank = where
            record.msg = where + str(record.msg)
        return True


logger.addFilter(_RankPrefix())


def _configure_from_env() -> None:
    level = os.environ.get("HOSTIR_LOG", "").strip()
    if not level:
        return
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise OptionError(f"HOSTIR_LOG={level!r}: expected a logging level such as debug, info, warning")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hostir %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(value)


_configure_from_env()
