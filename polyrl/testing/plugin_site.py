"""Install plugin distributions into a private directory, for tests that need real entry points.

``install_plugins([src, ...], target)`` pip-installs each source tree (no dependencies, no index, no build
isolation) into ``target``; put ``target`` on ``sys.path`` (``monkeypatch.syspath_prepend``) or ``PYTHONPATH``
and reset the registry (``polyrl.core.plugins.reset_registry()``), and the plugins load as if installed in the
environment, which stays untouched. A plugin's own test suite can use it to test its entry points::

    @pytest.fixture(scope="session")
    def site(tmp_path_factory):
        return install_plugins([Path(__file__).parents[1]], tmp_path_factory.mktemp("site"))
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_installed: dict[tuple[str, ...], Path] = {}


def install_plugins(sources: Sequence[str | Path], target: str | Path) -> Path:
    """Install ``sources`` into ``target`` once per process (a second call with the same sources returns the
    first target); returns the directory to put on ``sys.path``."""
    key = tuple(str(Path(s).resolve()) for s in sources)
    if key in _installed and _installed[key].is_dir():
        return _installed[key]
    target = Path(target)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), *key], check=True)
    _installed[key] = target
    return target
