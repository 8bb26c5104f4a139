"""The emulator refuses what the real op refuses: one test per rule (op-plugin's own checks with their wording,
the documented limits, the release's signature), and it keeps the behaviour of op-plugin's Ascend 950 path.
Each test also shows the call just inside the rule passes, so a test cannot pass by the emulator refusing
everything."""

from __future__ import annotations

import pytest
import torch

from polyrl.emulation import npu as npu_emulator
from polyrl.emulation.npu import NpuEmulator, release_of

CAUSAL = {"atten_mask": torch.ones(2048, 2048, dtype=torch.bool).triu(1), "sparse_mode": 3}


def call(emu: NpuEmulator, t=6, hq=4, hkv=2, d=8, dv=None, dtype=torch.bfloat16, ends=None, **kw):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, dv or d, generator=gen).to(dtype)
    ends = ends or [t // 2, t]
    return emu.npu_fusion_attention(q, k, v, hq, "TND", scale=d**-0.5, actual_seq_qlen=ends, actual_seq_kvlen=ends,
                                    **CAUSAL, **kw)


def grad_call(emu: NpuEmulator, t=6, hq=4, hkv=2, d=8, **kw):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, d, generator=gen).bfloat16() for h in (hq, hkv, hkv))
    stat = torch.zeros(t, hq, 8)
    out = torch.zeros(t, hq, d, dtype=torch.bfloat16)
    return emu.npu_fusion_attention_grad(q, k, v, out, hq, "TND", softmax_max=stat, softmax_sum=stat + 1,
                                         attention_in=out, scale_value=d**-0.5, actual_seq_qlen=[3, t],
                                         actual_seq_kvlen=[3, t], **CAUSAL, **kw)


def test_release_table_follows_the_signature_branches():
    """Ascend/pytorch's version.txt at the release tags: 7.3.0 is 2.8.0.post2 / 2.9.0, 7.3.1 2.9.0.post1 (same ops),
    26.0.0 2.7.1.post4 / 2.8.0.post4 / 2.9.0.post2 / 2.10.0."""
    assert [release_of(v) for v in ("2.6.0", "2.6.0.post3", "2.7.1", "2.8.0.post2", "2.9.0", "2.9.0.post1",
                                    "2.7.1.post4", "2.8.0.post4", "2.9.0.post2", "2.10.0", "2.10.0.post4",
                                    "2.11.0")] == [
        "7.1.0", "7.2.0", "7.2.0", "7.3.0", "7.3.0", "7.3.0", "26.0.0", "26.0.0", "26.0.0", "26.0.0", "26.0.0", "26.0.0"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropout_mask'"):
        call(NpuEmulator("2.9.0"), dropout_mask=None)
    call(NpuEmulator("2.10.0"), dropout_mask=None, seed=0, offset=0)  # 26.0.0's forward has them


def test_sink_keyword_does_not_exist_before_7_3_0():
    old = NpuEmulator("2.8.0", cann_version="8.5.0")
    with pytest.raises(TypeError, match="unexpected keyword argument 'sink'"):
        call(old, sink=torch.zeros(4))
    with pytest.raises(TypeError, match="unexpected keyword argument 'sink'"):
        grad_call(old, sink=torch.zeros(4))
    call(NpuEmulator("2.8.0.post2"), sink=torch.zeros(4))


def test_sink_on_an_older_cann_raises_op_plugins_message():
    emu = NpuEmulator("2.9.0", cann_version="8.3.RC1")
    with pytest.raises(RuntimeError, match=r"^The param sink is not supported in this CANN version, "
                                           r"aclnnFlashAttentionVarLenScoreV5 is not available$"):
        call(emu, sink=torch.zeros(4))
    with pytest.raises(RuntimeError, match="aclnnFlashAttentionUnpaddingScoreGradV5 is not available"):
        grad_call(emu, sink=torch.zeros(4))
    call(emu)  # without sink the same release and CANN run
    call(NpuEmulator("2.9.0", cann_version="8.5.0"), sink=torch.zeros(4))


def test_softmax_layout_exists_from_7_2_0_and_needs_cann_8_3():
    with pytest.raises(TypeError, match="softmax_layout"):
        call(NpuEmulator("2.6.0"), softmax_layout="TND")
    with pytest.raises(RuntimeError, match=r"^The param softmax_layout is not supported$"):
        call(NpuEmulator("2.8.0", cann_version="8.2.RC1"), softmax_layout="TND")
    with pytest.raises(RuntimeError, match=r"^only supported softmax_layout=TND$"):
        call(NpuEmulator("2.8.0", cann_version="8.3.RC1"), softmax_layout="BSND")
    call(NpuEmulator("2.8.0", cann_version="8.3.RC1"), softmax_layout="TND")


def test_grad_returns_four_tensors_before_7_3_0_and_five_after():
    assert len(grad_call(NpuEmulator("2.8.0", cann_version="8.3.RC1"))) == 4
    assert len(grad_call(NpuEmulator("2.9.0"))) == 5


def test_float32_inputs_need_cann_8_2():
    with pytest.raises(RuntimeError, match=r"dtype torch\.float32 is not supported"):
        call(NpuEmulator("2.6.0", cann_version="8.1.RC1"), dtype=torch.float32)
    call(NpuEmulator("2.6.0", cann_version="8.1.RC1"), dtype=torch.float16)
    call(NpuEmulator("2.6.0", cann_version="8.2.RC1"), dtype=torch.float32)


def test_at_most_1024_sequences_per_varlen_call():
    emu = NpuEmulator()
    with pytest.raises(RuntimeError, match="at most 1024 sequences"):
        call(emu, t=1025, hq=1, hkv=1, d=4, ends=list(range(1, 1026)))
    call(emu, t=1024, hq=1, hkv=1, d=4, ends=list(range(1, 1025)))


def test_head_dim_at_most_768():
    with pytest.raises(RuntimeError, match=r"D must be in \[1, 768\]"):
        call(NpuEmulator(), t=2, hq=1, hkv=1, d=769)
    call(NpuEmulator(), t=2, hq=1, hkv=1, d=768)


def test_at_most_256_query_heads():
    with pytest.raises(RuntimeError, match=r"N \(query heads\) must be in \[1, 256\]"):
        call(NpuEmulator(), t=2, hq=257, hkv=1, d=4)
    call(NpuEmulator(), t=2, hq=256, hkv=1, d=4)


def test_query_heads_a_multiple_of_kv_heads():
    with pytest.raises(RuntimeError, match="N % Nkv == 0"):
        call(NpuEmulator(), hq=3, hkv=2)


def test_dk_at_least_dv():
    with pytest.raises(RuntimeError, match="Dk >= Dv"):
        call(NpuEmulator(), d=8, dv=16)
    call(NpuEmulator(), d=16, dv=8)  # DeepSeek MLA's shape: Dk 192 > Dv 128


def test_at_most_1m_tokens(monkeypatch):
    monkeypatch.setattr(npu_emulator, "MAX_T", 64)  # the rule itself, at a size a test can afford
    with pytest.raises(RuntimeError, match=r"T must be in \[1, 64\]"):
        call(NpuEmulator(), t=65, hq=1, hkv=1, d=4)
    call(NpuEmulator(), t=64, hq=1, hkv=1, d=4)
    assert npu_emulator.MAX_T == 64 and (1 << 20) == 1048576


def test_ascend_950_forward_drops_the_sink_from_op_plugin_26():
    """op-plugin's Ascend 950 branch (one aclnn kernel, no sink in the forward) exists from 26.0.0 (torch_npu
    2.9.0.post2 for torch 2.9); the 7.x branches treat a 950 like any chip."""
    sink = torch.full((4,), 3.0)
    on_910 = call(NpuEmulator(soc_version="Ascend910B3"), sink=sink)[0]
    on_950 = call(NpuEmulator("2.9.0.post2", soc_version="Ascend950PR"), sink=sink)[0]
    without = call(NpuEmulator("2.9.0.post2", soc_version="Ascend950PR"))[0]
    assert torch.equal(on_950, without) and not torch.allclose(on_910.float(), without.float(), atol=1e-2)
    on_950_73 = NpuEmulator("2.9.0", soc_version="Ascend950PR")
    assert on_950_73.release == "7.3.0" and torch.equal(call(on_950_73, sink=sink)[0], on_910)
    with pytest.raises(RuntimeError, match="The param sink is not supported in this CANN version"):
        call(NpuEmulator("2.9.0", cann_version="8.3.RC1", soc_version="Ascend950PR"), sink=sink)



def test_statistic_rows_follow_the_kernel_offset_formula():
    """Two sequences of 2 and 3 tokens, N = 4 query heads over Nkv = 2 (G = 2): the kernel writes sequence b's
    statistics as one [N, s_b] block at row N * (tokens before b); written out by hand here."""
    rows = npu_emulator._stat_rows([2, 5], 4, 2, "cpu")
    expected = torch.tensor([
        # head: 0   1   2   3       (sequence 0: block rows 0..7, [N=4, s=2])
        [0, 2, 4, 6],  # token 0
        [1, 3, 5, 7],  # token 1
        # sequence 1: block rows 8..19, [N=4, s=3]
        [8, 11, 14, 17],  # token 2
        [9, 12, 15, 18],  # token 3
        [10, 13, 16, 19],  # token 4
    ])
    assert torch.equal(rows, expected)
    out = call(NpuEmulator(), t=5, ends=[2, 5])
    tnd = call(NpuEmulator(), t=5, ends=[2, 5], softmax_layout="TND")
    assert torch.equal(out[1].reshape(20, 8)[rows.reshape(-1)], tnd[1].reshape(20, 8))
