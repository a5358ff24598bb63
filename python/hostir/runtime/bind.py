"""Bind a call's tensors to a program, and convert its results back.

A caller passes tensors with the fusion's logical axes; the program reads
and writes them with its runtime axes (a split axis as its pieces,
`layout.to_runtime`), and hands results back with logical axes
(`layout.to_logical`). `Binding` is made once per lowered program and
knows which of the three conversions are views at all, so that a call
whose tensors need none (the common case) costs a list copy.

Every route of a call binds through it: the full path, a prepared call, the
fake runner and the dry run (the executor's `_bind` and `_convert` stages).
"""

from __future__ import annotations

import torch

from hostir import ir, layout

__all__ = ["Binding"]


class Binding:
    """The conversions between a program's inputs and outputs and a call's
    tensors."""

    __slots__ = ("input_tvs", "output_tvs", "_inputs_viewed", "_outputs_viewed", "_results_viewed", "_layouts")

    def __init__(self, inputs, outputs):
        self.input_tvs = list(inputs)
        self.output_tvs = list(outputs)
        tensors = [tv for tv in self.input_tvs if isinstance(tv, ir.TensorView)]
        # Where runtime dims differ from logical ones (a split axis), a
        # tensor is viewed across on the way in and out.
        self._inputs_viewed = any(len(layout.dims(tv)) != len(tv.logical_runtime()) for tv in tensors)
        self._outputs_viewed = any(len(layout.dims(tv)) != len(tv.logical_runtime()) for tv in self.output_tvs)
        self._results_viewed = any(len(layout.dims(tv)) != tv.logical_ndim for tv in self.output_tvs)
        self._layouts = layout.Conversions()

    @classmethod
    def of(cls, container) -> Binding:
        return cls(container.inputs, container.outputs)

    def inputs(self, inputs) -> list:
        """The call's inputs with the program's runtime axes (scalars as
        they are)."""
        if not self._inputs_viewed:
            return list(inputs)
        return [
            self._layouts.to_runtime(tv, t) if isinstance(tv, ir.TensorView) else t
            for tv, t in zip(self.input_tvs, inputs)
        ]

    def outputs(self, outputs) -> list:
        """Preallocated outputs with the program's runtime axes."""
        if not self._outputs_viewed:
            return list(outputs)
        return [self._layouts.to_runtime(tv, t) for tv, t in zip(self.output_tvs, outputs)]

    def bind(self, inputs, outputs=None) -> dict:
        """The evaluator's bindings of a call: each program input and, where
        preallocated, output to its tensor in runtime axes."""
        bindings = dict(zip(self.input_tvs, self.inputs(inputs)))
        if outputs is not None:
            bindings.update(zip(self.output_tvs, self.outputs(outputs)))
        return bindings

    def unbind(self, results) -> list[torch.Tensor | None]:
        """The program's results with the fusion's logical axes (None for
        an output this rank does not hold)."""
        if not self._results_viewed:
            return results
        return [None if r is None else self._layouts.to_logical(tv, r) for tv, r in zip(self.output_tvs, results)]

    def views(self) -> tuple[list, list]:
        """The conversions of `inputs` and `unbind` as numbers, for a runner
        that views the tensors itself (`Conversions.runtime_view` for each
        input, empty for a scalar; `Conversions.logical_view` for each
        output)."""
        inputs = [self._layouts.runtime_view(tv) if isinstance(tv, ir.TensorView) else [] for tv in self.input_tvs]
        return inputs, [self._layouts.logical_view(tv) for tv in self.output_tvs]

    def logical_inputs(self, buffers) -> list:
        """Runtime-axes input buffers (a captured graph's) with the
        fusion's logical axes."""
        if not self._inputs_viewed:
            return list(buffers)
        return [self._layouts.to_logical(tv, t) for tv, t in zip(self.input_tvs, buffers)]

