"""The dry-run memory plan: the full recipes' knobs, plans on 1 / 8 / 16 devices, the refusal, the JSON object,
and the activation model against saved-tensor bytes measured on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.core.config import load_config
from polyrl.core.plan import activation_bytes_per_token, count_parameters, plan_memory
from polyrl.core.plugins.registry import get_registry
from polyrl.core.tolerances import MEMORY_PLAN_ACTIVATIONS_RTOL


def test_gpt_oss_dapo_recipe_knobs():
    cfg = load_config("gpt_oss_dapo")
    a, r, o = cfg.algorithm, cfg.rollout, cfg.optimizer
    assert cfg.model.preset == "gpt_oss_20b" and cfg.model.dtype == "bfloat16" and cfg.data.prompt_format == "chat"
    assert cfg.data.task == "math" and cfg.data.answer_key == "reward_model.ground_truth"
    assert (a.adv_estimator, r.n, a.clip_low, a.clip_high, a.clip_c, a.loss_agg_mode) == ("grpo", 16, 0.2, 0.28, 10.0,
                                                                                           "token-mean")
    assert not a.use_kl_in_reward and not a.use_kl_loss
    assert a.overlong.enable and (a.overlong.buffer_length, r.max_response_length) == (4096, 20480)
    assert a.dynamic_sampling.enable and a.dynamic_sampling.metric == "acc"
    assert (o.lr, o.warmup_steps, o.weight_decay, o.grad_clip, r.temperature) == (1e-6, 10, 0.1, 1.0, 1.0)
    assert cfg.trainer.activation_checkpointing and r.micro_batch_size > 0
    # one micro-batch holds the longest sequence
    assert a.micro_batch_tokens >= cfg.data.max_prompt_length + r.max_response_length


def test_deepseek_ppo_recipe_knobs():
    cfg = load_config("deepseek_ppo")
    a, o = cfg.algorithm, cfg.optimizer
    assert cfg.model.preset == "deepseek_v3" and cfg.model.critic_name is None  # critic: the actor's backbone
    assert (a.adv_estimator, a.gamma, a.lam, a.clip_low, a.clip_high, a.clip_c, a.value_clip) == (
        "gae", 1.0, 1.0, 0.2, 0.2, 3.0, 0.5)
    assert a.use_kl_in_reward and (a.kl_ctrl, a.kl_coef, a.kl_kind) == ("fixed", 0.001, "k1")
    assert (o.lr, o.critic_lr) == (1e-6, 1e-5)


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo", "deepseek_ppo"])
@pytest.mark.parametrize("nproc,nnodes", [(1, 1), (8, 1), (8, 2)])
def test_dry_run_prints_a_plan(cli, recipe, nproc, nnodes):
    # expert_parallel=1: the DeepSeek recipe's 16 would refuse world sizes it does not divide (tests/plan/test_plan_ep.py)
    rc, out, err = cli(f"recipes/{recipe}.yaml", "--dry-run", "--backend", "cuda", "--nproc", str(nproc),
                       "--nnodes", str(nnodes), "--json", "sharding.expert_parallel=1")
    assert rc in (0, 2), err
    doc = json.loads(out)
    plan = doc["memory_plan"]
    assert plan["world_size"] == nproc * nnodes and plan["device_memory_gib"] == 80.0
    assert plan["sharded"] == (nproc * nnodes > 1)
    assert "absent: architecture from preset" in " ".join(plan["notes"])  # said in the output
    assert doc["config"]["backend"]["name"] == "cuda"
    assert (rc == 0) == plan["fits"]
    if rc == 2:  # refused: one line saying what to change
        assert len(err.strip().splitlines()) <= 2 and "memory plan: needs" in err
        assert "GiB usable" in err and ("devices" in err or "shrink" in err)


def test_gpt_oss_dapo_fits_on_8_gpus_and_is_refused_on_one(cli):
    rc, out, err = cli("recipes/gpt_oss_dapo.yaml", "--dry-run", "--backend", "cuda", "--nproc", "8", "--json")
    assert rc == 0, err
    plan = json.loads(out)["memory_plan"]
    assert plan["params"]["actor"] == pytest.approx(20.9e9, rel=0.01)  # GPT-OSS-20B, counted on the meta device
    assert plan["rows"]["parameters"] == pytest.approx(plan["params"]["actor"] * 2 / 8 / 2**30, rel=1e-3)
    rc, out, err = cli("recipes/gpt_oss_dapo.yaml", "--dry-run", "--backend", "cuda", "--nproc", "1")
    assert rc == 2
    assert "does NOT fit" in out and err.splitlines()[-1].startswith("polyrl run: error: memory plan: needs")
    # the text output is still the resolved config (YAML) with the plan as comments
    import yaml

    assert yaml.safe_load(out)["model"]["name"] == "checkpoints/gpt-oss-20b-bf16"


def test_device_memory_override_and_ascend_table(cli):
    rc, out, _ = cli("recipes/gpt_oss_dapo.yaml", "--dry-run", "--backend", "ascend", "--nproc", "16", "--json")
    plan = json.loads(out)["memory_plan"]
    assert plan["device"] == "910B" and plan["device_memory_gib"] == 64.0 and rc == (0 if plan["fits"] else 2)
    rc, out, _ = cli("recipes/gpt_oss_dapo.yaml", "--dry-run", "--backend", "cuda", "--nproc", "8",
                     "--device-memory", "40", "--json")
    assert rc == 2 and json.loads(out)["memory_plan"]["device_memory_gib"] == 40.0


def test_sharding_divides_the_state_and_the_fused_flag_shrinks_logits():
    cfg = load_config("gpt_oss_dapo", ["model.fused_logprobs=false"])
    cuda = get_registry().backends["cuda"]
    one, eight = plan_memory(cfg, cuda, nproc=1), plan_memory(cfg, cuda, nproc=8)
    assert eight.rows["optimizer state (2 Adam states)"] == pytest.approx(one.rows["optimizer state (2 Adam states)"] / 8,
                                                                           rel=1e-3)
    assert eight.rows["gathered layers (FSDP2)"] > 0 == one.rows["gathered layers (FSDP2)"]
    cfg.model.fused_logprobs = "auto"  # the default: GPT-OSS's nn.Linear lm_head allows the fused op
    cfg.model.fused_loss = False  # its own test below
    fused = plan_memory(cfg, cuda, nproc=8)
    assert "fused" in fused.logprob_path and "full logits" in eight.logprob_path
    assert fused.rows["log-prob path (logits)"] < eight.rows["log-prob path (logits)"] / 10


def test_the_fused_loss_row_holds_dw_and_dh_where_the_trainer_takes_it():
    """``model.fused_loss`` (auto: the cuda backend has its own kernel, the cpu reference does not): the plan counts
    one token chunk's logits and their gradient, dH and the whole dW, held from the forward to the backward."""
    cfg = load_config("gpt_oss_dapo", ["model.fused_loss=auto"])
    registry = get_registry().backends
    on = plan_memory(cfg, registry["cuda"], nproc=8)
    cpu = plan_memory(cfg, registry["cpu"], nproc=8)
    cfg.model.fused_loss = False
    off = plan_memory(cfg, registry["cuda"], nproc=8)
    assert "loss's gradient in its forward" in on.logprob_path and "bf16/fp16 dW" in on.logprob_path
    assert "loss's gradient" not in off.logprob_path and "loss's gradient" not in cpu.logprob_path
    V, H = 201088, 2880
    extra = on.rows["log-prob path (logits)"] - off.rows["log-prob path (logits)"]
    assert V * H * 2 / 2**30 < extra < (V * H * 2 + 384 * 2**20 + 65536 * H * 2) / 2**30
    # under LoRA the base lm_head is frozen: no dW (the op makes none for a weight without a gradient)
    lora = load_config("gpt_oss_dapo_lora", ["model.fused_loss=auto"])
    lora_on = plan_memory(lora, registry["cuda"], nproc=1)
    lora.model.fused_loss = False
    lora_off = plan_memory(lora, registry["cuda"], nproc=1)
    assert "no dW" in lora_on.logprob_path
    assert 0 < lora_on.rows["log-prob path (logits)"] - lora_off.rows["log-prob path (logits)"] < V * H * 2 / 2**30


def _saved_bytes_per_token(model: torch.nn.Module, T: int) -> float:
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params:
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    cu = torch.tensor([0, T], dtype=torch.int32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, model.config.vocab_size, (1, T)), position_ids=torch.arange(T)[None],
                    cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=T, max_length_k=T, use_cache=False)
    return sum(seen.values()) / T


@pytest.mark.parametrize("preset,overrides,kind", [
    ("gpt_oss_tiny", {"hidden_size": 80, "intermediate_size": 112, "num_attention_heads": 6, "num_key_value_heads": 3,
                      "num_local_experts": 6, "num_experts_per_tok": 3}, "sliding"),
    ("deepseek_v3_tiny", {"hidden_size": 96, "moe_intermediate_size": 48, "num_attention_heads": 6,
                          "num_key_value_heads": 6, "kv_lora_rank": 48}, "moe"),
])
def test_activation_model_matches_saved_tensors_on_cpu(preset, overrides, kind):
    """A width the coefficients were not fitted on: one layer's saved bytes per token, measured by autograd's
    saved-tensor hooks (2 layers minus 1 layer, bf16), against the plan's model of the exact reference attention."""
    from polyrl.core.models import build_model
    from polyrl.core.plugins.selection import set_active_backend

    set_active_backend("cpu")
    T = 64
    layer = 1 if kind in ("sliding", "moe") else 0
    first = {"first_k_dense_replace": 1} if preset.startswith("deepseek") else {}
    m1 = build_model(preset, dtype=torch.bfloat16, overrides={**overrides, **first, "num_hidden_layers": layer},
                     seed=0).train()
    m2 = build_model(preset, dtype=torch.bfloat16, overrides={**overrides, **first, "num_hidden_layers": layer + 1},
                     seed=0).train()
    measured = _saved_bytes_per_token(m2, T) - _saved_bytes_per_token(m1, T)
    planned = activation_bytes_per_token(m2.config, kind if preset.startswith("deepseek") else
                                         ("sliding" if layer == 0 else "full"), 2, native_attention=False)
    assert planned == pytest.approx(measured, rel=MEMORY_PLAN_ACTIVATIONS_RTOL)
    assert count_parameters(m2.config).total == sum(p.numel() for p in m2.parameters())


def test_activation_checkpointing_keeps_fewer_saved_tensors():
    """trainer.activation_checkpointing really recomputes layers (fewer bytes saved in forward), as the plan
    assumes; same numbers either way is checked by the run (identical metrics, tiny PPO recipe)."""
    from polyrl.core.plugins import list_backends
    from polyrl.core.trainer.setup import _build_lm

    cpu = list_backends()["cpu"]  # the model is bound to the backend it is built for
    cfg = load_config("gpt_oss_dapo_tiny")
    plain = _build_lm("gpt_oss_tiny", cfg, None, {}, 0, cpu).train()
    cfg.trainer.activation_checkpointing = True
    ckpt = _build_lm("gpt_oss_tiny", cfg, None, {}, 0, cpu).train()
    assert ckpt.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    assert _saved_bytes_per_token(ckpt, 64) < 0.5 * _saved_bytes_per_token(plain, 64)


def test_a_run_refuses_the_missing_checkpoint_and_dry_run_only_flags(cli, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "What is 6 * 7?", "answer": "42"}\n')
    rc, _, err = cli("recipes/gpt_oss_dapo.yaml", "--backend", "cpu", f"data.path={data}", "data.answer_key=answer")
    assert rc == 2 and err.strip().splitlines()[-1].startswith(
        "polyrl run: error: model.name: 'checkpoints/gpt-oss-20b-bf16' is not a local directory")
    assert not (tmp_path / "runs").exists()
    rc, _, err = cli("recipes/gpt_oss_dapo_tiny.yaml", "--nnodes", "2")
    assert rc == 2 and "go with --dry-run" in err


def test_the_architecture_of_a_local_checkpoint_directory(cli, tmp_path):
    from polyrl.core.models import model_config

    ckpt = tmp_path / "ckpt"
    model_config("gpt_oss_tiny", num_hidden_layers=4).save_pretrained(ckpt)  # config.json only: the plan needs no weights
    rc, out, err = cli("recipes/gpt_oss_dapo_tiny.yaml", "--dry-run", f"model.name={ckpt}", "--json")
    assert rc == 0, err
    plan = json.loads(out)["memory_plan"]
    assert plan["notes"][0] == f"architecture from checkpoint {ckpt}" and "4 layers" in plan["architecture"]


# --- the plan decides nothing itself: it calls the trainer's own rules ---------------------------------------------
def test_the_fused_log_prob_decision_is_the_trainers():
    """``auto`` fuses from a large vocabulary only (the tiny recipes' 17 tokens: logits), in the plan as in the
    trainer, which decides on the model it built."""
    from polyrl.core.models import build_model
    from polyrl.core.models.lm_head import fused_kernel_for

    cpu = get_registry().backends["cpu"]
    cfg = load_config("gpt_oss_dapo_tiny")
    assert cfg.model.fused_logprobs == "auto"
    for vocab in (17, 40000):
        plan = plan_memory(cfg, cpu, vocab_size=vocab)
        model = build_model(cfg.model.name, vocab_size=vocab, overrides=dict(cfg.model.overrides), seed=0, backend=cpu)
        trainer_fuses = fused_kernel_for(cfg.model.fused_logprobs, model, cpu) is not None
        assert trainer_fuses == (vocab > 32768)
        assert ("fused" in plan.logprob_path) == trainer_fuses, (vocab, plan.logprob_path)


def test_the_micro_batch_bound_is_the_packing_rules():
    """The plan sizes one micro-batch with micro_batch_token_bound; the trainer's split never exceeds it and
    reaches it (rows that add up to the budget; a row longer than the budget alone)."""
    import random

    from polyrl.core.data.packing import micro_batch_token_bound, pack_rows

    rng = random.Random(0)
    for _ in range(200):
        budget, longest = rng.randint(1, 64), rng.randint(1, 64)
        lengths = [rng.randint(1, longest) for _ in range(rng.randint(1, 30))]
        parts = pack_rows(lengths, range(len(lengths)), budget)
        assert sorted(r for p in parts for r in p) == list(range(len(lengths)))
        assert max(sum(lengths[r] for r in p) for p in parts) <= micro_batch_token_bound(budget, max(lengths))
    assert max(map(len, pack_rows([3, 5, 8], [0, 1, 2], 8))) == 2  # 3 + 5 = 8 reaches the budget
    assert micro_batch_token_bound(8, 13) == 13 and pack_rows([13, 2], [0, 1], 8) == [[0], [1]]


def test_the_rollout_engine_is_the_trainers_choice():
    from polyrl.core.errors import BadInputError
    from polyrl.core.rollout import resolve_engine

    backends = get_registry().backends
    cfg = load_config("gpt_oss_dapo", ["model.fused_logprobs=false"])
    for name in ("cpu", "cuda"):
        assert plan_memory(cfg, backends[name], nproc=8).engine == resolve_engine("auto", backends[name])
    hf = plan_memory(cfg, backends["cuda"], nproc=8)
    assert "rollout KV cache" in hf.rows and "rollout engine (reserved)" not in hf.rows
    # a named vLLM on cuda is planned even where vLLM is not installed: it reserves its share of each GPU
    cfg.rollout.engine = "vllm"
    vllm = plan_memory(cfg, backends["cuda"], nproc=8)
    assert vllm.engine == "vllm" and "rollout KV cache" not in vllm.rows
    assert vllm.phases["update"] == pytest.approx(hf.phases["update"])  # asleep while the trainer updates
    cfg.rollout.engine = "nope"
    with pytest.raises(BadInputError, match="unknown rollout engine 'nope'"):
        plan_memory(cfg, backends["cuda"], nproc=8)


def test_the_plan_gathers_in_the_recipes_param_dtype():
    cuda = get_registry().backends["cuda"]
    fp32_master = load_config("gpt_oss_dapo", ["model.dtype=float32"])
    own = plan_memory(fp32_master, cuda, nproc=8)  # the backend's bf16 compute
    fp32_master.sharding.param_dtype = "float32"
    full = plan_memory(fp32_master, cuda, nproc=8)
    cpu = plan_memory(load_config("gpt_oss_dapo", ["model.dtype=float32"]), get_registry().backends["cpu"], nproc=8)
    # float32 gathers as the cpu backend's own float32 policy does, twice the bytes of bf16 compute
    assert full.rows["gathered layers (FSDP2)"] == pytest.approx(cpu.rows["gathered layers (FSDP2)"], rel=1e-9)
    assert full.rows["gathered layers (FSDP2)"] > 1.5 * own.rows["gathered layers (FSDP2)"]


def test_the_vllm_engine_is_planned_as_it_is_built_awake_or_asleep():
    """cuda sizes the engine's KV cache to the rollout (the engine's own kv_cache_bytes): the plan counts its
    weights + that cache + its working memory, not a fraction of the device; rollout.sleep_level=0 keeps it all on
    the device through the update, 1 frees it (the backend's default on cuda)."""
    from polyrl.backends.vllm_engine import kv_cache_bytes
    from polyrl.core.models.presets import model_config
    from polyrl.core.plan.rollout import VLLM_WORKSPACE_GIB

    cuda = get_registry().backends["cuda"]
    assert cuda.rollout_engine_options("vllm")["size_kv_cache"] and cuda.rollout_engine_options("vllm")["sleep_level"] == 1
    cfg = load_config("gpt_oss_dapo_lora", ["rollout.engine=vllm", "rollout.micro_batch_size=48"])
    awake = plan_memory(cfg, cuda, nproc=1, device_memory_gib=141)
    cfg.rollout.sleep_level = 1
    asleep = plan_memory(cfg, cuda, nproc=1, device_memory_gib=141)
    weights = awake.rows["rollout engine weights (vllm)"]
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    cache = kv_cache_bytes(model_config("gpt_oss_20b"), 48, longest + 1, "bfloat16") / 2**30
    assert weights == pytest.approx(20_914_757_184 * 2 / 2**30, rel=1e-3)
    assert awake.rows["rollout engine (reserved)"] == pytest.approx(weights + cache + VLLM_WORKSPACE_GIB, rel=1e-3)
    share = awake.rows["rollout engine (reserved)"]
    assert awake.phases["update"] - asleep.phases["update"] == pytest.approx(share)
    assert awake.phases["rollout"] == pytest.approx(asleep.phases["rollout"])
    cfg.rollout.micro_batch_size = 24  # half the sequences together: half the cache
    half = plan_memory(cfg, cuda, nproc=1, device_memory_gib=141)
    assert half.rows["rollout engine (reserved)"] - weights - VLLM_WORKSPACE_GIB == pytest.approx(cache / 2, rel=0.01)


def test_the_lora_recipe_fits_one_h200_with_its_engine_awake(cli):
    rc, out, err = cli("recipes/gpt_oss_dapo_lora.yaml", "--dry-run", "--backend", "cuda", "--device-memory", "141",
                       "--json", "rollout.engine=vllm")
    assert rc == 0, err
    plan = json.loads(out)["memory_plan"]
    assert plan["fits"] and plan["engine"] == "vllm"
    assert "it keeps its share during the update (no sleep)" in " ".join(plan["notes"])
    rc, out, err = cli("recipes/gpt_oss_dapo_lora.yaml", "--dry-run", "--backend", "cuda", "--device-memory", "80",
                       "--json", "rollout.engine=vllm")
    assert rc == 2 and "memory plan: needs" in err  # on 80 GB the engine's own copy does not fit (the recipe says so)
    rc, out, err = cli("recipes/gpt_oss_dapo_lora.yaml", "--dry-run", "--backend", "cuda", "--device-memory", "80",
                       "--json", "rollout.engine=hf")
    assert rc == 0, err
