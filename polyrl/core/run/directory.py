"""The run directory: ``config.yaml``, ``metrics.jsonl``, ``events/``, ``checkpoints/``.

Nothing here is touched before the run's inputs have been validated: the CLI builds the trainer first
(where bad input raises) and only then calls ``RunDir.open``. Rank 0 alone writes files; other ranks get
a RunDir whose writers do nothing.

``metrics.jsonl`` holds one JSON object per step (``step``, ``reward/mean``, ``loss/policy``,
``time/step_s``, ...). On resume the lines after the resumed step are dropped, so the file always
describes one consistent history. TensorBoard events are written when ``tensorboard`` is installed.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
EVENTS_DIR = "events"
CHECKPOINTS_DIR = "checkpoints"


def default_run_dir(recipe_name: str) -> Path:
    return Path("runs") / f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf: keep it readable instead of invalid
    return value


class RunDir:
    def __init__(self, path: str | os.PathLike[str], *, is_main: bool = True) -> None:
        self.path = Path(path)
        self.is_main = is_main
        self._metrics_f = None
        self._tb = None

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    def open(self, config_yaml: str, *, resume_step: int | None = None, tensorboard: bool = True) -> RunDir:
        """Create the directory, write the resolved config, open the metrics writers."""
        if not self.is_main:
            return self
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        (self.path / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
        self._truncate_metrics(resume_step or 0)
        self._metrics_f = self.metrics_path.open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                self._tb = None
            else:
                self._tb = SummaryWriter(log_dir=str(self.path / EVENTS_DIR))
        return self

    def _truncate_metrics(self, keep_upto: int) -> None:
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) <= keep_upto:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a half-written last line of a killed run
        self.metrics_path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.is_main or self._metrics_f is None:
            return
        record = {k: _jsonable(v) for k, v in metrics.items()}
        self._metrics_f.write(json.dumps(record, sort_keys=False) + "\n")
        self._metrics_f.flush()
        if self._tb is not None:
            step = int(metrics["step"])
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._metrics_f is not None:
            self._metrics_f.close()
            self._metrics_f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
