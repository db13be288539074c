"""Runnable benchmarks of DMuon (not a published package).

A regular package so that ``benchmarks.common`` — the byte-level GPT, its corpus
and the optimizer factories shared by ``benchmarks/train.py``, the demo and the
integration tests — imports the same way from a script, a test or
``python -m benchmarks.train``.
"""
