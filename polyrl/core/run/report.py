"""``polyrl report RUN_DIR``: a PNG of the training curves and a Markdown summary of a run.

Design choice: the report reads only the run directory's files (``metrics.jsonl`` and, when present,
``config.yaml``), never the trainer's objects, so it works on a finished run, a crashed one (a
half-written last line is skipped, and said so) or one still in progress, and on runs from another
machine. What cannot be read is refused with one line naming the file, as for checkpoints.
Panels are chosen by metric name and drawn only when the run logged them: a GRPO run has no value
loss, a run without KL has no KL panel. Plotting uses matplotlib's object API on the Agg canvas (no
pyplot global state, no display needed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.core.errors import BadInputError

METRICS_FILE, CONFIG_FILE = "metrics.jsonl", "config.yaml"
# The extra that brings the report's plotting (matplotlib) and the run's TensorBoard events (tensorboard): both
# pull large dependencies, so the main install leaves them out and says so in one line where they are missing.
REPORT_EXTRA = "pip install 'polyrl[report]'"
PNG_FILE, MD_FILE = "report.png", "report.md"
WINDOW = 10  # steps averaged for the "first" / "last" figures

# (panel title, predicate over metric names). A metric may appear in several panels.
PANELS: list[tuple[str, Callable[[str], bool]]] = [
    ("reward", lambda k: k in ("reward/mean", "reward/max", "reward/min") or k == "reward/score_mean"),
    # the value loss has its own panel: its scale often dwarfs the policy loss
    ("losses", lambda k: k.startswith("loss/") and k != "loss/value"),
    ("value loss", lambda k: k == "loss/value"),
    ("KL", lambda k: k == "actor/kl" or k.startswith("kl/") or k == "actor/ppo_kl"),
    ("clip fractions", lambda k: "clipfrac" in k),
    ("response length", lambda k: k.startswith("response/length")),
    ("DAPO sampling", lambda k: k.startswith("dapo/")),
    ("entropy", lambda k: k.endswith("entropy")),
    ("rollout vs trainer logprobs", lambda k: k == "rollout/logprob_diff"),
    # the rollout correction (algorithm.rollout_correction): the engine / trainer KL, the IS weights, what they drop
    ("mismatch KL (engine vs trainer)", lambda k: k in ("mismatch/k1", "mismatch/k3", "mismatch/seq_k1")),
    ("rollout IS weights", lambda k: k.startswith(("mismatch/is_", "mismatch/seq_is_")) and not k.endswith("_frac")),
    ("rollout correction: clipped / masked", lambda k: k.startswith("mismatch/") and k.endswith("_frac")),
    ("time per step (s)", lambda k: k == "time/step_s"),
]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(run_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The run's metric records and the number of unreadable lines skipped (0 or 1: a half-written last line).

    The same rule as for checkpoints: what cannot be read is refused with one line naming the file and
    what is wrong (``BadInputError``), never skipped silently. The one exception is the last line when it
    has no newline: a run killed while writing it leaves exactly that, and the summary says it was
    skipped. An unreadable line anywhere else, or a step held twice (``polyrl run`` writes each step once:
    two runs at once, or a file from an older polyrl), is refused.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BadInputError(f"run directory {run_dir}: not found")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise BadInputError(f"run directory {run_dir}: no {METRICS_FILE} (has the run started?)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise BadInputError(f"{path}: line {line} is not UTF-8 text (byte {exc.start}); the file is corrupt") from None
    except OSError as exc:
        raise BadInputError(f"{path}: unreadable ({exc.strerror or exc})") from None
    lines = text.split("\n")  # the last item is "" when the file ends with a newline
    records, skipped = [], 0
    seen: dict[Any, int] = {}  # step -> line number of its first record
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            if lineno == len(lines):  # no newline after it: a half-written last line of a killed run
                skipped += 1
                continue
            raise BadInputError(f"{path}: line {lineno} is not a metrics record ({str(exc).splitlines()[0]}); "
                                "the file is corrupt") from None
        step = record.get("step")
        if _finite(step):
            if step in seen:
                # Two histories in one file (two runs at once, or a resume that did not cut the file
                # back): any plot of it would be garbage.
                raise BadInputError(f"{path}: step {step:g} appears twice (lines {seen[step]} and {lineno}); "
                                    "a metrics file must hold each step once")
            seen[step] = lineno
        records.append(record)
    if not records:
        raise BadInputError(f"{path}: no metric records")
    return records, skipped


def series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric over the records that hold a finite value for it."""
    steps, values = [], []
    for i, record in enumerate(records):
        value = record.get(key)
        if _finite(value):
            step = record.get("step")
            steps.append(float(step) if _finite(step) else float(i))
            values.append(float(value))
    return steps, values


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _numeric_keys(records: list[dict[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and _finite(value):
                keys.setdefault(key, None)
    return list(keys)


def events_missing() -> str:
    """Why a run writes no TensorBoard ``events/`` (tensorboard is not installed, with what to install), or ""."""
    try:
        from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: F401
    except ImportError:
        return (f"no TensorBoard events/ in the run directory: tensorboard is not installed ({REPORT_EXTRA}); "
                "metrics.jsonl holds every metric")
    return ""


def plot(records: list[dict[str, Any]], png_path: Path) -> list[str]:
    """Draw the panels that have data into ``png_path``; returns the panel titles drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # bad input of the install: one line, exit 2
        raise BadInputError(f"the report's plots need matplotlib, which is not installed: {REPORT_EXTRA}") from None
    keys = _numeric_keys(records)
    panels = [(title, [k for k in keys if pred(k)]) for title, pred in PANELS]
    panels = [(title, ks) for title, ks in panels if ks]
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(6.0 * cols, 3.2 * rows), constrained_layout=True)
    FigureCanvasAgg(fig)
    for i, (title, ks) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for key in ks:
            steps, values = series(records, key)
            line, = ax.plot(steps, values, label=key, linewidth=1.0, marker="." if len(values) < 30 else None)
            if key == "reward/mean" and len(values) > WINDOW:  # trailing mean: the trend under sampling noise
                smooth = [_mean(values[max(0, j + 1 - WINDOW) : j + 1]) for j in range(len(values))]
                ax.plot(steps, smooth, color=line.get_color(), linewidth=2.2, alpha=0.6,
                        label=f"{key} ({WINDOW}-step mean)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no plottable metrics", ha="center", va="center")
        ax.set_axis_off()
    fig.savefig(png_path, dpi=100)
    return [title for title, _ in panels]


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        out = []
        for key, sub in value.items():
            out.extend(_flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return [(prefix, value)]


def _config_lines(run_dir: Path, limit: int = 80) -> list[str]:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return []
    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise BadInputError(f"{path}: unreadable ({str(exc).splitlines()[0]}); the file is corrupt") from None
    if not isinstance(config, dict):
        raise BadInputError(f"{path}: not a mapping of recipe keys; the file is corrupt")
    items = [(k, v) for k, v in _flatten(config) if not isinstance(v, (list, dict)) or not v]
    lines = ["| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {json.dumps(v) if not isinstance(v, str) else v} |" for k, v in items[:limit]]
    if len(items) > limit:
        lines.append(f"| … | {len(items) - limit} more keys in config.yaml |")
    return lines


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x:.4g}"


def summarize(records: list[dict[str, Any]], run_dir: Path, panels: list[str], skipped: int) -> str:
    """The Markdown summary (see ``write_report``)."""
    _, rewards = series(records, "reward/mean")
    _, step_times = series(records, "time/step_s")
    lines = [f"# Run report: {run_dir.name}", ""]
    last_step = records[-1].get("step", len(records))
    lines.append(f"- steps logged: {len(records)} (last step {last_step})")
    if skipped:
        lines.append(f"- unreadable lines skipped in {METRICS_FILE}: {skipped}")
    if rewards:
        first, last = _mean(rewards[:WINDOW]), _mean(rewards[-WINDOW:])
        lines.append(f"- reward/mean: first {min(WINDOW, len(rewards))} steps {_fmt(first)}, "
                     f"last {min(WINDOW, len(rewards))} steps {_fmt(last)} (change {_fmt(last - first)}), "
                     f"best {_fmt(max(rewards))}")
    if step_times:
        lines.append(f"- time: {_fmt(sum(step_times))} s in steps, {_fmt(_mean(step_times))} s per step")
    lines += ["", f"![training curves]({PNG_FILE})", ""]

    keys = _numeric_keys(records)
    if keys:
        lines += ["## Metrics", "", f"| metric | first {WINDOW} | last {WINDOW} | final |", "|---|---|---|---|"]
        for key in sorted(keys):
            _, values = series(records, key)
            lines.append(f"| `{key}` | {_fmt(_mean(values[:WINDOW]))} | {_fmt(_mean(values[-WINDOW:]))} | "
                         f"{_fmt(values[-1])} |")
        lines.append("")
    losses = [k for k in keys if k.startswith("loss/")]
    if losses:
        final = ", ".join(f"{k} {_fmt(series(records, k)[1][-1])}" for k in sorted(losses))
        lines += [f"Final losses: {final}.", ""]
    lines += [f"Panels drawn: {', '.join(panels) or 'none'}.", ""]
    config = _config_lines(run_dir)
    if config:
        lines += ["## Config", "", *config, ""]
    return "\n".join(lines)


def write_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.md`` into ``run_dir`` from its ``metrics.jsonl``.

    ``metrics.jsonl`` holds one JSON object per step (``step``, ``reward/mean``, ``loss/policy``,
    optionally ``loss/value``, ``actor/kl`` or ``kl/*``, ``actor/pg_clipfrac``,
    ``actor/pg_clipfrac_lower``, ``response/length_mean``, ``dapo/*``, ``time/step_s``, ...); whatever
    exists is plotted. Raises ``BadInputError`` (before writing anything) for a missing run directory or
    metrics file, and for a metrics or config file that cannot be read (``read_metrics``).
    """
    run_dir = Path(run_dir)
    records, skipped = read_metrics(run_dir)
    _config_lines(run_dir)  # a corrupt config.yaml is refused before anything is written
    png_path, md_path = run_dir / PNG_FILE, run_dir / MD_FILE
    panels = plot(records, png_path)
    md_path.write_text(summarize(records, run_dir, panels, skipped), encoding="utf-8")
    return png_path, md_path
