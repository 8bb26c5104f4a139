"""The recipe schema and loader: extends, overrides, recipe resolution and every refusal names the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from polyrl.core.config import RunConfig, dump_config, load_config, load_recipe_dict, packaged_recipes, resolve_recipe
from polyrl.core.errors import BadInputError

PACKAGED = ("gpt_oss_dapo", "deepseek_ppo", "gpt_oss_dapo_tiny", "deepseek_ppo_tiny")


def _write(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_recipes_load_and_validate(name: str) -> None:
    assert name in packaged_recipes()
    cfg = load_config(f"recipes/{name}.yaml")
    assert isinstance(cfg, RunConfig)


def test_recipe_resolves_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for spec in ("recipes/gpt_oss_dapo_tiny.yaml", "gpt_oss_dapo_tiny", "gpt_oss_dapo_tiny.yaml"):
        assert resolve_recipe(spec).name == "gpt_oss_dapo_tiny.yaml"
    # an existing local file wins over the packaged name
    (tmp_path / "recipes").mkdir()
    local = _write(tmp_path / "recipes" / "gpt_oss_dapo_tiny.yaml", {"trainer": {"total_steps": 3}})
    assert resolve_recipe("recipes/gpt_oss_dapo_tiny.yaml") == local.resolve()


def test_tiny_recipes_extend_the_full_ones() -> None:
    dapo = load_config("gpt_oss_dapo_tiny")
    assert dapo.model.name == "gpt_oss_tiny" and dapo.model.attn_implementation == "polyrl"
    # inherited DAPO knobs
    assert (dapo.algorithm.clip_low, dapo.algorithm.clip_high) == (0.2, 0.28)
    assert dapo.algorithm.dynamic_sampling.enable and dapo.algorithm.overlong.enable
    assert not dapo.algorithm.use_kl_in_reward and not dapo.algorithm.use_kl_loss
    ppo = load_config("deepseek_ppo_tiny")
    assert ppo.model.name == "deepseek_v3_tiny" and ppo.algorithm.adv_estimator == "gae"
    assert ppo.algorithm.use_kl_in_reward and ppo.algorithm.value_clip == 0.5


def test_full_recipes_hold_the_reference_knobs() -> None:
    dapo = load_config("gpt_oss_dapo")
    a = dapo.algorithm
    assert (a.clip_low, a.clip_high, a.clip_c, a.loss_agg_mode) == (0.2, 0.28, 10.0, "token-mean")
    assert (a.overlong.buffer_length, dapo.rollout.max_response_length, dapo.rollout.n) == (4096, 20480, 16)
    assert (dapo.optimizer.lr, dapo.optimizer.warmup_steps, dapo.optimizer.weight_decay) == (1e-6, 10, 0.1)
    ppo = load_config("deepseek_ppo").algorithm
    assert (ppo.gamma, ppo.lam, ppo.kl_coef, ppo.clip_c) == (1.0, 1.0, 0.001, 3.0)


def test_extends_chain_relative_path_and_deep_merge(tmp_path: Path) -> None:
    _write(tmp_path / "base.yaml", {"optimizer": {"lr": 0.5, "betas": [0.1, 0.2]}, "trainer": {"total_steps": 7}})
    _write(tmp_path / "mid.yaml", {"extends": "base.yaml", "optimizer": {"lr": 0.25}})
    sub = tmp_path / "sub"
    sub.mkdir()
    _write(sub / "top.yaml", {"extends": "../mid.yaml", "trainer": {"seed": 3}})
    cfg = load_config(sub / "top.yaml")
    assert cfg.optimizer.lr == 0.25 and cfg.optimizer.betas == [0.1, 0.2]
    assert (cfg.trainer.total_steps, cfg.trainer.seed) == (7, 3)


def test_extends_a_packaged_recipe_by_name(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path / "mine.yaml", {"extends": "recipes/gpt_oss_dapo_tiny.yaml",
                                                      "trainer": {"total_steps": 2}}))
    assert cfg.trainer.total_steps == 2 and cfg.model.name == "gpt_oss_tiny"


def test_extends_cycle_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    _write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(BadInputError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_overrides_are_yaml_typed() -> None:
    cfg = load_config("gpt_oss_dapo_tiny", ["optimizer.lr=1e-4", "optimizer.betas=[0.5, 0.6]", "trainer.seed=9",
                                            "algorithm.clip_c=null", "model.overrides.hidden_size=32",
                                            "algorithm.dynamic_sampling.enable=false"])
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.betas == [0.5, 0.6] and cfg.trainer.seed == 9
    assert cfg.algorithm.clip_c is None and cfg.model.overrides["hidden_size"] == 32
    assert cfg.algorithm.dynamic_sampling.enable is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lrr=1", "unknown key 'optimizer.lrr'"),
        ("nosection.x=1", "unknown key 'nosection'"),
        ("algorithm.overlong.bufer=3", "unknown key 'algorithm.overlong.bufer'"),
        ("optimizer.lr=fast", "optimizer.lr: expected float, got str 'fast'"),
        ("trainer.total_steps=1.5", "trainer.total_steps: expected int, got float"),
        ("trainer.total_steps=true", "trainer.total_steps: expected int, got bool"),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator: expected one of 'grpo', 'gae'"),
        ("optimizer.betas=[0.9, x]", r"optimizer.betas\[1\]: expected float"),
        ("model.overrides=3", "model.overrides: expected mapping"),
        ("optimizer=3", "optimizer: expected mapping"),
        ("optimizer.lr.x=1", "optimizer.lr is not a mapping"),
        ("justtext", "expected key.path=value"),
        ("rollout.sleep_level=2", r"rollout.sleep_level: expected null, 0 \(awake\) or 1"),
        ("rollout.sleep_level=true", "rollout.sleep_level: expected int"),
        ("rollout.sleep_level=-1", r"rollout.sleep_level: expected null, 0 \(awake\) or 1"),
    ],
)
def test_bad_overrides_name_the_key_and_the_expectation(override: str, message: str) -> None:
    with pytest.raises(BadInputError, match=message):
        load_config("gpt_oss_dapo_tiny", [override])


def test_unknown_key_and_wrong_type_in_a_file(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"unknown key 'rollout\.temprature'"):
        load_config(_write(tmp_path / "a.yaml", {"rollout": {"temprature": 1.0}}))
    with pytest.raises(BadInputError, match=r"data\.batch_size: expected int, got str"):
        load_config(_write(tmp_path / "b.yaml", {"data": {"batch_size": "many"}}))


def test_a_removed_key_is_refused_like_any_unknown_key(tmp_path: Path, capsys) -> None:
    # data.shuffle was documented but never read; it left the schema in 0.2.0. A recipe that still sets it gets
    # the unknown-key message (one line, exit 2), not a traceback and not a silent pass.
    from polyrl.cli import main as polyrl_main

    recipe = _write(tmp_path / "old.yaml", {"extends": "gpt_oss_dapo_tiny.yaml", "data": {"shuffle": False}})
    assert polyrl_main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'data.shuffle'" in err[0] and "known keys of data: " in err[0]


def test_missing_recipe_and_yaml_syntax(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"recipe not found: 'nope\.yaml'"):
        load_config("nope.yaml")
    bad = _write(tmp_path / "bad.yaml", "trainer:\n  total_steps: [1, 2\n")
    with pytest.raises(BadInputError, match=r"YAML syntax error .* line"):
        load_config(bad)
    with pytest.raises(BadInputError, match="expected a mapping at the top level"):
        load_config(_write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config("deepseek_ppo_tiny", ["trainer.seed=4"])
    again = load_config(_write(tmp_path / "resolved.yaml", dump_config(cfg)))
    assert again == cfg
    assert "extends" not in load_recipe_dict(tmp_path / "resolved.yaml")


def test_the_loader_does_not_depend_on_the_working_directory(tmp_path: Path) -> None:
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        a = load_config("recipes/deepseek_ppo_tiny.yaml")
    finally:
        os.chdir(here)
    assert a == load_config("deepseek_ppo_tiny")


def test_a_child_recipe_replaces_free_form_mappings_but_merges_sections(tmp_path: Path) -> None:
    """Switching the tiny recipe to another task must not inherit the old task's parameters (a merge
    could never remove `k`), while schema sections still merge key by key."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    child = _write(tmp_path / "math.yaml", {"extends": "recipes/gpt_oss_dapo_tiny.yaml",
                                             "data": {"task": "math", "path": str(rows), "task_params": {}}})
    cfg = load_config(child)
    assert cfg.data.task_params == {}
    assert cfg.data.batch_size == 64  # the rest of `data` is still inherited
    merged = load_config(_write(tmp_path / "k4.yaml", {"extends": "recipes/gpt_oss_dapo_tiny.yaml",
                                                        "data": {"task_params": {"k": 4}}}))
    assert merged.data.task_params == {"k": 4}
