"""Benchmark harness (see bench/run and docs/benchmarks.md); `bench.app` is the server under test."""
