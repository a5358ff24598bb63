"""What one call of a fusion passes through once its program is lowered:
the input checks (`checks`), the binding of its tensors (`bind`), the
agreement of the ranks (`agreement`), the evaluator (`evaluator`) and the
flat program the C++ executor runs (`flat`), streams (`streams`), CUDA
graphs (`graphs`), the transports behind one `post` (`transports`), the
record of a repeated call (`prepared`) and profiling (`profiling`).

It imports nothing from the executor, the frontend, the lowering or the
analyses (tests/python/test_import_structure.py holds it to that), so that
each of them can use it.
"""
