"""The pytest-benchmark suite: the paged engine against the naive concat cache, NumPy and torch (docs/benchmarks.md)."""
