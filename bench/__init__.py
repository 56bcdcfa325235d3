"""Benchmark harness (bench/run, docs/benchmarks.md); `bench.app` is the server it measures."""
