"""Benchmarks, the demo model and data, and the training demo (`python -m bench.train`)."""
