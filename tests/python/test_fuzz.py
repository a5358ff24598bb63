"""Fuzz the public API: random small programs either match eager torch or
raise a hostir error with a message — never another exception, a hang or a
wrong answer. The same programs with a sharded axis run on 2 ranks in
tests/python/multidevice/test_fuzz.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import hostir
from fuzz_programs import build, programs, reference


def _compare(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, equal_nan=True)


@pytest.mark.timeout(600)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=programs(), seed=st.integers(0, 2**31 - 1))
def test_random_programs_match_eager_or_raise_a_hostir_error(p, seed: int):
    gen = torch.Generator().manual_seed(seed)
    try:
        fd, _ = build(p)
        inputs = p.inputs(gen)
        expected = reference(p, inputs)
    except hostir.HostIrError as err:
        assert str(err)
        return
    except (RuntimeError, IndexError):
        # Eager torch itself rejects the program (a max over an empty
        # axis): hostir must reject it too, with its own error.
        with pytest.raises(hostir.HostIrError, match=r"\S"):
            fd.execute(inputs, number_of_streams=p.streams)
        return
    outputs = None
    if p.preallocate:
        outputs = [torch.full_like(expected, 7) if expected.numel() else torch.empty_like(expected)]
    try:
        (out,) = fd.execute(inputs, outputs=outputs, number_of_streams=p.streams)
    except hostir.HostIrError as err:
        assert str(err)
        note(f"{type(err).__name__}: {err}")
        return
    _compare(out, expected)
    if outputs is not None:
        assert out.data_ptr() == outputs[0].data_ptr() or not out.numel()
