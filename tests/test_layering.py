"""The layering law, checked on the source:

1. ``polyrl/core`` and ``polyrl/cli`` import nothing vendor-specific (torch.cuda, torch_npu, triton, vllm,
   flash_attn), at any depth (a lazy ``import triton`` inside a function is still a breach), and never name a
   particular backend package (``polyrl.backends.cuda``): the CLI reaches backends through the registry.
2. Neither makes a hardware decision: no comparison with a device-type, vendor or collective-library name
   (``device.type == "cuda"``, ``name == "ascend"``, ``get_backend() == "gloo"``) and no ``torch.version.cuda``
   — such decisions are the Backend's.
3. The package's import graph has no cycle and imports only go down the layer order below — imports under
   ``if TYPE_CHECKING:`` included: a type a unit names is a dependency on it, whether or not Python runs the
   import; and no cycle between modules either, inside one unit included (``a.py`` importing ``b.py`` importing
   ``a.py``, even lazily, works only as long as nobody reorders an import). Between modules of one unit only the
   imports that run count: a part annotating the class that composes it (``BackendPart.backend: Backend``) can
   reorder nothing.

Each checker has a companion test that plants a violation and shows it is caught.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import polyrl

PKG = Path(polyrl.__file__).parent
CORE, CLI = PKG / "core", PKG / "cli"
FORBIDDEN = ("torch.cuda", "torch_npu", "triton", "vllm", "flash_attn", "polyrl.backends")
DEVICE_NAMES = frozenset({"cpu", "cuda", "npu", "xpu", "mps", "hip", "rocm", "ascend", "nccl", "hccl", "gloo"})

# Lowest first; a unit may import its own layer's units and any lower layer, never a higher one. The root
# package ``polyrl`` (version, the transformers registration hook) runs before any of its modules anyway and is
# not a layer.
LAYERS: list[set[str]] = [
    {"_moved", "core.errors", "core.tolerances", "core.compat", "core.dtypes"},
    {"core.config", "core.algorithms", "core.data", "core.rewards"},
    {"core.plugins", "core.distributed"},
    {"core.attention", "core.tasks"},
    {"core.models", "core.rollout", "core.run"},
    {"core.trainer", "core.plan"},
    {"backends"},
    {"testing"},
    {"plugins"},
    {"parity", "emulation"},
    {"cli", "__main__"},
]


# --- 1. vendor imports -------------------------------------------------------------------------------
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


# --- 2. hardware decisions -----------------------------------------------------------------------------
def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def hardware_decisions(root: Path) -> list[str]:
    """Comparisons against a device/vendor/collective name, and reads of torch.version.cuda / .hip."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Compare):
                for operand in [node.left, *node.comparators]:
                    consts = [operand] if isinstance(operand, ast.Constant) else (
                        list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [])
                    names = {c.value.lower() for c in consts if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                    if names & DEVICE_NAMES:
                        bad.append(f"{where}: compares with {sorted(names & DEVICE_NAMES)}")
            elif isinstance(node, ast.Attribute) and _dotted(node) in ("torch.version.cuda", "torch.version.hip"):
                bad.append(f"{where}: reads {_dotted(node)}")
    return bad


# --- 3. the import graph ---------------------------------------------------------------------------------
def _unit(module: str) -> str | None:
    """The layer unit of a polyrl module: core.<package or module>, backends, testing, cli; None for the root."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if parts[0] == "core":
        return "core" if len(parts) == 1 else f"core.{parts[1]}"
    return parts[0]


def _module_name(path: Path, pkg: Path) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, pkg: Path) -> bool:
    path = pkg.parent.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def import_graph(pkg: Path) -> dict[str, set[tuple[str, str]]]:
    """unit -> {(imported unit, 'file:line')}, function-level and TYPE_CHECKING imports included."""
    name = pkg.name
    graph: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(pkg.rglob("*.py")):
        src = _unit(_module_name(path, pkg))
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level or not node.module:
                    continue
                # `from polyrl.core import distributed` names a submodule; `from polyrl import __version__` or
                # `from polyrl.core.x import f` name the module itself.
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if _is_module(t, pkg) else node.module for t in targets]
            else:
                targets = [a.name for a in node.names]
            for t in targets:
                if t == name or t.startswith(name + "."):
                    dst = _unit(t)
                    if src is not None and dst not in (None, src, "core"):
                        graph.setdefault(src, set()).add((dst, f"{path.relative_to(pkg.parent)}:{node.lineno}"))
    return graph


def layer_violations(graph: dict[str, set[tuple[str, str]]], layers: list[set[str]]) -> list[str]:
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    bad = []
    for src, edges in sorted(graph.items()):
        for dst, where in sorted(edges):
            if src not in rank or dst not in rank:
                bad.append(f"{where}: {src} -> {dst}: unit missing from the layer order")
            elif rank[dst] > rank[src]:
                bad.append(f"{where}: {src} (layer {rank[src]}) imports {dst} (layer {rank[dst]})")
    return bad


def cycles(graph: dict[str, set[tuple[str, str]]]) -> list[list[str]]:
    """Every elementary cycle's smallest representative, found by depth-first search (the graph is small)."""
    adj = {u: sorted({d for d, _ in e}) for u, e in graph.items()}
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in adj.get(path[-1], []):
            if nxt == path[0]:
                i = path.index(min(path))
                found.add(tuple(path[i:] + path[:i]))
            elif nxt not in path and nxt > path[0]:
                walk([*path, nxt])

    for start in adj:
        walk([start])
    return [list(c) for c in sorted(found)]


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names, relative forms (``from . import x``) included."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def module_graph(pkg: Path) -> dict[str, set[str]]:
    """module -> {imported module of the package}, function-level imports included, TYPE_CHECKING ones not.
    ``from p import x`` names the module ``p.x`` when that is a module, else ``p`` itself."""
    name = pkg.name
    graph: dict[str, set[str]] = {}
    for path in sorted(pkg.rglob("*.py")):
        src = _module_name(path, pkg)
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        edges = graph.setdefault(src, set())
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom):
                base = _resolve(node, src, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", pkg) else base for a in node.names]
            else:
                targets = [a.name for a in node.names]
            edges.update(t for t in targets if (t == name or t.startswith(name + ".")) and t != src)
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds at least one cycle), sorted;
    Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# --- the tests on polyrl --------------------------------------------------------------------------------
def test_core_and_cli_have_no_vendor_imports():
    assert CORE.is_dir() and len(list(CORE.rglob("*.py"))) > 5 and CLI.is_dir()
    assert vendor_imports(CORE) + vendor_imports(CLI) == []


def test_core_and_cli_make_no_hardware_decisions():
    assert hardware_decisions(CORE) + hardware_decisions(CLI) == []


def test_imports_go_down_the_layer_order():
    graph = import_graph(PKG)
    assert len(graph) >= 8  # the graph was actually built
    assert layer_violations(graph, LAYERS) == []


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph(PKG)) == []


def test_no_two_modules_import_each_other():
    graph = module_graph(PKG)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the graph was actually built
    assert module_cycles(graph) == []


# --- each checker catches a planted violation -------------------------------------------------------------
def test_the_import_checker_catches_each_form(tmp_path):
    pkg = tmp_path / "core"
    pkg.mkdir()
    (pkg / "a.py").write_text("import torch.cuda\n")
    (pkg / "b.py").write_text("def f():\n    from torch import cuda\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('torch_npu')\n")
    (pkg / "d.py").write_text("from vllm.engine import LLM\nimport triton.language as tl\nimport flash_attn\n")
    (pkg / "e.py").write_text("from polyrl.backends.ascend import AscendBackend\n")
    (pkg / "ok.py").write_text("import torch\nimport torch.distributed\nimport tritonclient_not_triton\n")
    bad = vendor_imports(pkg)
    flagged = {b.split(":")[0].rsplit("/", 1)[-1] for b in bad}
    assert flagged == {"a.py", "b.py", "c.py", "d.py", "e.py"}, bad
    assert sum("d.py" in b for b in bad) >= 3  # every vendor line in d.py, not just the first


def test_the_hardware_decision_checker_catches_each_form(tmp_path):
    pkg = tmp_path / "cli"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(t):\n    return t.device.type != 'cpu'\n")
    (pkg / "b.py").write_text("def f(name):\n    if name == 'ascend':\n        return 1\n")
    (pkg / "c.py").write_text("import torch.distributed as d\nx = d.get_backend() in ('gloo', 'mpi')\n")
    (pkg / "d.py").write_text("import torch\nv = torch.version.cuda\n")
    (pkg / "ok.py").write_text("x = {'cpu': 1}\ny = 'cuda' + 'x'\nz = len('npu') == 3\n")
    flagged = {b.split(":")[0].rsplit("/", 1)[-1] for b in hardware_decisions(pkg)}
    assert flagged == {"a.py", "b.py", "c.py", "d.py"}


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "polyrl"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in itertools.takewhile(lambda p: p != tmp_path, path.parents):
            (parent / "__init__.py").touch()
        path.write_text(text)
    return pkg


def test_the_layer_checker_catches_an_upward_import(tmp_path):
    pkg = _plant(tmp_path, {
        "core/config/schema.py": "def f():\n    from polyrl.core.trainer import Trainer\n",  # lazy, still upward
        "core/trainer/loop.py": "from polyrl.core.config import schema\n",  # downward: fine
        "cli/run.py": "from polyrl.core.trainer.loop import f\n",
    })
    bad = layer_violations(import_graph(pkg), LAYERS)
    assert len(bad) == 1 and "core.config (layer 1) imports core.trainer (layer 5)" in bad[0], bad


def test_the_layer_checker_refuses_an_unplaced_unit(tmp_path):
    pkg = _plant(tmp_path, {"core/newthing/x.py": "from polyrl.core.errors import E\n"})
    assert any("missing from the layer order" in b for b in layer_violations(import_graph(pkg), LAYERS))


def test_the_cycle_checker_catches_a_cycle(tmp_path):
    pkg = _plant(tmp_path, {
        "core/tasks/a.py": "from polyrl.core.rewards.b import g\n",
        "core/rewards/b.py": "def g():\n    from polyrl.core.tasks import a\n",
        "core/config/c.py": "from polyrl.core.errors import E\n",
    })
    assert cycles(import_graph(pkg)) == [["core.rewards", "core.tasks"]]


def test_the_cycle_checker_sees_imports_made_only_for_type_checking(tmp_path):
    # The 0.2 tree's circle: the Backend imported the expert exchange lazily, the exchange named the Backend in a
    # type hint only.
    pkg = _plant(tmp_path, {
        "core/plugins/backend.py": "def expert_dispatch():\n    from polyrl.core.distributed.expert_parallel import dispatch\n",
        "core/distributed/expert_parallel.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from polyrl.core.plugins.backend import Backend\n"),
        "core/config/schema.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from polyrl.core.trainer import T\n",
    })
    graph = import_graph(pkg)
    assert cycles(graph) == [["core.distributed", "core.plugins"]]
    assert any("core.config (layer 1) imports core.trainer (layer 5)" in b for b in layer_violations(graph, LAYERS))


def test_the_module_cycle_checker_catches_a_cycle_inside_one_unit(tmp_path):
    # Both imports lazy and inside one package: the unit graph has no edge at all; the module graph has the cycle.
    pkg = _plant(tmp_path, {
        "parity/harness.py": "def run():\n    from polyrl.parity import train\n",
        "parity/train.py": "def step():\n    from polyrl.parity.harness import ROW\n",
        "parity/rows.py": "ROW = 1\n",
        "parity/plot.py": "from .rows import ROW\nfrom . import harness\n",  # relative forms resolve too
        "core/tasks/a.py": "from polyrl.core.tasks.b import f\n",
        "core/tasks/b.py": "import polyrl.core.tasks.c\n",
        "core/tasks/c.py": "from polyrl.core.tasks import a\n",
    })
    assert cycles(import_graph(pkg)) == []
    graph = module_graph(pkg)
    assert graph["polyrl.parity.plot"] == {"polyrl.parity.rows", "polyrl.parity.harness"}
    assert module_cycles(graph) == [["polyrl.core.tasks.a", "polyrl.core.tasks.b", "polyrl.core.tasks.c"],
                                    ["polyrl.parity.harness", "polyrl.parity.train"]]
