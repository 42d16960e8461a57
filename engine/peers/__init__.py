"""Benchmark peers that run outside this process (engine/bench.py's `--peers`)."""
