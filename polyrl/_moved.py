"""Old module paths kept importable for one minor version: each resolves to the module that replaced it (the
same module object, so its private names and monkeypatching still work) with a ``DeprecationWarning`` naming
the path to use.

The aliases are answered by an import finder, not by files at the old paths: a file left there would make git
see an edit of the old file instead of a rename, and edits made elsewhere to the old file would no longer
follow the module to its new place. ``polyrl/__init__.py`` installs the finder; importing an old path always
imports ``polyrl`` first.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import warnings
from typing import Any

# old path -> (module that replaced it, what to import instead, release that removes the alias). The removals
# announced for 0.3.0 moved to 0.4.0: 0.3.0 asks plugin authors to move already (the Backend's parts), and one
# release should not ask twice.
MOVED: dict[str, tuple[str, str, str]] = {
    "polyrl.testing.parity": ("polyrl.parity.harness", "polyrl.parity", "0.4.0"),
    "polyrl.testing.train_parity": ("polyrl.parity.train", "polyrl.parity.train", "0.4.0"),
    "polyrl.testing.parity_plot": ("polyrl.parity.plot", "polyrl.parity.plot", "0.4.0"),
    "polyrl.testing.emulation": ("polyrl.emulation", "polyrl.emulation", "0.4.0"),
    "polyrl.testing.npu_emulator": ("polyrl.emulation.npu", "polyrl.emulation.npu", "0.4.0"),
    "polyrl.core.run.plan": ("polyrl.core.plan.memory", "polyrl.core.plan", "0.4.0"),
    # Moved in 0.1.x without an alias; back as aliases in 0.2.0 so that plugins written against them load.
    "polyrl.core.backend": ("polyrl.core.plugins.backend", "polyrl.plugins", "0.4.0"),
    "polyrl.core.hookspecs": ("polyrl.core.plugins.hookspecs", "polyrl.plugins", "0.4.0"),
}


def message(old: str) -> str:
    _, use, until = MOVED[old]
    return f"{old} is deprecated and will be removed in polyrl {until}; import {use} instead"


class _AliasLoader:
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        # stacklevel 2: the import machinery's own frames are skipped, so the warning names the importing line.
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        """The target module was executed when it was imported."""

    def get_code(self, fullname: str) -> Any:
        # `python -m OLD.PATH` runs the new module's code as __main__.
        warnings.warn(message(fullname), DeprecationWarning, stacklevel=2)
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)  # type: ignore[union-attr]


class _AliasFinder:
    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        entry = MOVED.get(fullname)
        return None if entry is None else importlib.machinery.ModuleSpec(fullname, _AliasLoader(entry[0]))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
