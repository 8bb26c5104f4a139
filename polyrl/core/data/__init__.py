"""Data files for text tasks: parquet or JSON Lines rows with a prompt and a reference answer.

The row schema is documented in docs/data.md. Everything wrong with a data file — missing, unreadable,
malformed, a row without the needed field — raises ``BadInputError`` with one line naming the file,
the row and the field, so ``polyrl run`` exits 2 before anything is written. How sequences pack into
micro-batches by a token budget is :mod:`polyrl.core.data.packing`.
"""

from __future__ import annotations

from polyrl.core.data.rows import SUFFIXES, load_rows, lookup

__all__ = ["SUFFIXES", "load_rows", "lookup"]
