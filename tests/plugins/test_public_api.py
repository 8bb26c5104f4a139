"""The public surface for plugin authors: ``polyrl.plugins`` holds what a backend, task or engine plugin needs
(the very objects the implementation uses), imports cheaply, and a plugin written against the 0.1 module paths
still loads — with a DeprecationWarning naming ``polyrl.plugins`` — beside one written against the new one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import polyrl
import polyrl.plugins as api
from polyrl.core import compat, plugins, rollout, tasks
from polyrl.core.plugins import backend, hookspecs
from polyrl.testing import conformance

ROOT = Path(__file__).parents[2]


def test_the_public_module_exports_the_implementation_objects():
    assert sorted(api.__all__) == sorted(set(api.__all__))
    for name in api.__all__:
        assert hasattr(api, name), name
    # Same objects, not copies: an isinstance check or a registry lookup sees no difference.
    assert api.Backend is backend.Backend and api.Availability is backend.Availability
    assert api.ShardingPolicy is backend.ShardingPolicy and api.hookimpl is hookspecs.hookimpl
    assert api.register_plugin is plugins.register_plugin and api.Compatibility is compat.Compatibility
    assert api.Task is tasks.Task and api.RolloutEngine is rollout.RolloutEngine
    assert api.run_conformance is conformance.run_conformance and api.ATTENTION_CASES is conformance.ATTENTION_CASES


def test_importing_the_public_module_loads_no_torch():
    code = "import sys, polyrl.plugins\nprint(sorted(m for m in ('torch', 'triton', 'torch_npu', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plugins_on_the_old_paths_and_on_the_new_one_both_load(site_cli):
    proc = site_cli(["backends", "--json"], "-W", "always::DeprecationWarning")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    names = {b["name"] for b in data["backends"]}
    assert {"dummy", "dummy2", "dummy_legacy"} <= names  # new path (dummy, dummy2) and old paths (dummy_legacy)
    assert not [n for n in data["not_loaded"] if n["name"].startswith("dummy")]
    # The legacy plugin's two old imports each warned, naming the path to use, at the plugin's own lines.
    for old in ("polyrl.core.backend", "polyrl.core.hookspecs"):
        line = next(x for x in proc.stderr.splitlines() if f"{old} is deprecated" in x)
        assert "DeprecationWarning" in line and "import polyrl.plugins instead" in line
        assert "polyrl_dummy_backend/legacy.py" in line


def test_the_version_is_declared_once_and_has_its_changelog_entry():
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert polyrl.__version__ == declared
    assert re.search(rf"^## {re.escape(declared)}\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
