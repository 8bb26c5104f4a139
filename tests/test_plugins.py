"""The dummy out-of-tree backend (tests/plugins/polyrl_dummy_backend) is found, listed, selectable,
refused when the allow-list excludes it, and two available candidates without a choice are an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.core import plugins
from polyrl.core.errors import BackendSelectionError
from polyrl.core.plugins import selection

DUMMY_SRC = Path(__file__).parent / "plugins" / "polyrl_dummy_backend"


@pytest.fixture(scope="session")
def dummy_site(tmp_path_factory) -> Path:
    """Install the dummy plugin package into a private directory (the venv is left untouched)."""
    target = tmp_path_factory.mktemp("dummy_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(DUMMY_SRC)],
        check=True,
    )
    assert any(p.name.startswith("polyrl_dummy_backend-") for p in target.iterdir())
    return target


@pytest.fixture
def with_dummy(dummy_site, monkeypatch):
    monkeypatch.syspath_prepend(str(dummy_site))
    monkeypatch.delenv("POLYRL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    plugins.reset_registry()
    yield dummy_site
    plugins.reset_registry()


def _cli(args: list[str], site: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("POLYRL_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(site), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True, env=full_env)


def test_dummy_is_discovered_and_listed_with_its_distribution(dummy_site):
    proc = _cli(["backends", "--json"], dummy_site)
    assert proc.returncode == 0, proc.stderr
    by_name = {b["name"]: b for b in json.loads(proc.stdout)["backends"]}
    assert {"cpu", "cuda", "ascend", "dummy", "dummy2"} <= set(by_name)
    assert by_name["dummy"]["distribution"] == "polyrl-dummy-backend"
    assert by_name["dummy"]["version"] == "0.0.1"
    assert by_name["dummy"]["available"] is False
    assert by_name["dummy"]["kernels_fallback"] == ["varlen_attention", "logprobs"]
    assert by_name["cpu"]["distribution"] == "polyrl"


def test_autoload_disabled_hides_third_party(dummy_site):
    proc = _cli(["backends", "--json"], dummy_site, POLYRL_DISABLE_PLUGIN_AUTOLOAD="1")
    data = json.loads(proc.stdout)
    assert "dummy" not in {b["name"] for b in data["backends"]}
    assert "dummy" in {s["name"] for s in data["not_loaded"]}


def test_dummy_selectable_by_name(with_dummy, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    assert selection.resolve_backend("dummy").name == "dummy"
    monkeypatch.setenv("POLYRL_BACKEND", "dummy")
    assert selection.resolve_backend().name == "dummy"


def test_unavailable_backend_by_name_is_refused_with_reason(with_dummy):
    with pytest.raises(BackendSelectionError, match="not available: POLYRL_DUMMY_AVAILABLE"):
        selection.resolve_backend("dummy")


def test_allow_list_excludes_plugin(with_dummy, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    monkeypatch.setenv("POLYRL_LOAD_PLUGINS", "dummy2")
    plugins.reset_registry()
    assert "dummy" not in plugins.list_backends()
    assert "dummy2" in plugins.list_backends()
    with pytest.raises(BackendSelectionError, match="not in POLYRL_LOAD_PLUGINS"):
        selection.resolve_backend("dummy")


def test_two_available_candidates_without_choice_is_an_error_naming_both(with_dummy, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    with pytest.raises(BackendSelectionError) as err:
        selection.resolve_backend()
    assert "dummy" in str(err.value) and "dummy2" in str(err.value)
    # An explicit choice resolves it.
    assert selection.resolve_backend("dummy2").name == "dummy2"


def test_single_available_candidate_wins_over_cpu(with_dummy, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    monkeypatch.setenv("POLYRL_LOAD_PLUGINS", "dummy")
    plugins.reset_registry()
    assert selection.resolve_backend().name == "dummy"


def test_default_is_cpu_without_accelerators():
    plugins.reset_registry()
    assert selection.resolve_backend().name == "cpu"


def test_plugin_tasks_hook_is_collected(with_dummy):
    assert "dummy_task" in plugins.get_registry().tasks


def test_cli_unknown_backend_in_selection_is_one_line(dummy_site):
    proc = _cli(["doctor", "--backend", "nope"], dummy_site)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "dummy" in proc.stderr and "cpu" in proc.stderr
