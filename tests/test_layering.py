"""polyrl/core is hardware-free: walk its AST and fail on any vendor import, at any depth (also inside
functions: a lazy `import triton` in core is still a layering breach)."""

from __future__ import annotations

import ast
from pathlib import Path

import polyrl

CORE = Path(polyrl.__file__).parent / "core"
FORBIDDEN = ("torch.cuda", "torch_npu", "triton", "vllm", "flash_attn")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from torch import cuda` is torch.cuda too.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return found


def _is_forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def vendor_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for lineno, module in _imports(ast.parse(path.read_text(), filename=str(path))):
            if _is_forbidden(module):
                bad.append(f"{path.relative_to(root.parent)}:{lineno}: {module}")
    return bad


def test_core_has_no_vendor_imports():
    assert CORE.is_dir() and len(list(CORE.rglob("*.py"))) > 5
    assert vendor_imports(CORE) == []


def test_the_checker_catches_each_form(tmp_path):
    pkg = tmp_path / "core"
    pkg.mkdir()
    (pkg / "a.py").write_text("import torch.cuda\n")
    (pkg / "b.py").write_text("def f():\n    from torch import cuda\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('torch_npu')\n")
    (pkg / "d.py").write_text("from vllm.engine import LLM\nimport triton.language as tl\nimport flash_attn\n")
    (pkg / "ok.py").write_text("import torch\nimport torch.distributed\nimport tritonclient_not_triton\n")
    bad = vendor_imports(pkg)
    flagged = {b.split(":")[0].rsplit("/", 1)[-1] for b in bad}
    assert flagged == {"a.py", "b.py", "c.py", "d.py"}, bad
    assert sum("d.py" in b for b in bad) >= 3  # every vendor line in d.py, not just the first
