"""algorithm.rollout_correction: its defaults, what loads, and every bad value refused in one line (exit 2)."""

from __future__ import annotations

import pytest

from polyrl.core.config import load_config
from polyrl.core.errors import BadInputError

RC = "algorithm.rollout_correction"


def test_defaults_and_good_values_load() -> None:
    rc = load_config("gpt_oss_dapo_tiny").algorithm.rollout_correction
    assert (rc.enable, rc.is_level, rc.is_cap, rc.token_mask_band, rc.seq_reject, rc.seq_reject_band) == (
        "auto", "token", 2.0, None, None, None)
    rc = load_config("deepseek_ppo_tiny", [f"{RC}.enable=true", f"{RC}.is_level=geometric", f"{RC}.is_cap=3",
                                           f"{RC}.token_mask_band=[0.5, 5.0]", f"{RC}.seq_reject=max_token",
                                           f"{RC}.seq_reject_band=[0.1, 10]"]).algorithm.rollout_correction
    assert rc.enable is True and rc.is_level == "geometric" and rc.is_cap == 3.0
    assert rc.token_mask_band == [0.5, 5.0] and rc.seq_reject == "max_token" and rc.seq_reject_band == [0.1, 10.0]
    rc = load_config("gpt_oss_dapo_tiny", [f"{RC}.enable=false", f"{RC}.is_level=null"]).algorithm.rollout_correction
    assert rc.enable is False and rc.is_level is None


BAD = [
    (f"{RC}.enable=sometimes", f"{RC}.enable: expected bool or one of 'auto'"),
    (f"{RC}.is_level=tokens", f"{RC}.is_level: expected one of 'token', 'sequence', 'geometric' or null"),
    (f"{RC}.is_cap=0", f"{RC}.is_cap: expected a finite number > 0, got 0.0"),
    (f"{RC}.is_cap=-2", f"{RC}.is_cap: expected a finite number > 0"),
    (f"{RC}.is_cap=.inf", f"{RC}.is_cap: expected a finite number > 0"),
    (f"{RC}.token_mask_band=[2, 5]", f"{RC}.token_mask_band: expected [low, high] with 0 < low <= 1 <= high"),
    (f"{RC}.token_mask_band=[0.5]", f"{RC}.token_mask_band: expected [low, high]"),
    (f"{RC}.token_mask_band=[0, 2]", f"{RC}.token_mask_band: expected [low, high]"),
    (f"{RC}.token_mask_band=[1, 1]", f"{RC}.token_mask_band: expected [low, high]"),
    (f"{RC}.seq_reject=max_token", f"{RC}: seq_reject and seq_reject_band go together"),
    (f"{RC}.seq_reject_band=[0.5, 2]", f"{RC}: seq_reject and seq_reject_band go together"),
    (f"{RC}.seq_reject=worst", f"{RC}.seq_reject: expected one of 'max_token', 'geometric' or null"),
    (f"{RC}.cap=2", f"unknown key '{RC}.cap'"),
]


@pytest.mark.parametrize(("override", "message"), BAD)
def test_bad_values_are_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(BadInputError, match="^" + message.replace("[", r"\[").replace(".", r"\.")):
        load_config("gpt_oss_dapo_tiny", [override])


def test_a_correction_that_corrects_nothing_is_refused() -> None:
    with pytest.raises(BadInputError, match=f"{RC}.enable: true with is_level, token_mask_band and seq_reject"):
        load_config("gpt_oss_dapo_tiny", [f"{RC}.enable=true", f"{RC}.is_level=null"])


@pytest.mark.parametrize(("override", "message"), [BAD[2], BAD[5], BAD[9]])
def test_the_cli_exits_2_with_one_line(override: str, message: str, capsys) -> None:
    from polyrl.cli import main as polyrl_main

    assert polyrl_main(["run", "gpt_oss_dapo_tiny", "--dry-run", override]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err and out == ""
