"""Benchmarks a user or maintainer runs (scripts), and the load generator behind `cai-dllm bench serve`."""
