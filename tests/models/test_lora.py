"""LoRA (``model.lora``, polyrl.core.models.lora): the reference is the base model exactly, only the adapters train,
the merges (hf generation, vLLM sync, export) equal the adapted model, the plan counts the adapters, bad values are
refused in one line."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from polyrl.core.config import LoraConfig, load_config
from polyrl.core.errors import BadInputError
from polyrl.core.models import build_model
from polyrl.core.models import lora as L

VOCAB = 32
ON = LoraConfig(enabled=True, rank=4, alpha=8.0)


@pytest.fixture
def run_cli(capsys):
    """``run_cli(args) -> (exit code, stdout, stderr)`` of ``polyrl ARGS`` in-process (``run`` unless ``command``)."""
    from polyrl.cli import main as polyrl_main
    from polyrl.core.plugins.selection import reset_active_backend

    def run(args: list[str], command: bool = False) -> tuple[int, str, str]:
        reset_active_backend()
        rc = polyrl_main(args if command else ["run", *args, "--no-progress"])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def _metrics(run_dir) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _adapted(name: str, seed: int = 0):
    """(base model, a copy with adapters whose B is random: the adapted model differs from the base)."""
    base = build_model(name, vocab_size=VOCAB, seed=0)
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    L.apply_lora(model, ON)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.1)
    return base, model


def _ids() -> torch.Tensor:
    return torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))


def _expected_trainable(base, rank: int) -> int:
    """Hand count: r·(in + out) per adapted linear layer, E·r·(d1 + d2) per adapted 3-D expert weight [E, d1, d2]."""
    modules, params = L.PRESETS[base.config.model_type]
    n = 0
    for name, m in base.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules:
            n += rank * (m.in_features + m.out_features)
    for name, p in base.named_parameters():
        if any(name.endswith("." + t) for t in params):
            e, d1, d2 = p.shape
            n += e * rank * (d1 + d2)
    return n


@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_adapters_off_is_the_base_model_exactly_and_only_adapters_train(name: str) -> None:
    base, model = _adapted(name)
    ids = _ids()
    with torch.no_grad():
        want = base(ids).logits
        with L.adapters_disabled(model):
            off = model(ids).logits
        on = model(ids).logits
    assert torch.equal(off, want)  # bit-identical: the base layers alone
    assert (on - want).abs().max() > 1e-2  # the adapters are on again and matter
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert any(".experts." in n for n in trainable) and any("self_attn" in n for n in trainable)
    assert L.trainable_parameters(model) == _expected_trainable(base, ON.rank)
    model(ids, labels=ids).loss.backward()
    graded = {n for n, p in model.named_parameters() if p.grad is not None}
    assert graded == trainable


@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_merges_equal_the_adapted_model_and_leave_the_base_bit_identical(name: str) -> None:
    from peft import get_peft_model

    base, model = _adapted(name)
    ids = _ids()
    with torch.no_grad():
        on = model(ids).logits
        # the full-tensor merge (vLLM's sync, the export) against peft's own merge_and_unload
        oracle = get_peft_model(copy.deepcopy(base), copy.deepcopy(model.polyrl_lora))
        oracle.base_model.model.load_state_dict(model.state_dict())
        oracle = oracle.merge_and_unload()
        merged = L.merged_tensors(model, model.state_dict())
        assert set(merged) == set(base.state_dict())
        for k, v in oracle.state_dict().items():
            torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)
        plain = copy.deepcopy(base)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(ids).logits, on, rtol=0, atol=1e-5)
        # the hf engine's merge: same logits, base tensors put back bit for bit
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with L.merged_for_generation(model) as did:
            during = model(ids).logits
        assert did
        torch.testing.assert_close(during, on, rtol=0, atol=1e-5)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert torch.equal(model(ids).logits, on) and not any(m.merged for m in L.lora_layers(model))


def test_hf_engine_generates_the_same_tokens_merged_and_unmerged() -> None:
    from polyrl.core.rollout.engine import SamplingParams
    from polyrl.core.rollout.hf import HFEngine

    _, model = _adapted("gpt_oss_tiny")
    params = SamplingParams(temperature=1.0, max_tokens=6)
    prompts = [[1, 5, 6, 7], [1, 9, 8], [1, 4, 4, 4, 4, 4]]
    engine = HFEngine(model, pad_token_id=0)
    merged = engine.generate(prompts, params, row_seeds=[1, 2, 3])
    engine.merge_adapters = False
    unmerged = engine.generate(prompts, params, row_seeds=[1, 2, 3])
    assert merged.response_ids == unmerged.response_ids
    for a, b in zip(merged.logprobs, unmerged.logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_the_trainer_builds_a_lora_actor_with_the_reference_for_free() -> None:
    from polyrl.core.plugins.selection import default_backend
    from polyrl.core.trainer.setup import build_models

    cfg = load_config("deepseek_ppo_tiny", ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"])
    assert cfg.algorithm.use_kl_in_reward  # the recipe has a reference
    m = build_models(cfg, VOCAB, default_backend(), torch.device("cpu"))
    assert m.ref is None and m.ref_is_actor
    opt = {id(p) for g in m.optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for n, p in m.actor.named_parameters() if ".lora_" in n}
    assert all(p.dtype == torch.float32 for n, p in m.actor.named_parameters() if ".lora_" in n)
    ids = _ids()
    with torch.no_grad():
        for n, p in m.actor.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.1)
        base = build_model("deepseek_v3_tiny", vocab_size=VOCAB, seed=cfg.trainer.seed)
        with m.reference() as ref:
            assert ref is m.actor
            assert torch.equal(ref(ids).logits, base(ids).logits)
        assert all(p.requires_grad for n, p in m.actor.named_parameters() if ".lora_" in n)  # back on


def test_the_memory_plan_counts_the_adapters_and_no_reference_copy() -> None:
    from polyrl.core.plan import plan_memory
    from polyrl.core.plugins.selection import default_backend

    lora = ["model.lora.enabled=true", "model.lora.rank=4"]
    cfg, full = load_config("deepseek_ppo_tiny", lora), load_config("deepseek_ppo_tiny")
    plan = plan_memory(cfg, default_backend(), vocab_size=VOCAB)
    ref = plan_memory(full, default_backend(), vocab_size=VOCAB)
    base = build_model("deepseek_v3_tiny", vocab_size=VOCAB, seed=0)
    n = _expected_trainable(base, 4)
    assert plan.params["trainable (LoRA)"] == n
    gib = 2**30
    assert plan.rows["gradients"] == pytest.approx(n * 4 / gib)
    assert plan.rows["optimizer state (2 Adam states)"] == pytest.approx(2 * n * 4 / gib)
    assert plan.rows["parameters"] == pytest.approx(ref.rows["parameters"] + n * 4 / gib)
    assert ref.rows["reference model"] > 0 and plan.rows["reference model"] == 0
    # the hf engine's merged copy: the adapted weights, in the recipe's dtype (fp32)
    targeted = sum(L._target_param(m).numel() for m in L.lora_layers(L.apply_lora(copy.deepcopy(base), cfg.model.lora)))
    assert plan.rows["LoRA merged weights (rollout)"] == pytest.approx(targeted * 4 / gib)


@pytest.mark.parametrize(("override", "message"), [
    ("model.lora.rank=0", "model.lora.rank: expected an integer >= 1"),
    ("model.lora.alpha=0", "model.lora.alpha: expected a number > 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout: expected a number in [0, 1)"),
    ("model.lora.preset=llama", "model.lora.preset: expected one of"),
    ("model.lora.preset=none", "model.lora.preset: none needs"),
    ("model.lora.target_modules=['']", "model.lora.target_modules: '' is not"),
    ("sharding.expert_parallel=2", "adapters on split experts are not supported"),
])
def test_bad_lora_values_are_refused_when_the_recipe_loads(override: str, message: str) -> None:
    with pytest.raises(BadInputError, match=re.escape(message)):
        load_config("gpt_oss_dapo_tiny", ["model.lora.enabled=true", override])


@pytest.mark.parametrize(("override", "message"), [
    ("model.lora.target_modules=[nope_proj]", "model.lora.target_modules: 'nope_proj' matches no linear layer"),
    ("model.lora.target_parameters=[mlp.experts.nope]", "model.lora.target_parameters: 'mlp.experts.nope' matches"),
    ("model.lora.dropout=0.1", "model.lora.dropout: must be 0 with target_parameters"),
])
def test_targets_the_model_lacks_are_refused_in_one_line(run_cli, override: str, message: str) -> None:
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--dry-run", "model.lora.enabled=true", override])
    assert rc == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_resume_is_bit_identical_and_the_export_round_trips(tmp_path, run_cli) -> None:
    """A LoRA run split by a resume equals the straight run; the export's merged model gives the adapted logits,
    and peft's PeftModel.from_pretrained loads the adapter alone onto the base and gives them too."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from polyrl.core.run.checkpoint import load_model_weights, resolve_checkpoint
    from polyrl.core.run.export import build_model_from_metadata, find_metadata

    args = ["gpt_oss_dapo_tiny", "--seed", "0", "data.batch_size=8", "trainer.save_every=1", "model.lora.enabled=true",
            "model.lora.rank=4", "optimizer.lr=1e-2"]
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "straight"), "trainer.total_steps=3"])
    assert rc == 0, err
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "split"), "trainer.total_steps=2"])
    assert rc == 0, err
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "split"), "trainer.total_steps=3"])
    assert rc == 0 and "from step 2" in err, err
    straight, split = _metrics(tmp_path / "straight"), _metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3] and split == straight  # bit-identical

    out = tmp_path / "export"
    rc, _, err = run_cli(["export", str(tmp_path / "straight"), str(out)], command=True)
    assert rc == 0, err
    step = resolve_checkpoint(str(tmp_path / "straight"))
    meta = find_metadata(step)
    # the trained adapted model, rebuilt from the checkpoint (the oracle)
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    trained = inject_adapter_in_model(PeftLoraConfig.from_pretrained(str(meta)), build_model_from_metadata(meta))
    load_model_weights(step, trained)
    assert any(p.abs().max() > 0 for n, p in trained.named_parameters() if ".lora_B." in n)  # the adapters trained
    ids = torch.randint(4, trained.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
        base = PeftModel.from_pretrained(build_model_from_metadata(meta), str(out / "adapter"))
        # PeftModel's base weights are fresh (random): load the run's base weights into it, then compare
        plain = {k.replace(".base_layer", ""): v for k, v in trained.state_dict().items() if ".lora_" not in k}
        missing = base.base_model.model.load_state_dict(
            {k: v for k, v in trained.state_dict().items() if ".lora_" not in k}, strict=False)
        assert not [k for k in missing.missing_keys if ".lora_" not in k]
        torch.testing.assert_close(base(ids).logits, want, rtol=0, atol=1e-5)
        assert set(plain) == set(merged.state_dict())
