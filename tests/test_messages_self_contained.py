"""User-facing messages carry their own explanation: a wheel ships no docs/ and no README.md, so no string that
polyrl prints may send the user to one of those files (module and function docstrings and comments may cite
docs: they are read in the source tree)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import polyrl

PKG = Path(polyrl.__file__).parent
POINTER = re.compile(r"docs/|\b(README|[a-z_]+)\.md\b")
# Names of files polyrl itself writes, not documentation.
WRITTEN = {"report.md"}


def doc_pointers(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                hits = [m.group(0) for m in POINTER.finditer(node.value) if m.group(0) not in WRITTEN]
                if hits:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {hits}")
    return found


def test_no_message_points_to_a_file_a_wheel_lacks():
    assert doc_pointers(PKG) == []


def test_the_checker_sees_each_form(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text('"""Module docstring citing docs/recipes.md: fine."""\n'
                              'def f():\n    """docs/x.md in a docstring: fine."""\n'
                              '    raise ValueError("bad key (see docs/recipes.md)")\n')
    (pkg / "b.py").write_text('x = 3\nmsg = f"backend {x}: see the install notes in README.md"\n')
    (pkg / "c.py").write_text('# a comment citing docs/plugins.md is fine\nname = "report.md"\n')
    assert [h.split(":")[0] for h in doc_pointers(pkg)] == ["pkg/a.py", "pkg/b.py"]
