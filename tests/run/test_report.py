"""polyrl report: PNG + Markdown from a run directory; bad input exits 2 with one line."""

from __future__ import annotations

import json
import math

import pytest

from polyrl.cli import main as cli_main
from polyrl.core.errors import BadInputError
from polyrl.core.run.report import read_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(tmp_path, *, ppo=True, steps=30, config=True, partial_last_line=False):
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for s in range(1, steps + 1):
        record = {"step": s, "reward/mean": 0.1 + 0.8 * s / steps, "loss/policy": 1.0 / s,
                  "actor/pg_clipfrac": 0.01, "actor/pg_clipfrac_lower": 0.001, "actor/kl": 0.001 * s,
                  "response/length_mean": 4.0, "time/step_s": 0.5, "dapo/groups_filtered": s % 3,
                  "mismatch/k1": 1e-3 / s, "mismatch/k3": 5e-4 / s, "mismatch/is_mean": 1.0, "mismatch/is_max": 1.5,
                  "mismatch/seq_is_mean": 1.0, "mismatch/is_clipped_frac": 0.01, "mismatch/masked_frac": 0.0}
        if ppo:
            record["loss/value"] = 2.0 / s
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n"
    if partial_last_line:
        text += '{"step": 31, "reward/me'
    (run / "metrics.jsonl").write_text(text)
    if config:
        (run / "config.yaml").write_text("model:\n  arch: gpt_oss\n  hidden: 32\nalgorithm:\n  name: dapo\n  clip_high: 0.28\n")
    return run


def test_report_writes_png_and_summary(tmp_path):
    run = make_run(tmp_path)
    png, md = write_report(run)
    assert png == run / "report.png" and md == run / "report.md"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    text = md.read_text()
    assert "steps logged: 30 (last step 30)" in text
    first10 = sum(0.1 + 0.8 * s / 30 for s in range(1, 11)) / 10
    last10 = sum(0.1 + 0.8 * s / 30 for s in range(21, 31)) / 10
    assert f"first 10 steps {first10:.4g}" in text and f"last 10 steps {last10:.4g}" in text
    assert "15 s in steps" in text
    assert "loss/value 0.06667" in text  # final losses
    for panel in ("reward", "losses", "value loss", "KL", "clip fractions", "response length", "DAPO sampling",
                  "mismatch KL (engine vs trainer)", "rollout IS weights", "rollout correction: clipped / masked"):
        assert panel in text.split("Panels drawn:")[1]
    assert "| `model.arch` | gpt_oss |" in text and "| `algorithm.clip_high` | 0.28 |" in text


def test_report_without_optional_metrics_or_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "loss/policy": 0.1}) + "\n")
    png, md = write_report(run)
    assert png.read_bytes()[:8] == PNG_MAGIC
    text = md.read_text()
    assert "loss/value" not in text and "## Config" not in text
    assert "Panels drawn: reward, losses." in text


def test_half_written_last_line_and_non_finite_values_are_tolerated(tmp_path):
    run = make_run(tmp_path, steps=5, config=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 6, "reward/mean": math.nan, "loss/policy": 0.2}) + "\n")
        f.write('{"step": 7, "reward/me')  # a run killed while writing its last line
    records, skipped = read_metrics(run)
    assert len(records) == 6 and skipped == 1
    _, md = write_report(run)
    assert "unreadable lines skipped in metrics.jsonl: 1" in md.read_text()


@pytest.mark.parametrize("damage", ["garbled_line", "not_utf8", "bad_config"])
def test_corrupt_files_are_refused_with_one_line_naming_them(tmp_path, capsys, damage):
    """The checkpoint rule for what report reads: an unreadable line that is not a killed run's last
    line, or an unreadable config.yaml, is refused (exit 2, one line naming the file), nothing written."""
    run = make_run(tmp_path, steps=5)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().split(b"\n")
    if damage == "garbled_line":
        lines[2] = lines[2][:10]
        named = "metrics.jsonl: line 3 is not a metrics record"
    elif damage == "not_utf8":
        lines[3] = lines[3][:5] + b"\xff" + lines[3][6:]
        named = "metrics.jsonl: line 4 is not UTF-8"
    else:
        (run / "config.yaml").write_text("model: [unclosed\n")
        named = "config.yaml: unreadable"
    metrics.write_bytes(b"\n".join(lines))
    assert cli_main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err and "Traceback" not in err
    assert not (run / "report.png").exists() and not (run / "report.md").exists()


def test_cli_report_ok_and_bad_input(tmp_path, capsys):
    run = make_run(tmp_path, steps=3)
    assert cli_main(["report", str(run)]) == 0
    assert "report.png" in capsys.readouterr().out

    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not found" in err and "Traceback" not in err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no metrics.jsonl" in err and err.count("\n") == 0
    assert not (empty / "report.png").exists()  # nothing written on bad input


def test_metrics_file_without_records_is_bad_input(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n\n")
    with pytest.raises(BadInputError, match="no metric records"):
        write_report(run)
    (run / "metrics.jsonl").write_text("\n[1, 2]\n")
    with pytest.raises(BadInputError, match=r"line 2 is not a metrics record \(not a JSON object\)"):
        write_report(run)


def test_duplicate_steps_are_refused_with_one_line(tmp_path, capsys):
    """Two histories in one file (two runs at once, or an old resume): refused, not plotted."""
    run = make_run(tmp_path, steps=5, config=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": 0.1, "loss/policy": 0.2}) + "\n")
    with pytest.raises(BadInputError, match=r"step 3 appears twice \(lines 3 and 6\)"):
        read_metrics(run)
    assert cli_main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "step 3 appears twice" in err and "Traceback" not in err
    assert not (run / "report.png").exists() and not (run / "report.md").exists()
