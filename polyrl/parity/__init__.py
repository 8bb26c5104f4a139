"""``polyrl parity``: a backend against its references, level by level (op, model, step, recipe).

- :mod:`.rows` — the levels, the row type and statuses, each level's reference;
- :mod:`.harness` — :func:`run_parity` (every level) and the op and model levels;
- :mod:`.train` — the step and recipe levels (the trainer itself on the backend against the cpu backend);
- :mod:`.plot` — the recipe level's curves and the summary table, from a saved report.

The op level runs the conformance kit's cases (:mod:`polyrl.testing.conformance`), judged as the kit judges them.
Importing this package is light (no torch): the levels import what they run when they run.
"""

from polyrl.parity.harness import backend_dtype, level_summary, parity_report, run_parity
from polyrl.parity.rows import FAIL, LEVELS, NOT_RUN, PASS, REFERENCES, ParityRow
from polyrl.parity.train import DEFAULT_SEEDS, DEFAULT_STEPS, TINY_RECIPES
from polyrl.testing.conformance import DTYPES

__all__ = [
    "DEFAULT_SEEDS",
    "DEFAULT_STEPS",
    "DTYPES",
    "FAIL",
    "LEVELS",
    "NOT_RUN",
    "PASS",
    "REFERENCES",
    "TINY_RECIPES",
    "ParityRow",
    "backend_dtype",
    "level_summary",
    "parity_report",
    "run_parity",
]
