"""Benchmarks: `python -m bench.<name>` from the repo root; results go to bench/results/."""
