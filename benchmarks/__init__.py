"""Benchmarks: speed and memory claims, each measured side by side with a peer in one run."""
