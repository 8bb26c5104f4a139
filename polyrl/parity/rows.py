"""What every parity level emits: the levels, the row statuses, each level's reference and :class:`ParityRow`.

Its own module so that the levels' modules (:mod:`.harness` for op/model, :mod:`.train` for step/recipe) and
the report drawing (:mod:`.plot`) import it, and not each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

LEVELS = ("op", "model", "step", "recipe")
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
# What each level's rows are compared against (printed by `polyrl parity` above the rows).
REFERENCES: dict[str, str] = {
    "op": "the fp64 dense oracle, on the same inputs rounded to {dtype} (the conformance kit's cases and bars)",
    "model": "the cpu backend's float32 model on the same weights and tokens",
    "step": "one update of each tiny recipe on the cpu backend (float32), same rollout, advantages and seeds",
    "recipe": "`polyrl run` of each tiny recipe on the cpu backend (float32), same seeds, seed-averaged curves",
}
OnRow = Callable[["ParityRow"], None]


@dataclasses.dataclass
class ParityRow:
    level: str
    case: str
    status: str
    error: float | None = None
    bar: float | None = None
    detail: str = ""
    dtype: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # level-specific data (the recipe level's curves)

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        if not out["extra"]:
            del out["extra"]
        return out
