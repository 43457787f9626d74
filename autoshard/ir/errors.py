"""The error a user's bad input gets: ``InputError``, a ``ValueError`` that names the cause and the fix.

Bad input (a token id outside the vocabulary, a label of another shape, a checkpoint of another model)
must never become a loss, and never reach the user as an internal ``KeyError``, ``IndexError`` or
``TypeError`` from deep inside torch. Each check raises this, with the input's name, the bad value or
size, and what would be right, on every rank alike and before any collective can hang on it.
"""
from __future__ import annotations

import sys
import warnings


class InputError(ValueError):
    """A call's, a model's or a checkpoint's input that autoshard (or torch on one device) refuses."""


def warn_user(message: str, category: type = UserWarning) -> None:
    """``warnings.warn`` at the user's line: the first frame outside autoshard and torch (their
    ``parallelize``, ``pm.step`` or ``pm(...)`` call; a pass runs many frames below it, and a module call
    goes through torch's ``_call_impl``), so the message names their code and their filters apply to it."""
    frame, level = sys._getframe(1), 2           # level 2: warn_user's caller, as ``stacklevel`` counts
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("autoshard", "torch"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)

