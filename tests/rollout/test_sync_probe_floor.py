"""The sync probe below fp32: a model that rounding alone moves beyond the fixed bar (near-tie routers, peaked
logits) is held against its own rounding floor (``sync.precision_floor``), and a faulty engine still fails.

The engine here is a stand-in with its own weights: a bf16 copy of the trainer's model scored through the trainer's
forward (what an exact bf16 engine gives), and the same copy with one layer's experts re-drawn (a fault)."""
from __future__ import annotations

import copy

import pytest
import torch

from polyrl.core.models import build_model
from polyrl.core.plugins import get_registry
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer import sync

VOCAB = 64


def _forward() -> dict:
    return dict(packed=True, pad_id=0, chunk_size=1024, logprobs=get_registry().backends["cpu"].logprobs)


class _CopyEngine:
    """An engine holding its own weights (``score``: it is verified) that computes in bf16."""

    name = "bf16-copy"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = copy.deepcopy(model).to(torch.bfloat16)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return sync.trainer_logprobs(self.model, sequences, **_forward())


class _DecodingEngine(_CopyEngine):
    """The bf16 copy with a decode path: samples from a short prompt at temperature 1 (seeded) and compares its
    log-probs of what it sampled with the trainer's (``decode_probe_diff``, as the vllm engine's). ``decode_model``:
    the weights its decode path computes with (the copy's own unless given: stale decode weights)."""

    def __init__(self, model: torch.nn.Module, decode_model: torch.nn.Module | None = None) -> None:
        super().__init__(model)
        self.decode_model = self.model if decode_model is None else decode_model
        self.decoded: list[int] = []

    def decode_probe_diff(self, trainer_score) -> float:
        gen = torch.Generator().manual_seed(1234)
        seq = torch.randint(4, VOCAB, (4,), generator=gen).tolist()
        with torch.no_grad():
            for _ in range(40):
                logits = self.decode_model(torch.tensor([seq])).logits[0, -1].float()
                seq.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
        self.decoded = seq
        mine = sync.trainer_logprobs(self.decode_model, [seq], **_forward())[0][3:]
        theirs = trainer_score([seq])[0][3:]
        return max(abs(a - b) for a, b in zip(mine, theirs))


def _model(*, near_ties: bool) -> torch.nn.Module:
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend="cpu")
    if near_ties:  # routers near ties (bf16 rounding flips experts) and peaked logits, as a trained head has
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__.endswith("Router"):
                    module.weight.mul_(1e-3)
            model.lm_head.weight.mul_(50.0)
    return model


def test_a_model_rounding_moves_past_the_fixed_bar_is_held_against_its_own_floor() -> None:
    model = _model(near_ties=True)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=64)
    engine = _CopyEngine(model)
    fixed = tolerance("rollout.sync_probe", "bfloat16")
    metrics = sync.verify(engine, model, seqs, "bfloat16", **_forward())
    assert metrics["rollout/sync_probe_diff"] > fixed  # an exact bf16 engine: beyond the fixed bar
    floor = metrics["rollout/sync_probe_floor"]
    assert floor == pytest.approx(sync.precision_floor(model, seqs, "bfloat16", **_forward()))  # seeded: the same
    assert metrics["rollout/sync_probe_diff"] < 2 * floor  # the estimate is of the engine's size
    assert metrics["rollout/sync_probe_bar"] == tolerance("rollout.sync_probe_floor_factor", "bfloat16") * floor


def test_a_faulty_engine_fails_against_the_floor_too() -> None:
    model = _model(near_ties=True)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=64)
    engine = _CopyEngine(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # one layer's experts never synced (left as a dummy build drew them)
        for name, p in engine.model.named_parameters():
            if "layers.1.mlp.experts" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.float().std())
    with pytest.raises(sync.SyncFailed, match=r"tolerance [0-9.]+ for bfloat16; prefill [0-9.e+-]+ = 3x the model's own bfloat16 floor") as info:
        sync.verify(engine, model, seqs, "bfloat16", **_forward())
    assert "\n" not in str(info.value)
    assert "(10 draws)" in str(info.value)  # the floor looked at again before the stop


def test_within_the_fixed_bar_no_floor_is_measured_and_fp32_never_uses_one() -> None:
    model = _model(near_ties=False)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=64)
    metrics = sync.verify(_CopyEngine(model), model, seqs, "bfloat16", **_forward())
    assert metrics["rollout/sync_probe_diff"] <= tolerance("rollout.sync_probe", "bfloat16")
    assert "rollout/sync_probe_floor" not in metrics
    with pytest.raises(sync.SyncFailed, match=r"tolerance 0.001 for float32\)"):  # bf16's rounding, fp32's bar
        sync.verify(_CopyEngine(model), model, seqs, "float32", **_forward())


def test_the_floor_is_the_rounding_of_the_dtype_asked() -> None:
    model = _model(near_ties=False)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=64)
    f32, f16, bf16 = (sync.precision_floor(model, seqs, d, **_forward()) for d in ("float32", "float16", "bfloat16"))
    assert f32 < 1e-5 < f16 < bf16  # unit roundoff 2^-24, 2^-11, 2^-8
    assert 2 < bf16 / f16 < 16


def test_the_decode_probe_is_held_against_the_floor_of_the_tokens_it_sampled() -> None:
    """A trained policy's own samples and the probe's random tokens sit at different depths of its distribution,
    and rounding moves them by different amounts: the decode path's bar is measured on the decoded sequence."""
    model = _model(near_ties=True)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=64)
    engine = _DecodingEngine(model)
    metrics = sync.verify(engine, model, seqs, "bfloat16", **_forward())
    assert metrics["rollout/sync_probe_decode"] > tolerance("rollout.sync_probe", "bfloat16")
    floor = metrics["rollout/sync_probe_floor_decode"]
    assert floor == pytest.approx(sync.precision_floor(model, [engine.decoded], "bfloat16", **_forward()))
    assert floor != pytest.approx(metrics["rollout/sync_probe_floor"])  # not the prefill probe's floor
    assert metrics["rollout/sync_probe_bar_decode"] == tolerance("rollout.sync_probe_floor_factor", "bfloat16") * floor


def test_stale_decode_weights_fail_against_the_decode_floor() -> None:
    model = _model(near_ties=True)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=64)
    stale = copy.deepcopy(model).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the decode path's attention weights left as a dummy build drew them
        for name, p in stale.named_parameters():
            if "self_attn" in name and p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * p.float().std())
    with pytest.raises(sync.SyncFailed, match=r"in decode \(.*decode [0-9.e+-]+ = 3x the model's own bfloat16 floor"):
        sync.verify(_DecodingEngine(model, decode_model=stale), model, seqs, "bfloat16", **_forward())
