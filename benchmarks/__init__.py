"""Benchmark suite of pallas-norm: every op, shape and implementation against the GEMM-alone
limit, the XLA baseline and the device's bytes/FLOP floors.

``python -m benchmarks.run [--quick] [--only RE] [--interpret] [--tiny]`` runs it;
``python -m benchmarks.report RESULTS.json`` turns its JSON into Markdown and a plot. Method:
``benchmarks/NOTES.md``.
"""
