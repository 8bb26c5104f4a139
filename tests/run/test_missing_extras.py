"""A fresh install without the ``report`` extra: ``polyrl report`` says in one line what to install (exit 2, no
traceback, nothing written) and a run writes no ``events/`` but says so once and goes on. The modules are made
unimportable in a child process (``sys.modules[name] = None``), as on a machine that never installed them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

CLI = """
import sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None  # import name -> ImportError
from polyrl.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _polyrl(hidden: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, hidden, *args], capture_output=True, text=True, cwd=ROOT)


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "reward/mean": 0.1 * i, "loss/policy": 0.5, "time/step_s": 1.0} for i in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_without_matplotlib_says_what_to_install(tmp_path):
    run = _run_dir(tmp_path)
    proc = _polyrl("matplotlib", "report", str(run))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "polyrl report: error: the report's plots need matplotlib, which is not installed: pip install 'polyrl[report]'"]
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # nothing written


def test_a_run_without_tensorboard_says_so_once_and_writes_the_rest(tmp_path):
    out = tmp_path / "tiny"
    proc = _polyrl("tensorboard", "run", "recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "--no-progress",
                   "trainer.total_steps=1", "data.batch_size=4", "rollout.n=2")
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "TensorBoard" in x]
    assert lines == ["polyrl run: no TensorBoard events/ in the run directory: tensorboard is not installed "
                     "(pip install 'polyrl[report]'); metrics.jsonl holds every metric"]
    assert "Traceback" not in proc.stderr
    assert (out / "metrics.jsonl").is_file() and not (out / "events").exists()


def test_with_tensorboard_the_run_says_nothing_of_it(tmp_path):
    out = tmp_path / "tiny"
    proc = _polyrl("", "run", "recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "--no-progress",
                   "trainer.total_steps=1", "data.batch_size=4", "rollout.n=2")
    assert proc.returncode == 0, proc.stderr
    assert "TensorBoard" not in proc.stderr and any((out / "events").iterdir())
