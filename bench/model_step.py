"""Model-step benchmark: two GPT-OSS layers at full width, forward + backward with the loss, per attention impl.

``GptOssConfig()`` defaults (hidden 2880, 64 q / 8 kv heads, 128 experts as in GPT-OSS-120B, vocab 201088)
cut to two layers (one sliding, one full), bf16, random init, one sequence of 4k and of 16k tokens. For each
``attn_implementation`` — "polyrl" (the cuda backend's kernel slot: FA4 or its Triton kernel per layer, as
polyrl.backends.cuda.attention_choice picks), "flex_attention", "eager", and transformers' "flash_attention_4"
when flash_attn.cute imports — the median
step time and the peak memory (parameters and gradients included), with transformers' own ``labels=`` loss;
"polyrl+fused" runs the trainer's loss path instead (fused lm_head + log-prob, no logits, then DAPO's policy
loss; ``fused_policy_loss``) as gpt_oss_dapo.yaml runs it: its ``entropy_coeff`` is 0, so the trainer asks for no
entropy in the update (``compute_entropy=False``: no entropy gradient; the entropy metric comes from the old-log-prob
pass, outside the step). "polyrl+fused+entropy" adds an entropy bonus of 0.001 and its gradient, as the tiny recipes
have. "polyrl+fusedloss" is "polyrl+fused" with the policy loss's per-token gradient taken inside the fused op's
forward (``cublas_linear_logprob_loss``, polyrl.core.algorithms.linear_loss: the logits made once, three lm_head
matmuls instead of four; not the trainer's path yet). Eager running out of memory at 16k is an
expected result and is reported as such. docs/background.md §8 anchors are printed beside our numbers.

    python bench/model_step.py [--seqlens 4096,16384] [--out bench/results/model_step.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

ANCHORS = {16384: {"flex": "0.27 s / 60 GiB", "eager": "out of memory"}}


DEFAULT_IMPLS = "polyrl+fused,polyrl+fusedloss,polyrl+fused+entropy,polyrl,flex_attention,eager"


def default_impls() -> str:
    """DEFAULT_IMPLS, with transformers' "flash_attention_4" beside them where flash_attn.cute imports (imported
    here, on the GPU machine, not for --help: the CuTe DSL takes seconds to load)."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # not installed, or its CUDA toolkit flavour missing: the row is left out, and said so
        print(f"flash_attention_4 left out: flash_attn.cute does not import ({type(e).__name__}: {str(e)[:120]})")
        return DEFAULT_IMPLS
    return DEFAULT_IMPLS + ",flash_attention_4"


def register_polyrl_attention() -> str:
    """Use polyrl's transformers registration when present; otherwise a minimal local adapter (bench only)."""
    os.environ.setdefault("POLYRL_BACKEND", "cuda")
    try:
        from polyrl.core.attention import (
            hf as hf_attention,  # registers attn_implementation="polyrl" and its mask function
        )

        hf_attention.register()
        if hf_attention.is_registered():
            return "polyrl"
    except Exception as e:  # not there yet, or broken: fall back to the local adapter, and say so
        print(f"polyrl.core.attention.hf unavailable ({type(e).__name__}: {e}); using the bench adapter")
    from transformers import AttentionInterface

    from polyrl.backends.cuda.attention import cuda_varlen_attention

    def polyrl_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
                         s_aux=None, **kwargs):
        # query [1, Hq, S, D] -> [S, Hq, D] views (the kernels take strided tokens/heads); one document.
        assert query.shape[0] == 1, "this bench adapter handles one sequence"
        s = query.shape[2]
        cu = torch.tensor([0, s], device=query.device, dtype=torch.int32)
        out = cuda_varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                    cu, scale=scaling, window=sliding_window, sinks=s_aux)
        return out.unsqueeze(0), None

    AttentionInterface.register("polyrl_bench", polyrl_attention)
    return "polyrl_bench"


def build_model():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = GptOssForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.train()
    return model, config


def fused_policy_loss(model, ids: torch.Tensor, entropy_coeff: float = 0.0) -> torch.Tensor:
    """The trainer's own loss path (``polyrl+fused``): the last hidden states and lm_head weight go to the cuda
    backend's fused lm_head + log-prob (+ entropy) op (no [T, V] logits), then DAPO's token-mean clipped policy
    loss, with an entropy bonus only when ``entropy_coeff`` > 0, as polyrl.core.trainer.update computes it."""
    from polyrl.backends.cuda.linear_logprobs import triton_linear_logprobs
    from polyrl.core import algorithms as A
    from polyrl.core.models.lm_head import fused_logprobs

    T = ids.shape[1]
    gather = torch.arange(T - 1, device=ids.device)
    labels = ids[0, 1:]
    logp, ent = fused_logprobs(model, {"input_ids": ids}, gather, labels, triton_linear_logprobs,
                               chunk_size=2048, temperature=1.0, compute_entropy=entropy_coeff > 0)
    mask = torch.ones(1, T - 1, device=ids.device)
    adv = torch.linspace(-1, 1, T - 1, device=ids.device)[None]
    pg, _ = A.policy_loss(logp[None], logp.detach()[None], adv, mask, clip_low=0.2, clip_high=0.28)
    return pg - entropy_coeff * A.entropy_loss(ent[None], mask) if entropy_coeff > 0 else pg


def fused_loss_policy_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """``polyrl+fusedloss``: the same DAPO loss as :func:`fused_policy_loss` (no entropy term), its per-token gradient
    handed to the cuda backend's fused-loss op, which applies it inside its forward's token chunks. The loss's value
    comes from the returned log-probs; the op's anchor carries the gradients."""
    from polyrl.backends.cuda.linear_logprobs import cublas_linear_logprob_loss
    from polyrl.core import algorithms as A
    from polyrl.core.models.lm_head import fused_logprobs

    T = ids.shape[1]
    gather = torch.arange(T - 1, device=ids.device)
    labels = ids[0, 1:]
    mask = torch.ones(1, T - 1, device=ids.device)
    adv = torch.linspace(-1, 1, T - 1, device=ids.device)[None]
    old: list[torch.Tensor] = []  # the behaviour log-probs: the op's own (as fused_policy_loss's logp.detach())

    def token_grad(t0, t1, lp, ent):  # token-mean over T - 1 tokens: a chunk's share is exact on its own
        leaf = lp.detach().clone().requires_grad_()
        old.append(lp.detach())
        part, _ = A.policy_loss(leaf[None], lp.detach()[None], adv[:, t0:t1], mask[:, t0:t1], clip_low=0.2,
                                clip_high=0.28, global_tokens=T - 1)
        return torch.autograd.grad(part, leaf)[0], None

    def kernel(h, w, y, **kw):
        return cublas_linear_logprob_loss(h, w, y, token_grad, **kw)

    anchor, logp, _ = fused_logprobs(model, {"input_ids": ids}, gather, labels, kernel, chunk_size=2048,
                                     temperature=1.0, compute_entropy=False)
    with torch.no_grad():
        pg, _ = A.policy_loss(logp[None], torch.cat(old)[None], adv, mask, clip_low=0.2, clip_high=0.28)
    return pg + anchor


def peer_row(rows: list[dict], seqlen: int) -> dict | None:
    """The peer every row is divided by at this length: transformers with FA4 where it ran, else with flex."""
    for peer in ("flash_attention_4", "flex_attention"):
        for r in rows:
            if r["seqlen"] == seqlen and r["impl"] == peer and "error" not in r:
                return r
    return None


def step_stats(model, impl: str, seqlen: int, steps: int) -> dict:
    entropy_coeff = 0.001 if impl.endswith("+entropy") else 0.0
    impl = impl.removesuffix("+entropy")
    fused_loss = impl.endswith("+fusedloss")
    impl = impl.removesuffix("+fusedloss")
    fused = impl.endswith("+fused")
    impl = impl.removesuffix("+fused")
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl
    ids = torch.randint(0, model.config.vocab_size, (1, seqlen), device="cuda")
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 2):  # two warm-up steps (compilation, autotuning)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if fused_loss:
            loss = fused_loss_policy_loss(model, ids)
        elif fused:
            loss = fused_policy_loss(model, ids, entropy_coeff)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        del loss
    times.sort()
    return {"step_s": round(times[len(times) // 2], 4), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--impls", default=None,
                    help=f"attn implementations (default: {DEFAULT_IMPLS}, and flash_attention_4 when flash_attn.cute "
                         "imports); '+fused': the loss through polyrl's fused lm_head log-prob path (DAPO: no entropy term); "
                         "'+fused+entropy': with an entropy bonus of 0.001 and its gradient")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/model_step.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/model_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.impls is None:
        args.impls = default_impls()
    polyrl_name = register_polyrl_attention()
    model, config = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for impl in args.impls.split(","):
            name = impl.replace("polyrl", polyrl_name, 1) if impl.startswith("polyrl") else impl
            row = {"seqlen": seqlen, "impl": impl}
            try:
                row.update(step_stats(model, name, seqlen, args.steps))
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as e:  # report and go on with the other implementations
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    import transformers
    import triton

    result = {
        "versions": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "transformers": transformers.__version__},
        "model": {"layers": 2, "layer_types": config.layer_types, "experts": config.num_local_experts,
                  "hidden": config.hidden_size, "params": n_params, "dtype": "bfloat16", "polyrl_impl": polyrl_name},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'seqlen':>7} {'impl':22} {'step s':>8} {'peak GiB':>9} {'time / peer':>12} {'mem / peer':>11}  anchor")
    for r in rows:
        anchor = ANCHORS.get(r["seqlen"], {}).get(r["impl"], "")
        if "error" in r:
            print(f"{r['seqlen']:7} {r['impl']:22} {r['error'][:60]:>18}  {anchor}")
            continue
        peer = peer_row(rows, r["seqlen"])
        ratio = (f"{r['step_s'] / peer['step_s']:12.2f} {r['peak_gib'] / peer['peak_gib']:11.2f}" if peer
                 else f"{'-':>12} {'-':>11}")
        print(f"{r['seqlen']:7} {r['impl']:22} {r['step_s']:8.3f} {r['peak_gib']:9.2f} {ratio}  {anchor}")
    print("peer: transformers + " + ("flash_attention_4" if any(r["impl"] == "flash_attention_4" and "error" not in r
                                                              for r in rows) else "flex_attention") + ", labels= loss")
    print(json.dumps(result["versions"]), f"params {n_params / 1e9:.2f} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
