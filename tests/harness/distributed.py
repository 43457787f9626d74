"""Run a function on N local CPU ranks joined by a gloo process group (``autoshard.launch``).

    results = run_distributed(_body, 2, x)   # _body(rank, world, x) at top level, so it pickles

A rank that raises, exits without reporting, or outlives ``timeout`` fails the test with every failing
rank's traceback.
"""
from __future__ import annotations

from autoshard.launcher import RankError, launch

__all__ = ["run_distributed"]


def run_distributed(fn, world_size, *args, timeout=120, init_pg=True):
    try:
        return launch(fn, world_size, *args, timeout=timeout, init_pg=init_pg)
    except RankError as e:
        raise AssertionError(str(e)) from None
