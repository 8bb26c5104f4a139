"""The example plugin distributions (the dummy backend, the faulty plugins) pip-installed once per session into a
private directory, and the ways the tests put it in front of polyrl."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from polyrl.core import plugins
from polyrl.testing.plugin_site import install_plugins

PLUGIN_SRC = Path(__file__).parent
SOURCES = [PLUGIN_SRC / "polyrl_dummy_backend", PLUGIN_SRC / "polyrl_faulty_plugins"]


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """Both plugin packages installed into a private directory (the venv is left untouched)."""
    site = install_plugins(SOURCES, tmp_path_factory.mktemp("plugin_site"))
    assert any(p.name.startswith("polyrl_dummy_backend-") for p in site.iterdir())
    return site


@pytest.fixture
def with_plugins(plugin_site, monkeypatch):
    """The plugins importable and autoloaded in this process; the registry reloaded before and after."""
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv("POLYRL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    plugins.reset_registry()
    yield plugin_site
    plugins.reset_registry()


@pytest.fixture
def site_cli(plugin_site) -> Callable[..., subprocess.CompletedProcess]:
    """``site_cli(args, *python_options, **env)``: the real ``polyrl`` command in a fresh process that sees the
    plugins, with no POLYRL_* variable inherited but ``env``."""

    def run(args: list[str], *python_options: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("POLYRL_")}
        full_env.update(env)
        full_env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), full_env.get("PYTHONPATH", "")])
        return subprocess.run([sys.executable, *python_options, "-m", "polyrl", *args], capture_output=True,
                              text=True, env=full_env)

    return run
