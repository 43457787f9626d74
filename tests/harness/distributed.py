"""Run a function on N local CPU ranks joined by a gloo process group (``autoshard.launch``).

    results = run_distributed(_body, 2, x)   # _body(rank, world, x) at top level, so it pickles

The ranks stay up between the calls of a test module (``autoshard.launcher.RankPool``, one per world size;
``tests/conftest.py`` closes them at the module's end): spawning them and joining the group costs seconds
a test. Each call still starts from a fresh rank's seed, in the test's environment, and a call that fails
closes the pool. ``fresh=True`` (a test that may leave a collective timed out) or
``AUTOSHARD_TEST_FRESH_RANKS=1`` (every test) spawns new ranks for the call instead.

A rank that raises, exits without reporting, or outlives ``timeout`` fails the test with every failing
rank's traceback.
"""
from __future__ import annotations

import os

from autoshard.launcher import RankError, launch, pooled

__all__ = ["run_distributed"]


def run_distributed(fn, world_size, *args, timeout=120, init_pg=True, fresh=False):
    try:
        if init_pg and not fresh and os.environ.get("AUTOSHARD_TEST_FRESH_RANKS", "0") in ("", "0"):
            return pooled(world_size).run(fn, *args, timeout=timeout)
        return launch(fn, world_size, *args, timeout=timeout, init_pg=init_pg)
    except RankError as e:
        raise AssertionError(str(e)) from None
