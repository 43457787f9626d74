"""The error a user's bad input gets: ``InputError``, a ``ValueError`` that names the cause and the fix.

Bad input (a token id outside the vocabulary, a label of another shape, a checkpoint of another model)
must never become a loss, and never reach the user as an internal ``KeyError``, ``IndexError`` or
``TypeError`` from deep inside torch. Each check raises this, with the input's name, the bad value or
size, and what would be right, on every rank alike and before any collective can hang on it.
"""
from __future__ import annotations


class InputError(ValueError):
    """A call's, a model's or a checkpoint's input that autoshard (or torch on one device) refuses."""
