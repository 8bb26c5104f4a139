"""The recipe level's curves as a PNG, from a ``polyrl parity`` report (the ``--json`` / ``--output`` object).

One row of panels per tiny recipe: the seed-averaged reward curve and the seed-averaged loss curve of the
backend beside the cpu backend's, each seed's curve faint behind them, and the measured statistic with its bar
in the title. Needs matplotlib (``pip install 'polyrl[report]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polyrl.core.errors import BadInputError


def recipe_curves(report: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(recipe row case, curves, row) of each recipe-level row that carries curves."""
    level = report.get("recipe")
    if not isinstance(level, dict):
        return []
    return [(row["case"], row["extra"]["curves"], row) for row in level.get("rows", [])
            if isinstance(row.get("extra"), dict) and "curves" in row["extra"]]


def plot_recipe_curves(report: dict[str, Any], path: str | Path) -> Path:
    found = recipe_curves(report)
    if not found:
        raise BadInputError("--plot: the report has no recipe-level curves (run with --level recipe)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInputError("--plot needs matplotlib: pip install 'polyrl[report]'") from None
    backend = report.get("backend", "backend")
    label = f"{backend} (emulated)" if report.get("emulated") else backend
    fig, axes = plt.subplots(len(found), 2, figsize=(11, 3.6 * len(found)), squeeze=False)
    for (case, curves, row), ax_pair in zip(found, axes):
        steps = curves["steps"]
        recipe = case.split(" ")[0]
        for ax, key in zip(ax_pair, ("reward", "loss")):
            for side, color, name, style in (("cpu", "tab:blue", "cpu (float32)", "-"),
                                             ("backend", "tab:orange", label, "--")):  # dashed: both show
                for run in curves["per_seed"][side]:
                    ys = [float("nan") if y is None else y for y in run[key]][: len(steps)]
                    ax.plot(steps[: len(ys)], ys, color=color, alpha=0.2, linewidth=0.8)
                mean = [float("nan") if y is None else y for y in curves["mean"][side][key]]
                ax.plot(steps[: len(mean)], mean, color=color, linewidth=1.8, linestyle=style,
                        label=f"{name}, mean of {len(curves['seeds'])} seeds")
            ax.set_xlabel("step")
            ax.set_ylabel("reward/mean" if key == "reward" else "loss/total")
            ax.grid(alpha=0.3)
            if key == "reward":
                bar = "-" if row.get("bar") is None else f"{row['bar']:.3g}"
                ax.set_title(f"{recipe}: reward MAE {row['error']:.4f} (bar {bar}) [{row['status']}]", fontsize=10)
                ax.legend(fontsize=8, loc="lower right")
            else:
                ax.set_title(f"{recipe}: actor loss", fontsize=10)
    fig.suptitle(f"polyrl parity, recipe level: {label} vs cpu ({report.get('dtype', '')} policy)", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def markdown_summary(report: dict[str, Any]) -> str:
    """One table row per (level, quantity): the worst measured error over the cases of that quantity, its bar
    and how many rows passed — the table docs/parity.md publishes, from a saved report."""
    from polyrl.parity.rows import LEVELS

    lines = [f"backend {report.get('origin', report.get('backend'))}"
             f"{' (emulated)' if report.get('emulated') else ''}, policy dtype {report.get('dtype')}", "",
             "| level | quantity | worst measured error | bar | rows passed |", "|---|---|---|---|---|"]
    for level in LEVELS:
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in (report.get(level) or {}).get("rows", []):
            case = row["case"]
            if level == "op":
                what = case.rsplit(": ", 1)[-1]
            elif level == "recipe":
                what = case.split(" ")[0] + ": " + case.rsplit(": ", 1)[-1]
            else:
                what = case.split(": ", 1)[-1] if level == "step" else case
            groups.setdefault(what, []).append(row)
        for what, rows in groups.items():
            errors = [r["error"] for r in rows if r.get("error") is not None]
            bars = sorted({r["bar"] for r in rows if r.get("bar") is not None})
            worst = f"{max(errors):.2e}" if errors else "-"
            bar = " / ".join(f"{b:.2g}" for b in bars) or "-"
            passed = sum(r["status"] == "pass" for r in rows)
            status = "" if all(r["status"] != "not run" for r in rows) else " (not run: " + rows[0]["detail"] + ")"
            lines.append(f"| {level} | {what} | {worst} | {bar} | {passed}/{len(rows)}{status} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m polyrl.parity.plot REPORT.json [OUT.png]
    import json
    import sys

    data = json.loads(Path(sys.argv[1]).read_text())
    print(markdown_summary(data))
    if len(sys.argv) > 2:
        print(f"curves: {plot_recipe_curves(data, sys.argv[2])}")
