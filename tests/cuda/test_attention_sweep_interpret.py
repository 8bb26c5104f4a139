"""bench/attention_sweep.py on CPU under the Triton interpreter: every kernel's launch arguments match its
signature, each candidate's outputs are compared with the default's, and a wrong candidate is never picked."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench, wall_ms

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU check")


def _load():
    mod = load_bench("attention_sweep")
    mod.H_Q, mod.H_KV, mod.HEAD_DIM = 4, 2, 16
    return mod


def test_sweep_runs_every_kernel_and_compares_with_the_default():
    mod = _load()
    cands = {"fwd": [(16, 16, 4, 1), (16, 32, 4, 1)], "dq": [(16, 16, 4, 1), (16, 32, 4, 1)],
             "dkdv": [(16, 16, 4, 1), (32, 16, 4, 1)]}
    r = mod.sweep_layout("2x24", None, device="cpu", dtype=torch.float32, do_bench=wall_ms, candidates=cands)
    for kernel in cands:
        rows = r["kernels"][kernel]["rows"]
        # each candidate alone and with each of the kernel's variants (dK/dV: prefetch, TMA loads)
        assert len(rows) == (1 + len(mod.VARIANTS[kernel])) * len(cands[kernel])
        assert [row["config"] for row in rows] == [mod.config_label(c, v) for c, v in mod.sweep_rows(
            kernel, cands[kernel], listed=False)]
        assert rows[0]["max_rel_diff_vs_default"] == 0.0
        assert all(row["ok"] and row["max_rel_diff_vs_default"] < 1e-5 for row in rows)  # fp32: tiling only
    assert r["best_fwd_bwd_kernels_ms"] <= r["default_fwd_bwd_kernels_ms"]


def test_a_candidate_with_wrong_outputs_is_never_the_best(monkeypatch):
    mod = _load()
    from polyrl.backends.cuda.kernels import backward as B

    real = B.attn_bwd_dkdv_kernel.fn

    class Broken:  # the second candidate's dK comes out doubled (as a config that miscompiles would)
        def __getitem__(self, grid):
            def launch(*args, **kw):
                real[grid](*args, **kw)
                if kw["BLOCK_M"] == 32:
                    args[6].mul_(2)
            return launch

    class Kernel:  # what the sweep launches (``.fn[grid]``); the trainer's autotuned kernel is left as it is
        fn = Broken()

    monkeypatch.setattr(B, "attn_bwd_dkdv_kernel", Kernel())
    cands = {"dkdv": [(16, 16, 4, 1), (32, 16, 4, 1)], "fwd": [(16, 16, 4, 1)], "dq": [(16, 16, 4, 1)]}
    fast = {"n": 0}

    def bench(fn, **_kw):  # the broken candidate looks fastest
        fast["n"] += 1
        fn()
        return 1.0 if fast["n"] == 2 else 5.0

    r = mod.sweep_layout("1x24", None, device="cpu", dtype=torch.float32, do_bench=bench, candidates=cands)
    rows = r["kernels"]["dkdv"]["rows"]
    assert not rows[1]["ok"] and rows[1]["max_rel_diff_vs_default"] > 0.5
    assert r["kernels"]["dkdv"]["best"]["config"] == rows[0]["config"]


def test_kernels_not_swept_run_their_default_and_hopper_pick(monkeypatch):
    mod = _load()
    from polyrl.backends.cuda.kernels import configs

    monkeypatch.setattr(configs, "HOPPER_PICKS", {("dq", 64, False): (32, 16, 4, 1),
                                                  ("dkdv", 64, False): (16, 16, 4, 1, {"TMA": True})})
    cands = {"fwd": [(16, 16, 4, 1), (16, 32, 4, 1)], "dq": [(16, 16, 4, 1), (16, 32, 4, 1)],
             "dkdv": [(16, 16, 4, 1), (32, 16, 4, 1)]}
    r = mod.sweep_layout("1x24", None, device="cpu", dtype=torch.float32, do_bench=wall_ms, candidates=cands,
                         kernels=["fwd"])
    configs_of = {k: [row["config"] for row in r["kernels"][k]["rows"]] for k in cands}
    assert len(configs_of["fwd"]) == 2 * (1 + len(mod.VARIANTS["fwd"]))  # swept: both alone, then each variant
    assert configs_of["dq"] == ["M16 N16 w4 s1", "M32 N16 w4 s1"]  # default, then the pick
    assert configs_of["dkdv"] == ["M16 N16 w4 s1", "M16 N16 w4 s1 tma"]  # the pick's variant named
    assert all(row["ok"] for k in cands for row in r["kernels"][k]["rows"])


@pytest.mark.parametrize("window", [None, 5, 40])
def test_variants_match_the_default_with_padded_groups_and_windows(window):
    """Every kernel's variants (TMA loads; dK/dV's PREFETCH) against its pointer-load default (fp32: equal up to the
    order of the tile sums), where the group of 3 query heads pads to 4 rows (TMA fills the fourth with zeros), the
    q tiles cross the end of the tokens and of documents, and windows take the band (5) or aligned (40) walk."""
    mod = _load()
    mod.H_Q, mod.H_KV = 6, 2
    cands = {"fwd": [(16, 16, 4, 1)], "dq": [(16, 16, 4, 1)], "dkdv": [(16, 16, 4, 1), (32, 16, 4, 1)]}
    r = mod.sweep_layout("3x21", window, device="cpu", dtype=torch.float32, do_bench=wall_ms, candidates=cands)
    for kernel in cands:
        rows = r["kernels"][kernel]["rows"]
        assert {row["config"].split(" ")[-1] for row in rows} >= set(mod.VARIANTS[kernel])
        assert all(row["ok"] and row["max_rel_diff_vs_default"] < 1e-5 for row in rows), rows


def test_variants_only_keeps_the_default_the_pick_and_the_variants(monkeypatch):
    mod = _load()
    from polyrl.backends.cuda.kernels import configs

    monkeypatch.setattr(configs, "HOPPER_PICKS", {("dkdv", 64, False): (32, 16, 4, 1)})
    cands = {"fwd": [(16, 16, 4, 1)], "dq": [(16, 16, 4, 1)],
             "dkdv": [(16, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1)]}
    r = mod.sweep_layout("1x24", None, device="cpu", dtype=torch.float32, do_bench=wall_ms, candidates=cands,
                         kernels=["dkdv"], variants_only=True)
    got = [row["config"] for row in r["kernels"]["dkdv"]["rows"]]
    variants = [mod.config_label(c, v) for c, v in mod.sweep_rows("dkdv", cands["dkdv"], listed=False) if v]
    assert got == ["M16 N16 w4 s1", "M32 N16 w4 s1", *variants]  # no M16 N32 plain row


def test_variant_names_keep_the_default_the_pick_and_those_variants(monkeypatch):
    """``--variants``: the named variants' rows only, beside the default and the Hopper pick (named by its flags:
    PREFETCH + HEADS_INNER is prefetch-heads-inner)."""
    mod = _load()
    from polyrl.backends.cuda.kernels import configs

    monkeypatch.setattr(configs, "HOPPER_PICKS",
                        {("dkdv", 64, False): (32, 16, 4, 1, {"PREFETCH": True, "HEADS_INNER": True})})
    cands = {"fwd": [(16, 16, 4, 1)], "dq": [(16, 16, 4, 1)], "dkdv": [(16, 16, 4, 1), (32, 16, 4, 1)]}
    r = mod.sweep_layout("2x12", None, device="cpu", dtype=torch.float32, do_bench=wall_ms, candidates=cands,
                         kernels=["dkdv"], variant_names=["heads-inner"])
    got = [row["config"] for row in r["kernels"]["dkdv"]["rows"]]
    assert got == ["M16 N16 w4 s1", "M32 N16 w4 s1 prefetch-heads-inner", "M32 N16 w4 s1",
                   "M16 N16 w4 s1 heads-inner", "M32 N16 w4 s1 heads-inner"], got
    assert all(row["ok"] for row in r["kernels"]["dkdv"]["rows"])


@pytest.mark.parametrize(("args", "named"), [(["--kernels", "dkdv,bogus"], "--kernels"),
                                            (["--kernels", "dkdv", "--variants", "heavy-first"], "--variants"),
                                            (["--variants", ","], "--variants")])
def test_bad_kernels_or_variants_are_refused_in_one_line_before_the_gpu_check(args, named, capsys):
    mod = load_bench("attention_sweep")
    assert mod.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err and "CUDA" not in err, err
