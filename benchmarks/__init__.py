"""Benchmarks of autoshard against hand-written tensor parallelism (``python -m benchmarks.tp``)."""
