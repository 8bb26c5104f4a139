"""Rollout throughput: the vllm engine against the hf engine, same model, prompts and sampling; with the vllm
engine's build, sync and memory beside it.

Models (random init, ``--model``):
  gpt_oss_50m   GPT-OSS-shaped, ~50M parameters (sinks, sliding + full layers, MoE, YaRN), fp32 (the CPU default)
  gpt_oss_20b   GPT-OSS-20B at full depth (24 layers, 32 experts, vocab 201088), bf16
  gpt_oss_20b_2l  the same width, 2 layers
Prompts of ``--prompt-len`` random tokens, up to ``--tokens`` sampled tokens each at temperature 1. Without
``--long-tail`` no stop token is set, so every row generates exactly ``--tokens`` tokens in both engines. With
``--long-tail M`` every M-th token id stops a sequence: on a random-init model (close to uniform next-token
probabilities) the response lengths are then about geometric with mean M, cut at ``--tokens`` -- the long tail of
an RL rollout batch, where a few long rows hold the batch open. The lengths each engine drew are printed.

Measured for vllm: engine build (dummy weights + the first sync, seconds), the sync probe after it (prefill and
decode, against the bar of ``polyrl.core.trainer.sync.verify``, floor-relative below fp32), generated tokens per
second, device memory of the trainer's model plus the sleeping engine, then wake-up and a second sync timed
(seconds and seconds per GiB of weights) and probed again. For hf (the trainer's own model, engine asleep):
tokens per second. Peak device memory is sampled every 20 ms over the whole run. Goal: vllm >= 5x hf.

    .venv/bin/python bench/rollout.py              # CPU: 50M model, 64 prompts x 256 tokens; writes bench/results/rollout_cpu.json
    .venv/bin/python bench/rollout.py --quick      # 8 prompts x 32 tokens, no JSON (a smoke run)
    python bench/rollout.py --backend cuda --model gpt_oss_20b --prompts 128 --tokens 1024 --long-tail 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# GPT-OSS shape at ~50M parameters: 4 layers (sliding, full, sliding, full), 8 q / 2 kv heads of 64, 8 experts top-2.
SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=128)
# name -> (preset, overrides, dtype)
MODELS = {
    "gpt_oss_50m": ("gpt_oss_tiny", SMALL, "float32"),
    "gpt_oss_20b": ("gpt_oss_20b", {}, "bfloat16"),
    "gpt_oss_20b_2l": ("gpt_oss_20b", {"num_hidden_layers": 2}, "bfloat16"),
}


class PeakMemory:
    """Device memory in use (all processes' allocations on the device, as cudaMemGetInfo sees them), sampled every
    ``period`` seconds on a thread; ``peak`` in GiB. Does nothing off CUDA."""

    def __init__(self, torch, device, period: float = 0.02) -> None:
        self.torch, self.on = torch, device.type == "cuda"
        self.peak, self._stop, self.period = 0.0, threading.Event(), period
        self._thread = threading.Thread(target=self._run, daemon=True) if self.on else None

    def used(self) -> float:
        if not self.on:
            return 0.0
        free, total = self.torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            self._stop.wait(self.period)

    def __enter__(self) -> PeakMemory:
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak = max(self.peak, self.used())


def lengths_summary(rows: list[list[int]], cap: int) -> dict:
    n = sorted(len(r) for r in rows)
    q = lambda f: n[min(len(n) - 1, int(f * len(n)))]  # noqa: E731
    return {"mean": round(sum(n) / len(n), 1), "p50": q(0.5), "p90": q(0.9), "max": n[-1],
            "at_cap": round(sum(x == cap for x in n) / len(n), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt_oss_50m", choices=sorted(MODELS))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--long-tail", type=int, default=0, metavar="M",
                    help="every M-th token id is a stop token (mean response length ~M); 0: none")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens, nothing written")
    ap.add_argument("--vllm-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a vLLM engine setting over the backend's (polyrl.backends.vllm_engine.VllmSettings), e.g. "
                         "compile=false or graph_sizes=vllm; the value is read as YAML")
    ap.add_argument("--no-hf", action="store_true", help="the vllm engine alone (comparing its settings)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/rollout_<backend>[_<model>].json)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens = 8, 32
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from polyrl.core.models import build_model
    from polyrl.core.plugins import get_registry
    from polyrl.core.rollout import SamplingParams, build_engine
    from polyrl.core.trainer import sync

    torch.set_num_threads(args.threads)
    backend = get_registry().backends[args.backend]
    device = backend.device(0)
    preset, overrides, dtype = MODELS[args.model]
    vocab = overrides.get("vocab_size")
    t0 = time.perf_counter()
    with torch.device(device):  # drawn where it runs: a 20B model's init on the host alone takes minutes
        torch.manual_seed(0)
        model = build_model(preset, vocab_size=vocab, overrides={k: v for k, v in overrides.items() if k != "vocab_size"},
                            seed=0, dtype=getattr(torch, dtype), backend=backend).eval()
    init_s = time.perf_counter() - t0
    V = int(model.config.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(f"model {args.model}: {n_params / 1e9:.2f}B parameters, {gib:.1f} GiB {dtype}, drawn in {init_s:.1f} s on "
          f"{device}", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(4, V, (args.prompt_len - 1,), generator=gen).tolist()] for _ in range(args.prompts)]
    stops = tuple(range(args.long_tail, V, args.long_tail)) if args.long_tail else ()
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, stop_token_ids=stops)
    seeds = list(range(1, args.prompts + 1))
    max_len = args.prompt_len + args.tokens
    fw = dict(packed=True, pad_id=0, chunk_size=4096, logprobs=backend.logprobs)
    probe = sync.probe_sequences(model.config, V, max_len=max_len)  # as the trainer does: within the engine's length
    rows: dict[str, dict] = {}

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def run(name: str, engine) -> dict:
        t0 = now()
        out = engine.generate(prompts, params, row_seeds=seeds)
        gen_s = now() - t0
        tokens = sum(len(r) for r in out.response_ids)
        if not stops:
            assert tokens == args.prompts * args.tokens, (name, tokens)
        row = {"generate_s": round(gen_s, 3), "tokens": tokens, "tokens_per_s": round(tokens / gen_s, 1),
               "lengths": lengths_summary(out.response_ids, args.tokens)}
        print(f"{name}: {json.dumps(row)}", flush=True)
        return row

    def probed(engine) -> dict:
        try:
            m = sync.verify(engine, model, probe, engine.dtype if engine.dtype != "float32" else dtype, **fw)
            return {k.removeprefix("rollout/"): round(v, 6) for k, v in m.items()} | {"ok": True}
        except sync.SyncFailed as exc:
            return {"ok": False, "error": str(exc)[:400]}

    import dataclasses

    import yaml

    from polyrl.backends.vllm_engine import settings_for

    changes = {}
    for item in args.vllm_set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--vllm-set {item!r}: expected KEY=VALUE")
        changes[key] = yaml.safe_load(value)
    settings = dataclasses.replace(settings_for(backend), **changes)
    with PeakMemory(torch, device) as mem:
        base = mem.used()
        t0 = now()
        engine = build_engine("vllm", model, pad_token_id=0, backend=backend, max_model_len=max_len,
                              max_num_seqs=args.prompts, sampling=params, settings=settings)
        build_s = now() - t0
        vl = {"build_s": round(build_s, 2), "settings_changed": changes, "compile": settings.compile,
              "graph_sizes": settings.graph_sizes, "dtype": engine.dtype, "weight_loader": engine.weight_loader,
              "probe_first_sync": probed(engine)}
        print(f"vllm: built with the first sync in {build_s:.1f} s; probe {vl['probe_first_sync']}", flush=True)
        vl.update(run("vllm", engine))
        vl["device_gib_awake"] = round(mem.used(), 2)
        t0 = now()
        sync.sleep(engine)
        vl["sleep_s"] = round(now() - t0, 3)
        vl["device_gib_trainer_plus_sleeping_engine"] = round(mem.used(), 2)
        if not args.no_hf:
            hf = build_engine("hf", model, pad_token_id=0, backend=backend, max_model_len=max_len, sampling=params)
            rows["hf"] = run("hf", hf)
            del hf
        t0 = now()
        sync.wake_up(engine)
        vl["wake_s"] = round(now() - t0, 3)
        t0 = now()
        engine.sync_weights(model)
        sync_s = now() - t0
        vl.update(sync_s=round(sync_s, 3), sync_s_per_gib=round(sync_s / gib, 4), probe_second_sync=probed(engine))
        print(f"vllm: sync {sync_s:.3f} s ({sync_s / gib:.4f} s/GiB); probe {vl['probe_second_sync']}", flush=True)
        rows["vllm"] = vl
        if hasattr(engine, "close"):
            engine.close()
    peak = round(mem.peak, 2)
    if args.no_hf:
        v = rows["vllm"]
        print(f"\nmodel {args.model}: vllm alone ({changes or 'the backend settings'}): build {v['build_s']:.1f} s, "
              f"{v['tokens_per_s']:.1f} tokens/s, sync {v['sync_s_per_gib']:.4f} s/GiB, sleep {v['sleep_s']:.1f} s, "
              f"peak {peak} GiB")
        print(json.dumps(v))
        return
    ratio = rows["vllm"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    print(f"\nmodel {args.model} ({n_params / 1e9:.2f}B, {dtype}); {args.prompts} prompts x up to {args.tokens} tokens"
          f"{f', stop every {args.long_tail}th id' if stops else ''}; backend {args.backend}")
    print(f"{'engine':<6} {'generate s':>11} {'tokens':>8} {'tokens/s':>10} {'mean len':>9} {'p90':>5} {'at cap':>7}")
    for name in ("vllm", "hf"):
        r = rows[name]
        print(f"{name:<6} {r['generate_s']:>11.2f} {r['tokens']:>8} {r['tokens_per_s']:>10.1f} "
              f"{r['lengths']['mean']:>9.1f} {r['lengths']['p90']:>5} {r['lengths']['at_cap']:>7.3f}")
    print(f"vllm / hf tokens/s: {ratio:.2f}x (goal >= 5x); vllm build {rows['vllm']['build_s']:.1f} s (goal <= 60 s "
          f"at 20B), sync {rows['vllm']['sync_s_per_gib']:.4f} s/GiB (goal <= 1), device memory: before the engine "
          f"{base:.1f} GiB, trainer + sleeping engine {rows['vllm']['device_gib_trainer_plus_sleeping_engine']} GiB, "
          f"peak {peak} GiB")
    if args.quick:
        return
    result = {
        "what": "rollout tokens/s, vllm engine vs hf engine, same model, prompts and sampling (bench/rollout.py)",
        "backend": args.backend, "model": args.model, "model_params": n_params, "weights_gib": round(gib, 2),
        "dtype": dtype, "prompts": args.prompts, "prompt_len": args.prompt_len, "tokens": args.tokens,
        "long_tail": args.long_tail, "threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
        "engines": rows, "ratio_vllm_over_hf": round(ratio, 2), "goal_ratio": 5.0,
        "device_gib_before_engine": round(base, 2), "device_gib_peak": peak,
    }
    default = f"rollout_{args.backend}.json" if args.model == "gpt_oss_50m" else f"rollout_{args.backend}_{args.model}.json"
    path = Path(args.out) if args.out else RESULTS / default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
