"""Helpers shipped with the kernels for tests and benchmarks of ops (here and in other engines)."""
