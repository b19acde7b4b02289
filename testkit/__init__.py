"""Test doubles that both the tests (``tests/``) and the benchmarks (``bench/``) use: fake
kubelets, a strict fake API server, a fake NVML, fake nodes and processes, the native test kit.
Each module says what real thing it stands in for and where it departs from it.

A package of its own so that neither ``tests`` nor ``bench`` imports the other's internals
(an import contract in pyproject.toml): the benchmarks' tests import ``bench``, nothing under
``bench`` imports ``tests``.
"""
