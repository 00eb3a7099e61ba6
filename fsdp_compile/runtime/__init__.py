"""Eager runtime: collective semantics and the kernels they use."""
