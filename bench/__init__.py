"""Benchmarks that sit outside the servelab package: they may run under other engines' environments."""
