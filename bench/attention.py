"""Attention benchmark on one GPU: polyrl's Triton varlen attention beside FA4, FLA, SDPA, flex_attention, eager.

GPT-OSS shape (64 q / 8 kv heads, head_dim 64), bf16, 16k tokens packed as 4 documents of 4096 and as one
document, window None and 128, sinks on. For each case and implementation: forward and forward+backward ms
(triton.testing.do_bench, median), useful TFLOP/s (only visible (query, key) pairs count), peak memory of one
forward+backward, the first call's wall time (compilation included), and, for every implementation with sinks,
accuracy against the fp32 reference (relative norm of out, dq, dk, dv, dsink). The peers run in the same process
on the same inputs: FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL) and FLA
(``fla.ops.attn.parallel_attn``, Triton) when importable (bench/gpu_peers.sh installs them offline), else
reported "not installed". After the table, each case prints our figure beside each peer's and the ratio
ours/peer (below 1: ours is faster); docs/background.md §8 anchors appear only in place of a peer that did not run.

    python bench/attention.py [--quick | --variants] [--layouts 4x4096,1x16384] [--windows none,128]
                              [--impls ...] [--no-accuracy] [--max-wall-s S] [--profile]
                              [--out bench/results/attention.json]

polyrl's kernel paths run as separate implementations in the same process (polyrl.backends.cuda.attention.
KernelOptions): ``polyrl`` (default: two-pass deterministic backward, aligned tiles, first configs),
``polyrl-atomic`` (fused dK/dV + atomic dQ backward), ``polyrl-band`` (exact band tiles for the window; not run
on causal cases, where it changes nothing), ``polyrl-table`` (per-head-dim config table), ``polyrl-new`` (all
three); ``polyrl-selected`` is the cuda backend's kernel slot, FA4 or the Triton kernel as its rule picks per case
(polyrl.backends.cuda.attention_choice; the pick is printed). --variants: every polyrl path beside FA4, FLA, cuDNN
SDPA and flex on all four cases, short timing, a wall-clock budget (--max-wall-s, default 190 s: peers other than
FA4 not started by then are reported as skipped), written to bench/results/attention_variants.json. --profile:
instead of timing, one torch.profiler pass over a few fwd+bwd calls of each implementation on the first
layout/window, printing the CUDA kernels' time per call (which kernel the time goes to).

--quick: 4x4096 only (causal and window 128), no eager, shorter timing (do_bench warmup 5 ms / rep 20 ms),
written to bench/results/attention_quick.json unless --out says otherwise; about a minute with cold compile
caches (FA4's CuTe DSL JIT and flex's torch.compile dominate the first run; both caches persist in /tmp).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import sys
import time

import torch

HQ, HKV, D = 64, 8, 64
# docs/background.md §8, H200, packed 16k tokens, sinks on: (fwd ms, fwd+bwd ms). Shown only for a peer that did not run.
ANCHORS = {
    ("4x4096", None): {"fa4": (1.46, 4.69), "fla": (1.82, 10.13), "flex": (2.13, 8.40), "sdpa-nosink": (1.24, 5.06)},
    ("4x4096", 128): {"fa4": (0.50, 1.59), "fla": (0.83, 3.70), "flex": (0.99, 3.52)},
    ("1x16384", None): {"fa4": (4.25, 15.2), "fla": (5.92, 32.2), "flex": (6.36, 25.6)},
    ("1x16384", 128): {"fa4": (0.59, 1.66), "fla": (0.84, 3.81), "flex": (1.00, 3.54)},
}
TARGETS = {("4x4096", None): (1.3, 4.2), ("4x4096", 128): (0.15, 0.5)}
OURS = "polyrl"
PEER_DISTS = ("flash-attn-4", "fla-core", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "quack-kernels",
              "apache-tvm-ffi", "liger-kernel")
FULL = {"layouts": "4x4096,1x16384", "windows": "none,128",
        "impls": "polyrl,polyrl-selected,fa4,fla,sdpa-nosink,flex,eager",
        "warmup_ms": 10, "rep_ms": 50, "out": "bench/results/attention.json"}
QUICK = {"layouts": "4x4096", "windows": "none,128", "impls": "polyrl,polyrl-selected,fa4,fla,sdpa-nosink,flex",
         "warmup_ms": 5, "rep_ms": 20, "out": "bench/results/attention_quick.json"}
# polyrl's kernel paths: name -> KernelOptions fields (bench name "polyrl-<path>").
POLYRL_PATHS = {"": {}, "atomic": {"bwd": "atomic"}, "band": {"window_tiles": "band"}, "table": {"configs": "table"},
                "new": {"bwd": "atomic", "window_tiles": "band", "configs": "table"}}
VARIANTS = {"layouts": "4x4096,1x16384", "windows": "none,128",
            "impls": "polyrl,polyrl-atomic,polyrl-band,polyrl-table,polyrl-new,fa4,sdpa-nosink,fla,flex",
            "warmup_ms": 5, "rep_ms": 25, "out": "bench/results/attention_variants.json", "max_wall_s": 190}
TIMING = {"warmup_ms": FULL["warmup_ms"], "rep_ms": FULL["rep_ms"]}


def useful_flops(lengths: list[int], window: int | None) -> float:
    """Forward FLOPs over visible pairs only: 2 matmuls x 2 FLOP x D per (query, key, head)."""
    pairs = 0
    for n in lengths:
        if window is None:
            pairs += n * (n + 1) // 2
        else:
            w = min(window, n)
            pairs += w * (w + 1) // 2 + (n - w) * w
    return 4.0 * pairs * D * HQ


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=TIMING["warmup_ms"], rep=TIMING["rep_ms"], return_mode="median"))


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


class PeerMissing(Exception):
    """An optional peer that cannot be imported: reported as "not installed" or "import failed", not as a bug."""


class NotApplicable(Exception):
    """An implementation that has nothing to add on this case (reported as "n/a: why")."""


def import_peer(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise PeerMissing(f"not installed: {e}") from None
    except Exception as e:  # e.g. the CuTe DSL finding no usable CUDA toolkit flavour
        raise PeerMissing(f"import failed: {type(e).__name__}: {str(e)[:200]}") from None


# --- implementations: each returns a fwd callable (or (fwd, grad leaves)) over the shared packed inputs -----
def polyrl_impl(path: str):
    """An implementation running polyrl's kernels with the options of ``POLYRL_PATHS[path]``."""
    fields = POLYRL_PATHS[path]

    def impl(q, k, v, sinks, cu, lengths, window):
        from polyrl.backends.cuda.attention import KernelOptions, triton_varlen_attention

        options = KernelOptions(**fields)
        if fields.get("window_tiles") == "band" and len(fields) == 1 and not options.band(window):
            raise NotApplicable("band tiles change only windows <= 256")
        scale = D**-0.5

        def fwd():
            return triton_varlen_attention(q, k, v, cu, scale=scale, window=window, sinks=sinks, options=options)

        return fwd

    return impl


def impl_sdpa(q, k, v, sinks, cu, lengths, window):
    """cuDNN / flash SDPA, batched documents, causal, NO sink and no window: the upper bound."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if window is not None:
        raise NotApplicable("SDPA has no sliding window")
    if len(set(lengths)) != 1:
        raise NotApplicable("batched SDPA needs equal document lengths")
    b, n = len(lengths), lengths[0]
    qb = q.view(b, n, HQ, D).transpose(1, 2)
    kb = k.repeat_interleave(HQ // HKV, 1).view(b, n, HQ, D).transpose(1, 2).detach().requires_grad_()
    vb = v.repeat_interleave(HQ // HKV, 1).view(b, n, HQ, D).transpose(1, 2).detach().requires_grad_()

    def fwd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            return out.transpose(1, 2).reshape(b * n, HQ, D)

    return fwd, (qb, kb, vb)


_FLEX = {}


def impl_flex(q, k, v, sinks, cu, lengths, window):
    """flex_attention with a document(+window) block mask; the sink through the differentiable LSE."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    t = q.shape[0]
    doc = torch.searchsorted(cu[1:].long(), torch.arange(t, device=q.device), right=True)

    def mask_mod(b, h, qi, kj):
        ok = (doc[qi] == doc[kj]) & (kj <= qi)
        if window is not None:
            ok = ok & (qi - kj < window)
        return ok

    bm = create_block_mask(mask_mod, None, None, t, t, device=q.device)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def fwd():
        out, lse = flex(q4, k4, v4, block_mask=bm, enable_gqa=True, return_lse=True)
        out = out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
        return out.squeeze(0).transpose(0, 1)

    return fwd


def impl_eager(q, k, v, sinks, cu, lengths, window):
    """What transformers' eager GPT-OSS attention does: dense logits, the sink as an extra column."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    def fwd():
        outs = []
        for a, b in itertools.pairwise(bounds):
            n = b - a
            qd = q[a:b].transpose(0, 1)
            kd = k[a:b].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            vd = v[a:b].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            logits = qd @ kd.transpose(1, 2) * D**-0.5
            i = torch.arange(n, device=q.device)
            allowed = i[None, :] <= i[:, None]
            if window is not None:
                allowed = allowed & (i[:, None] - i[None, :] < window)
            logits = logits.masked_fill(~allowed, float("-inf"))
            logits = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, n, 1).to(logits.dtype)], -1)
            probs = torch.softmax(logits - logits.amax(-1, keepdim=True), -1, dtype=torch.float32)[..., :-1]
            outs.append((probs.to(vd.dtype) @ vd).transpose(0, 1))
        return torch.cat(outs)

    return fwd


def impl_fla(q, k, v, sinks, cu, lengths, window):
    """FLA's Triton parallel_attn: [B=1, T, H, D] with cu_seqlens (int64); window_size=W keeps keys
    [i - W + 1, i] (ours' convention); sink_bias [Hq] is the GPT-OSS sink logit (natural log units)."""
    parallel_attn = import_peer("fla.ops.attn", "parallel_attn")
    cu64 = cu.long()
    q1, k1, v1 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)

    def fwd():
        return parallel_attn(q1, k1, v1, scale=D**-0.5, window_size=window, cu_seqlens=cu64,
                             sink_bias=sinks).squeeze(0)

    return fwd


def fa4_window(window: int | None) -> tuple[int | None, int | None]:
    """FA4's (left, right): key j visible from query i when i - left <= j <= i + right; ours keeps W keys."""
    return (window - 1, 0) if window is not None else (None, None)


def impl_fa4(q, k, v, sinks, cu, lengths, window):
    """FA4 (CuTe DSL). Keyword arguments only: the 4th positional parameter is qv (MLA), not cu_seqlens_q.
    It always returns (out, lse); learnable_sink [Hq] may be fp32 and gets its gradient."""
    flash_attn_varlen_func = import_peer("flash_attn.cute", "flash_attn_varlen_func")
    n = max(lengths)

    def fwd():
        out, _lse = flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                           max_seqlen_k=n, softmax_scale=D**-0.5, causal=True,
                                           window_size=fa4_window(window), learnable_sink=sinks)
        return out

    return fwd


def impl_polyrl_selected(q, k, v, sinks, cu, lengths, window):
    """The cuda backend's kernel slot (``cuda_varlen_attention``): FA4 or the Triton kernel, as its rule picks for
    this case (polyrl.backends.cuda.attention_choice; POLYRL_CUDA_ATTENTION overrides), printed before its row."""
    from polyrl.backends.cuda.attention import cuda_varlen_attention
    from polyrl.backends.cuda.attention_choice import choose

    print(f"polyrl-selected {len(lengths)}x{lengths[0]} window {window}: {choose(q, v, window, sinks)}", flush=True)

    def fwd():
        return cuda_varlen_attention(q, k, v, cu, scale=D**-0.5, window=window, sinks=sinks)

    return fwd


IMPLS = {**{OURS + (f"-{p}" if p else ""): polyrl_impl(p) for p in POLYRL_PATHS},
         "polyrl-selected": impl_polyrl_selected, "fa4": impl_fa4, "fla": impl_fla, "sdpa-nosink": impl_sdpa,
         "flex": impl_flex, "eager": impl_eager}


def make_inputs(layout: str):
    """The case's bf16 leaves (q, k, v, fp32 sinks), cu_seqlens, document lengths and upstream gradient."""
    n_docs, n = (int(x) for x in layout.split("x"))
    lengths = [n] * n_docs
    t = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    sinks = (torch.randn(HQ, device="cuda", generator=gen) + 1.0).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    do = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, sinks, cu, lengths, do


def make_fwd_bwd(name: str, q, k, v, sinks, cu, lengths, window, do):
    """(fwd, fwd_bwd) callables of one implementation on the shared inputs."""
    made = IMPLS[name](q, k, v, sinks, cu, lengths, window)
    fwd, leaves = made if isinstance(made, tuple) else (made, (q, k, v, sinks))

    def fwd_bwd():
        out = fwd()
        torch.autograd.grad(out, leaves, do, allow_unused=True)

    return fwd, fwd_bwd


_REFERENCES: dict[str, dict] = {}


def run_case(layout: str, window: int | None, impls: list[str], accuracy: bool, deadline: float) -> list[dict]:
    q, k, v, sinks, cu, lengths, do = make_inputs(layout)
    flops = useful_flops(lengths, window)
    # the fp32 reference of this case, computed once for all implementations (inputs are seeded: same values)
    reference = _REFERENCES.setdefault(case_key(layout, window), {})
    rows = []
    for name in impls:
        row = {"layout": layout, "window": window, "impl": name, "sinks": name != "sdpa-nosink"}
        try:
            if time.time() > deadline:
                raise NotApplicable("skipped: --max-wall-s budget spent")
            fwd, fwd_bwd = make_fwd_bwd(name, q, k, v, sinks, cu, lengths, window, do)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fwd_bwd()  # compiles / autotunes
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            with torch.no_grad():
                row["fwd_ms"] = bench_ms(fwd)
            row["fwd_bwd_ms"] = bench_ms(fwd_bwd)
            row["peak_gib"] = round(peak_gib(fwd_bwd), 3)
            row["fwd_tflops"] = round(flops / row["fwd_ms"] / 1e9, 1)
            row["fwd_bwd_tflops"] = round(3.5 * flops / row["fwd_bwd_ms"] / 1e9, 1)
            if accuracy and row["sinks"]:
                if not reference:
                    reference.update(fp32_reference(q, k, v, sinks, cu, window, do))
                row.update(accuracy_vs_fp32(fwd, q, k, v, sinks, do, reference))
        except PeerMissing as e:
            row["error"] = str(e)
        except NotApplicable as e:
            row["error"] = f"n/a: {e}" if not str(e).startswith("skipped") else str(e)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as e:  # a peer failing must not hide the others' numbers
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


GRAD_NAMES = ("dq", "dk", "dv", "dsink")


def polyrl_reference():
    """polyrl's exact reference; its module moved in the polyrl.core.attention package split (old path kept)."""
    import importlib

    for module in ("polyrl.core.attention.reference", "polyrl.core.reference_attention"):
        try:
            return importlib.import_module(module).reference_varlen_attention
        except ModuleNotFoundError:
            continue
    raise ImportError("polyrl's reference_varlen_attention not found")


def fp32_reference(q, k, v, sinks, cu, window, do) -> dict:
    """polyrl's exact fp32 reference on the same (bf16-rounded) inputs: out and the four gradients."""
    reference_varlen_attention = polyrl_reference()
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, sinks)]
    ref = reference_varlen_attention(*leaves[:3], cu, scale=D**-0.5, window=window, sinks=leaves[3])
    grads = torch.autograd.grad(ref, leaves, do.float())
    return {"out": ref.detach(), **dict(zip(GRAD_NAMES, grads))}


def accuracy_vs_fp32(fwd, q, k, v, sinks, do, reference: dict) -> dict:
    """bf16 kernel vs the fp32 reference: relative norm of out and of each gradient."""
    out = fwd()
    grads = torch.autograd.grad(out, (q, k, v, sinks), do)
    res = {"err_out": rel(out, reference["out"])}
    res.update({f"err_{n}": rel(g, reference[n]) for n, g in zip(GRAD_NAMES, grads)})
    return {k_: float(f"{v_:.2e}") for k_, v_ in res.items()}


# --- ours beside each peer (no GPU needed below this line) ------------------------------------------------
def case_key(layout: str, window: int | None) -> str:
    return f"{layout}/{window}"


def ratio(ours: float | None, peer: float | None) -> float | None:
    return round(ours / peer, 3) if ours and peer else None


def max_grad_err(row: dict) -> float | None:
    errs = [row[f"err_{n}"] for n in GRAD_NAMES if f"err_{n}" in row]
    return max(errs) if errs else None


def compare(rows: list[dict], peers: list[str]) -> dict:
    """{"vs_<peer>": {case: ours and peer ms, ratio ours/peer (below 1: ours faster), accuracy or error}}."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(case_key(r["layout"], r["window"]), {})[r["impl"]] = r
    result = {}
    for peer in peers:
        cases = {}
        for key, impls in by_case.items():
            ours, theirs = impls.get(OURS, {}), impls.get(peer)
            if theirs is None:
                continue
            entry = {"ours_fwd_ms": ours.get("fwd_ms"), "ours_fwd_bwd_ms": ours.get("fwd_bwd_ms"),
                     "peer_fwd_ms": theirs.get("fwd_ms"), "peer_fwd_bwd_ms": theirs.get("fwd_bwd_ms"),
                     "ratio_fwd": ratio(ours.get("fwd_ms"), theirs.get("fwd_ms")),
                     "ratio_fwd_bwd": ratio(ours.get("fwd_bwd_ms"), theirs.get("fwd_bwd_ms")),
                     "ours_err_out": ours.get("err_out"), "peer_err_out": theirs.get("err_out"),
                     "ours_err_grad_max": max_grad_err(ours), "peer_err_grad_max": max_grad_err(theirs),
                     "ours_peak_gib": ours.get("peak_gib"), "peer_peak_gib": theirs.get("peak_gib")}
            if "error" in theirs:
                entry["peer_error"] = theirs["error"]
            if "error" in ours:
                entry["ours_error"] = ours["error"]
            cases[key] = entry
        result[f"vs_{peer}"] = cases
    return result


def _ms(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def _err(x: float | None) -> str:
    return f"{x:.1e}" if x is not None else "-"


def comparison_lines(rows: list[dict], peers: list[str]) -> list[str]:
    """Per case: our fwd / f+b ms, then each peer's beside it with ours/peer, accuracy, and errors or anchors."""
    comp = compare(rows, peers)
    lines = [f"\nours ({OURS}) vs each peer, same run, same inputs; ratio = ours/peer (below 1: ours faster)",
             f"{'case':16} {'peer':12} {'ours fwd/f+b ms':>17} {'peer fwd/f+b ms':>17} {'ratio fwd':>9} "
             f"{'ratio f+b':>9}  err out ours/peer  err grad-max ours/peer"]
    cases = list(dict.fromkeys(case_key(r["layout"], r["window"]) for r in rows))
    for key in cases:
        layout, w = key.split("/")
        anchors = ANCHORS.get((layout, None if w == "None" else int(w)), {})
        for peer in peers:
            e = comp[f"vs_{peer}"].get(key)
            if e is None:
                continue
            ours_s = f"{_ms(e['ours_fwd_ms'])}/{_ms(e['ours_fwd_bwd_ms'])}"
            if "peer_error" in e or e["peer_fwd_ms"] is None:
                anc = anchors.get(peer)
                note = f"  (docs/background.md §8 anchor, not this run: {anc[0]}/{anc[1]} ms)" if anc else ""
                lines.append(f"{key:16} {peer:12} {ours_s:>17} {e.get('peer_error', 'no figure')[:60]}{note}")
                continue
            peer_s = f"{_ms(e['peer_fwd_ms'])}/{_ms(e['peer_fwd_bwd_ms'])}"
            rf = f"{e['ratio_fwd']:.2f}" if e["ratio_fwd"] is not None else "-"
            rb = f"{e['ratio_fwd_bwd']:.2f}" if e["ratio_fwd_bwd"] is not None else "-"
            lines.append(f"{key:16} {peer:12} {ours_s:>17} {peer_s:>17} {rf:>9} {rb:>9}  "
                         f"{_err(e['ours_err_out'])}/{_err(e['peer_err_out'])}      "
                         f"{_err(e['ours_err_grad_max'])}/{_err(e['peer_err_grad_max'])}")
    return lines


def versions() -> dict:
    import transformers
    import triton

    def dist_version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "peers": {d: dist_version(d) for d in PEER_DISTS}}


def is_ours(impl: str) -> bool:
    return impl == OURS or impl.startswith(OURS + "-")


def paths(rows: list[dict], peer: str = "fa4") -> dict:
    """{case: {polyrl path: ms, ratio to the default path and to ``peer`` (below 1: the path is faster)}}."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault(case_key(r["layout"], r["window"]), {})[r["impl"]] = r
    result = {}
    for key, impls in by_case.items():
        base, other = impls.get(OURS, {}), impls.get(peer, {})
        result[key] = {name: {"fwd_ms": r.get("fwd_ms"), "fwd_bwd_ms": r.get("fwd_bwd_ms"), "peak_gib": r.get("peak_gib"),
                              "err_out": r.get("err_out"), "err_grad_max": max_grad_err(r), "error": r.get("error"),
                              f"ratio_fwd_vs_{OURS}": ratio(r.get("fwd_ms"), base.get("fwd_ms")),
                              f"ratio_fwd_bwd_vs_{OURS}": ratio(r.get("fwd_bwd_ms"), base.get("fwd_bwd_ms")),
                              f"ratio_fwd_vs_{peer}": ratio(r.get("fwd_ms"), other.get("fwd_ms")),
                              f"ratio_fwd_bwd_vs_{peer}": ratio(r.get("fwd_bwd_ms"), other.get("fwd_bwd_ms"))}
                       for name, r in impls.items() if is_ours(name)}
    return result


def path_lines(rows: list[dict], peer: str = "fa4") -> list[str]:
    """polyrl's kernel paths per case: ms, ratios to the default path and to ``peer`` from the same run."""
    lines = ["\npolyrl kernel paths, same run; ratio = path / reference (below 1: the path is faster)",
             f"{'case':16} {'path':14} {'fwd/f+b ms':>15} {'/' + OURS + ' fwd f+b':>16} {'/' + peer + ' fwd f+b':>13} "
             f"{'peak GiB':>8}  err out / grad-max"]
    f2 = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    for key, entries in paths(rows, peer).items():
        for name, e in entries.items():
            if e["fwd_ms"] is None:
                lines.append(f"{key:16} {name:14} {(e['error'] or 'no figure')[:80]}")
                continue
            lines.append(f"{key:16} {name:14} {_ms(e['fwd_ms']) + '/' + _ms(e['fwd_bwd_ms']):>15} "
                         f"{f2(e[f'ratio_fwd_vs_{OURS}']):>7} {f2(e[f'ratio_fwd_bwd_vs_{OURS}']):>8} "
                         f"{f2(e[f'ratio_fwd_vs_{peer}']):>6} {f2(e[f'ratio_fwd_bwd_vs_{peer}']):>6} "
                         f"{e['peak_gib'] if e['peak_gib'] is not None else '-':>8}  "
                         f"{_err(e['err_out'])} / {_err(e['err_grad_max'])}")
    return lines


def profile(layout: str, window: int | None, impls: list[str], iters: int = 5) -> dict:
    """torch.profiler over ``iters`` fwd+bwd calls of each implementation: CUDA time per call by kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    q, k, v, sinks, cu, lengths, do = make_inputs(layout)
    result = {}
    for name in impls:
        try:
            _, fwd_bwd = make_fwd_bwd(name, q, k, v, sinks, cu, lengths, window, do)
            fwd_bwd()  # compile outside the profile
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    fwd_bwd()
                torch.cuda.synchronize()
        except Exception as e:  # a missing or failing peer must not hide the others' profiles
            print(f"\n{name}: {type(e).__name__}: {str(e)[:200]}")
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        kernels = []
        for evt in prof.key_averages():
            us = getattr(evt, "self_device_time_total", None)
            us = evt.self_cuda_time_total if us is None else us
            if us > 0:
                kernels.append({"kernel": evt.key, "calls_per_iter": evt.count / iters, "us_per_iter": us / iters})
        kernels.sort(key=lambda x: -x["us_per_iter"])
        total = sum(x["us_per_iter"] for x in kernels)
        result[name] = {"total_us_per_iter": round(total, 1), "kernels": kernels}
        print(f"\n{name}: {layout} window {window}, fwd+bwd, CUDA time per call {total / 1000:.3f} ms")
        for x in kernels[:12]:
            print(f"  {x['us_per_iter']:9.1f} us {100 * x['us_per_iter'] / total:5.1f}%  x{x['calls_per_iter']:<4g} "
                  f"{x['kernel'][:90]}")
        torch.cuda.empty_cache()
    return result


def table_lines(rows: list[dict]) -> list[str]:
    lines = [f"\n{'layout':8} {'window':6} {'impl':14} {'fwd ms':>8} {'f+b ms':>8} {'fwd TF':>7} {'f+b TF':>7} "
             f"{'peak GiB':>8} {'1st call s':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layout']:8} {r['window']!s:6} {r['impl']:14} {r['error']}")
            continue
        tgt = TARGETS.get((r["layout"], r["window"])) if r["impl"] == OURS else None
        lines.append(f"{r['layout']:8} {r['window']!s:6} {r['impl']:14} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
                     f"{r['fwd_tflops']:7.0f} {r['fwd_bwd_tflops']:7.0f} {r['peak_gib']:8.2f} "
                     f"{r.get('first_call_s', 0):10.1f}" + (f"  target {tgt[0]}/{tgt[1]} ms" if tgt else ""))
        if "err_out" in r:
            errs = " ".join(f"{k[4:]} {v:.1e}" for k, v in r.items() if k.startswith("err_"))
            lines.append(f"{'':31}accuracy vs fp32 (rel. norm): {errs}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4x4096 causal + window 128, no eager, short timing")
    ap.add_argument("--variants", action="store_true",
                    help="every polyrl kernel path beside fa4, fla, sdpa, flex on all four cases, < 4 min")
    ap.add_argument("--max-wall-s", type=float,
                    help="peers (not polyrl's paths nor fa4) not started by then are skipped (--variants: 190)")
    ap.add_argument("--profile", action="store_true",
                    help="profile fwd+bwd of each impl on the first layout and window instead of timing")
    ap.add_argument("--layouts")
    ap.add_argument("--windows")
    ap.add_argument("--impls")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.quick and args.variants:
        ap.error("--quick and --variants are two presets: pick one")
    preset = QUICK if args.quick else VARIANTS if args.variants else FULL
    for key in ("layouts", "windows", "impls", "out"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.max_wall_s is None:
        args.max_wall_s = preset.get("max_wall_s", float("inf"))
    args.warmup_ms, args.rep_ms = preset["warmup_ms"], preset["rep_ms"]
    unknown = [i for i in args.impls.split(",") if i not in IMPLS]
    if unknown:
        ap.error(f"unknown impls {unknown}; known: {','.join(IMPLS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    # FA4 keeps its compiled CuTe kernels on disk (under /tmp) when asked: a second run skips the JIT.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/tmp/fa4_cute_dsl_cache")
    TIMING.update(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    impls = args.impls.split(",")
    windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
    t0 = time.time()
    if args.profile:
        layout = args.layouts.split(",")[0]
        result = {"versions": versions(), "profile": {"layout": layout, "window": windows[0],
                                                      "impls": profile(layout, windows[0], impls)}}
        out = args.out.replace(".json", "_profile.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}; wall {time.time() - t0:.1f} s")
        return 0
    # polyrl's paths and FA4 always run; the other peers start only while the budget lasts.
    core = [i for i in impls if is_ours(i) or i == "fa4"]
    rest = [i for i in impls if i not in core]
    rows = []
    for layout in args.layouts.split(","):
        for window in windows:
            rows += run_case(layout, window, core, accuracy=not args.no_accuracy, deadline=float("inf"))
    for name in rest:  # peer by peer, so a spent budget drops whole peers' later cases, cheapest peers first
        for layout in args.layouts.split(","):
            for window in windows:
                rows += run_case(layout, window, [name], accuracy=not args.no_accuracy,
                                 deadline=t0 + args.max_wall_s)
    layouts = args.layouts.split(",")
    rows.sort(key=lambda r: (layouts.index(r["layout"]), windows.index(r["window"]), impls.index(r["impl"])))
    peers = [i for i in impls if not is_ours(i)]
    result = {"versions": versions(), "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16"},
              "timing": {"quick": args.quick, "variants": args.variants, "do_bench_warmup_ms": args.warmup_ms,
                         "do_bench_rep_ms": args.rep_ms},
              "anchors_ms": {f"{k[0]}/{k[1]}": v for k, v in ANCHORS.items()}, "rows": rows,
              **compare(rows, peers), "paths": paths(rows), "wall_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(table_lines(rows)))
    print("\n".join(comparison_lines(rows, peers)))
    if any(is_ours(i) and i != OURS for i in impls):
        print("\n".join(path_lines(rows)))
    print(json.dumps(result["versions"]), f"wall {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
