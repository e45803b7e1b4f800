"""Benchmarks of trajectory-replay: `python -m benchmarks [--only store,...] [--quick]` (see benchmarks/run.py)."""
