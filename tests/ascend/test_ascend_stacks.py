"""The Ascend stacks: every row of ``ASCEND_STACKS`` installs with polyrl, and no vllm-ascend release does — resolved
on the CPU from pins, never by installing torch-npu.

Each vllm-ascend release's install pins are frozen in data/vllm_ascend_pins.txt (its requirements.txt, README's
Python, the Dockerfile's CANN and vLLM tag, at the tag's commit); polyrl's own come from pyproject.toml. A set of
pins "installs together" when some transformers version, the torch pin and some Python satisfy every specifier.
If a newer vllm-ascend release accepts polyrl's transformers, adding its block to the data fails
``test_no_vllm_ascend_release_installs_beside_polyrl`` until it becomes a row.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from frozen_sources import sections
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from polyrl.backends.ascend import compat
from polyrl.core.compat import Environment

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
PINS = Path(__file__).parent / "data" / "vllm_ascend_pins.txt"
# Versions tried for "some version satisfies every specifier": every x.y.z with x in 4..5, y < 30, z < 10.
TRANSFORMERS_GRID = [Version(f"{a}.{b}.{c}") for a in (4, 5) for b in range(30) for c in range(10)]
PYTHONS = [Version(f"3.{m}") for m in range(8, 16)]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _polyrl_pins() -> dict[str, SpecifierSet]:
    project = _pyproject()["project"]
    reqs = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    return {"torch": reqs["torch"], "transformers": reqs["transformers"],
            "python": SpecifierSet(project["requires-python"])}


def _releases() -> dict[str, dict[str, SpecifierSet]]:
    """tag -> name -> specifier, from the frozen pins."""
    out: dict[str, dict[str, SpecifierSet]] = {}
    for tag, lines in sections(PINS).items():
        out[tag] = {}
        for line in lines:
            name, spec = re.match(r"^([A-Za-z][\w-]*)\s*(.*)$", line).groups()
            out[tag][name] = SpecifierSet(spec.replace(" ", ""))
    return out


def _exact(spec: SpecifierSet) -> str:
    (only,) = list(spec)
    assert only.operator == "==", spec
    return only.version


def _conflicts(pins: dict[str, SpecifierSet]) -> list[str]:
    """What keeps ``pins`` (a vllm-ascend release's or a row's) from installing beside polyrl, [] when nothing."""
    ours = _polyrl_pins()
    why = []
    wanted = [ours["transformers"], pins["transformers"]] + ([pins["vllm-transformers"]]
                                                             if "vllm-transformers" in pins else [])
    if not any(all(v in s for s in wanted) for v in TRANSFORMERS_GRID):
        why.append(f"transformers {' and '.join(str(s) for s in wanted)}")
    torch = Version(_exact(pins["torch"]))
    if torch not in ours["torch"]:
        why.append(f"torch {torch} outside {ours['torch']}")
    if not any(p in ours["python"] and p in pins["python"] for p in PYTHONS):
        why.append(f"Python {pins['python']} and {ours['python']}")
    return why


def test_the_frozen_pins_are_the_release_table() -> None:
    releases = _releases()
    assert {"v0.13.0", "v0.14.0rc1", "v0.15.0rc1", "v0.18.0", "v0.23.0"} <= set(releases)
    for line, row in compat.VLLM_ASCEND_RELEASES.items():
        pins = releases[row.tag]
        assert row.tag.startswith(f"v{line}.")
        assert (_exact(pins["torch"]), _exact(pins["torch-npu"]), _exact(pins["cann"])) == (
            row.torch, row.torch_npu, row.cann), line
        assert pins["transformers"] == SpecifierSet(row.transformers), line


def test_no_vllm_ascend_release_installs_beside_polyrl() -> None:
    """The finding behind the table: v0.13.0 pins transformers < 5; v0.14-v0.18 accept 5.x themselves but run on a
    vLLM that pins < 5; v0.23.0 on pin one 5.x below polyrl's 5.16.1."""
    for tag, pins in _releases().items():
        why = _conflicts(pins)
        assert why and why[0].startswith("transformers"), (tag, why)
    assert all(stack.vllm_ascend is None for stack in compat.ASCEND_STACKS)


@pytest.mark.parametrize("stack", compat.ASCEND_STACKS, ids=lambda s: f"torch_npu-{s.torch_npu}")
def test_every_row_installs_with_polyrl(stack) -> None:
    pins = {"torch": SpecifierSet(f"=={stack.torch}"), "transformers": SpecifierSet(stack.transformers),
            "python": SpecifierSet(stack.python)}
    assert _conflicts(pins) == []
    assert SpecifierSet(stack.transformers) == _polyrl_pins()["transformers"]
    assert Version(stack.torch_npu).base_version == stack.torch  # torch_npu X.Y.Z pairs torch X.Y.Z
    paired = _releases()[stack.paired_with]  # the CANN / torch pair one vllm-ascend release was built on
    assert (_exact(paired["cann"]), _exact(paired["torch"]), _exact(paired["torch-npu"])) == (
        stack.cann, stack.torch, stack.torch_npu)
    assert paired["python"] == SpecifierSet(stack.python)


def test_the_rows_are_newest_first() -> None:
    versions = [Version(s.torch_npu) for s in compat.ASCEND_STACKS]
    assert versions == sorted(versions, reverse=True)


def test_the_ascend_extra_installs_nothing_that_cannot_coexist() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    assert not any(Requirement(r).name == "vllm-ascend" for r in extras["ascend"])


def _env(**versions: str) -> Environment:
    return Environment(versions={k.replace("_", "-"): v for k, v in versions.items()}, requires={},
                       facts={compat.CANN_FACT: "8.5.0"})


def test_doctor_refuses_the_seed_era_stack_in_one_line_naming_the_newest_row() -> None:
    problems = compat.seed_era_stack(_env(torch="2.8.0", torch_npu="2.8.0.post2", transformers="4.57.6",
                                          vllm_ascend="0.13.0"))
    assert len(problems) == 1
    text = f"{problems[0].message} {problems[0].advice}"
    assert "\n" not in text and "seed-era" in text and "vllm-ascend 0.13.0" in text
    assert compat.ASCEND_STACKS[0].line() in text and "torch-npu==2.10.0.post4" in text
    assert not compat.seed_era_stack(_env(torch="2.8.0", torch_npu="2.8.0.post2", transformers="5.19.0"))
    assert not compat.seed_era_stack(_env(transformers="4.57.6"))  # not an Ascend machine


def test_vllm_ascend_014_has_its_row() -> None:
    env = _env(torch="2.9.0", torch_npu="2.9.0", vllm_ascend="0.14.0rc1", vllm="0.14.1")
    assert compat.vllm_ascend_pairs(env) == []  # known: no "not in polyrl's compatibility table"
    line, release = compat.vllm_ascend_release("0.14.0rc1")
    assert line == "0.14" and not release.gpt_oss_sinks
    assert "GPT-OSS" in compat.vllm_ascend_model_problem("0.14.0rc1", "gpt_oss")
