"""Exceptions with a meaning for the CLI.

``BadInputError`` is anything the user got wrong (recipe, override, data, checkpoint, unknown backend):
the CLI prints its message on one line and exits 2 without a traceback and without touching run
directories. Anything else is a bug or an environment failure and exits 1.
"""

from __future__ import annotations


class BadInputError(Exception):
    """User input is wrong; the message names what and where."""


class BackendSelectionError(BadInputError):
    """No backend, an unknown backend, or an ambiguous choice among available backends."""
