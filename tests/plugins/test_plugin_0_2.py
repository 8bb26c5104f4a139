"""A plugin written against 0.2.0's ``polyrl.plugins`` — its Backend subclass overriding the methods 0.3 moved into
the parts (``sharding_policy``, ``compatibility``, ``rollout_engine_options``, ``process_group_options`` calling
``super()``, ...) — installed through its entry point, still loads without a warning, passes the conformance kit,
and is what the parts answer with; beside it a plugin written the 0.3 way (parts subclassed, as docs/plugins.md
shows) does too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyrl.testing.plugin_site import install_plugins

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "polyrl-plugin-generations"
version = "0.2.0"

[project.entry-points."polyrl.backends"]
v02 = "polyrl_generations.v02"
v03 = "polyrl_generations.v03"

[tool.setuptools]
packages = ["polyrl_generations"]
"""

# Only names 0.2.0's polyrl.plugins exported, and only the Backend methods 0.2.0 had.
V02 = '''
from polyrl.plugins import (CAPABILITIES, KERNELS, REFERENCE_KERNELS, Availability, Backend, Compatibility,
                            ShardingPolicy, hookimpl)

assert "fp32" in CAPABILITIES and "varlen_attention" in KERNELS and set(REFERENCE_KERNELS) == set(KERNELS)


class V02Backend(Backend):
    name = "v02"
    device_type = "cpu"
    collective_backend = "gloo"
    capabilities = frozenset({"fp32", "rollout:hf"})
    device_memory_table = {"box": 8.0}

    def detect(self):
        return Availability(True)

    def sharding_policy(self):
        return ShardingPolicy(param_dtype="float32", reduce_dtype="float32", world_sizes_refused=(3,),
                              world_size_rule="v02 refuses 3")

    def check_world_size(self, world_size):
        self.checked = world_size
        super().check_world_size(world_size)

    def compatibility(self):
        return Compatibility(components=("pluggy",))

    def rollout_engine_options(self, engine):
        return {"v02": engine}

    def process_group_options(self, local_rank=0):
        return {**super().process_group_options(local_rank), "v02": True}

    def memory_metrics(self):
        return {"memory/v02": 1.0}

    def logprobs(self, logits, labels, **kwargs):  # a method override: provided, not a fallback
        return super().logprobs(logits, labels, **kwargs)


@hookimpl
def polyrl_register_backends(register):
    register(V02Backend)
'''

V03 = '''
from polyrl.plugins import (Availability, Backend, Compatibility, EngineOptions, Introspection, Placement,
                            ShardingPolicy, hookimpl)


class V03Placement(Placement):
    def sharding_policy(self):
        return ShardingPolicy(param_dtype="float32", reduce_dtype="float32", world_sizes_refused=(3,))


class V03Engines(EngineOptions):
    def rollout_engine_options(self, engine):
        return {"v03": engine}


class V03Introspection(Introspection):
    def compatibility(self):
        return Compatibility(components=("pluggy",))


class V03Backend(Backend):
    name = "v03"
    device_type = "cpu"
    collective_backend = "gloo"
    capabilities = frozenset({"fp32", "rollout:hf"})
    placement_part = V03Placement
    engines_part = V03Engines
    introspection_part = V03Introspection

    def detect(self):
        return Availability(True)


@hookimpl
def polyrl_register_backends(register):
    register(V03Backend)
'''

CHILD = r'''
import json, sys, warnings
from polyrl.core.errors import BadInputError
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from polyrl.core.plugins import get_registry
    from polyrl.plugins import run_conformance
    registry = get_registry()
    out = {"not_loaded": sorted(registry.not_loaded), "backends": {}}
    for name in ("v02", "v03"):
        b = registry.backends[name]
        report = run_conformance(name, dtype="float32")
        try:
            b.placement.check_world_size(3)
            refused = ""
        except BadInputError as exc:
            refused = str(exc)
        out["backends"][name] = {
            "ok": report.ok, "failures": [c.name for c in report.failures],
            "ran": sum(c.status == "pass" for c in report.checks),
            "refused": refused, "checked": getattr(b, "checked", None),
            "legacy_policy": b.sharding_policy().world_sizes_refused,
            "part_policy": b.placement.sharding_policy().world_sizes_refused,
            "engine": [b.engines.rollout_engine_options("hf"), b.rollout_engine_options("hf")],
            "components": [list(b.introspection.compatibility().components), list(b.compatibility().components)],
            "pg": sorted(b.collectives.process_group_options(0)),
            "memory": sorted(b.placement.memory_metrics()),
            "provided": sorted(b.introspection.provided_kernels()),
            "origin": b.introspection.origin(),
        }
out["warnings"] = [str(w.message) for w in caught
                   if issubclass(w.category, DeprecationWarning) and "polyrl" in str(w.message)]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def generations_site(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "polyrl_plugin_generations"
    (src / "polyrl_generations").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "polyrl_generations" / "__init__.py").write_text("")
    (src / "polyrl_generations" / "v02.py").write_text(textwrap.dedent(V02))
    (src / "polyrl_generations" / "v03.py").write_text(textwrap.dedent(V03))
    return install_plugins([src], tmp_path_factory.mktemp("site"))


def test_a_0_2_plugin_and_a_0_3_plugin_load_pass_the_kit_and_are_what_the_parts_answer(generations_site):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYRL_")}
    env.update(POLYRL_LOAD_PLUGINS="v02,v03",
               PYTHONPATH=os.pathsep.join([str(generations_site), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["warnings"] == [] and not {"v02", "v03"} & set(out["not_loaded"])
    v02, v03 = out["backends"]["v02"], out["backends"]["v03"]
    for b in (v02, v03):
        assert b["ok"] and b["failures"] == [] and b["ran"] > 10
        assert b["legacy_policy"] == b["part_policy"] == [3] and "world size 3 is refused" in b["refused"]
        assert b["components"] == [["pluggy"], ["pluggy"]]
    assert v02["refused"].endswith("v02 refuses 3") and v02["checked"] == 3  # the part called the override
    assert v02["engine"] == [{"v02": "hf"}, {"v02": "hf"}] and v03["engine"] == [{"v03": "hf"}, {"v03": "hf"}]
    assert v02["pg"] == ["device_id", "v02"] and v02["memory"] == ["memory/v02"]  # super() reached the default
    assert v02["provided"] == ["logprobs"] and v03["provided"] == []
    assert v02["origin"] == "v02 (polyrl-plugin-generations 0.2.0)"
