"""Modules that moved stay importable at their old path for one minor version: the old path gives the very same
module object (private names and monkeypatching keep working) and a DeprecationWarning naming the new path,
pointing at the importing line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyrl._moved import MOVED

PROBE = r"""
import importlib, json, sys, warnings
import polyrl
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(f"import {old}")  # an import statement, as a user's code has
module = sys.modules[old]
print(json.dumps({"same": module is importlib.import_module(new), "name": module.__name__,
                  "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught]}))
"""


def _probe(old: str, new: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, old, new], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old):
    target, use, until = MOVED[old]
    out = _probe(old, target)
    assert out["same"] and out["name"] == target
    mine = [w for w in out["warnings"] if old in w[1]]
    assert len(mine) == 1, out["warnings"]
    category, text, filename = mine[0]
    assert category == "DeprecationWarning" and f"import {use} instead" in text and until in text
    assert filename == "<string>"  # the importer's line, not the import machinery's


def test_every_new_path_imports_without_warning():
    code = ("import importlib, warnings\nimport polyrl._moved as m\nwarnings.simplefilter('error')\n"
            "for target, use, _ in m.MOVED.values():\n    importlib.import_module(target); importlib.import_module(use)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_warning_is_a_real_one_and_unknown_paths_still_fail():
    # Turned into an error, the warning fails the import: it is raised, not only printed.
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                           "import polyrl.testing.npu_emulator"], capture_output=True, text=True)
    assert proc.returncode != 0 and "DeprecationWarning" in proc.stderr and "polyrl.emulation.npu" in proc.stderr
    # The finder answers only for the listed paths.
    proc = subprocess.run([sys.executable, "-c", "import polyrl.testing.no_such_module"], capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
