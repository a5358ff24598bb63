"""`lower(..., until=pass_name)`: the program right after one pass of the
pipeline, as the `hostir dump --pass` command shows it."""

from __future__ import annotations

import pytest

from hostir import overlap
from hostir.lower import PIPELINE, LoweringError, _run_one, lower, pass_names, pass_options
from hostir.lower.build_host_program import build_host_program


def test_lower_until_a_pass_stops_right_after_it():
    fusion = overlap.allgather_matmul(2).fusion
    names = pass_names()
    assert names[0] == "build_host_program" and names[-1] == "prune_for_rank"
    container = _run_one(build_host_program, fusion, None)
    container.backend = "gloo"
    assert str(lower(fusion, rank=1, backend="gloo", until="build_host_program")) == str(container)
    options = pass_options(1, "gloo")
    for p in PIPELINE:
        container = _run_one(p, container, None, options.get(p))
        assert str(lower(fusion, rank=1, backend="gloo", until=p.__name__)) == str(container), p.__name__
    assert str(lower(fusion, rank=1, backend="gloo", until="prune_for_rank")) == str(lower(fusion, rank=1, backend="gloo"))
    with pytest.raises(LoweringError, match="unknown pass 'fuse'; passes in order: build_host_program, "):
        lower(fusion, until="fuse")
