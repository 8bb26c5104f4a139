"""bench/spy_split.py: a py-spy raw recording of ``polyrl run`` split into start-up, steps, checkpoints and exit."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load_bench

MAIN = "<module> (polyrl/__main__.py:5);main (polyrl/cli/__init__.py:54)"
RUN = MAIN + ";main (polyrl/cli/run.py:102)"
PROC = RUN + ";_run_process (polyrl/cli/run.py:151)"
TRAIN = PROC + ";Trainer.train (polyrl/core/trainer/loop.py:140)"


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "spy.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_samples_land_in_their_outermost_phase_and_the_build_splits_by_callee(tmp_path, capsys):
    lines = [
        "<module> (polyrl/__main__.py:1);_find_and_load (<frozen importlib._bootstrap>:1176) 30",
        RUN + ";resolve_backend (polyrl/core/plugins/selection.py:26) 20",
        PROC + ";Trainer.__init__ (polyrl/core/trainer/loop.py:90);build_components (polyrl/core/trainer/setup.py:310)"
        ";build_models (polyrl/core/trainer/setup.py:144);to (torch/nn/modules/module.py:1) 40",
        PROC + ";Trainer.__init__ (polyrl/core/trainer/loop.py:90);build_components (polyrl/core/trainer/setup.py:310)"
        ";build_tokenizer (polyrl/core/trainer/setup.py:60) 10",
        TRAIN + ";Trainer.step (polyrl/core/trainer/loop.py:186);Trainer.collect (polyrl/core/trainer/loop.py:216) 150",
        TRAIN + ";Trainer.step (polyrl/core/trainer/loop.py:195);Trainer.update (polyrl/core/trainer/loop.py:297) 50",
        TRAIN + ";Trainer.save (polyrl/core/trainer/loop.py:177);save_checkpoint (polyrl/core/run/save.py:1) 25",
        PROC + ";pin_determinism (polyrl/core/distributed/process.py:77) 15",
        " 10",  # no Python frame
    ]
    out = tmp_path / "split.json"
    assert load_bench("spy_split").main([str(_write(tmp_path, lines)), "--rate", "10", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["samples"] == 350 and res["seconds"] == 35.0
    assert res["phases"] == {"steps": 20.0, "trainer build": 5.0, "interpreter start and imports": 3.0,
                             "checkpoints": 2.5, "cli before the run": 2.0, "run process, outside train": 1.5,
                             "no Python frame": 1.0}
    assert res["callees"]["trainer build"] == {"build_models (setup.py)": 4.0, "build_tokenizer (setup.py)": 1.0}
    assert res["callees"]["steps"] == {"Trainer.collect (loop.py)": 15.0, "Trainer.update (loop.py)": 5.0}
    assert "steps" in capsys.readouterr().out


def test_a_file_that_is_not_py_spy_raw_exits_2_in_one_line(tmp_path, capsys):
    bench = load_bench("spy_split")
    assert bench.main([str(_write(tmp_path, ["main (polyrl/cli/run.py:1) many"]))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spy_split: error:") and "is not a py-spy raw line" in err and "\n" not in err
    assert bench.main([str(tmp_path / "absent.txt")]) == 2
    assert bench.main([str(_write(tmp_path, ["x (a.py:1) 3"])), "--rate", "0"]) == 2
