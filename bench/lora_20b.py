"""GPT-OSS-20B with LoRA, end to end on one GPU: ``recipes/gpt_oss_dapo_lora.yaml`` at full depth and width, random
init, the synthetic ``copy`` task over the whole 201,088-token vocabulary (201,081 number symbols + ``copy : =``
+ the 4 specials: prompts of ``--k`` random symbols), through ``polyrl run`` with the engine the backend picks.

    python bench/lora_20b.py --out runs/lora20b                 # 5 steps, 8 prompts x 16 samples, 1024 tokens
    python bench/lora_20b.py --steps 5 --batch 32 --response 8192   # the recipe's own batch and lengths

A random-init model never stops on its own (its end-of-sequence token is one of 201,088), so every response runs to
``--response`` tokens and every reward is 0: dynamic sampling (which would keep no group) is off; the step's work
is the recipe's. Per step, from metrics.jsonl: generated tokens/s (response tokens / rollout time), trained tokens/s
(the batch's tokens / old-log-prob + update time), end-to-end RL throughput (prompt + response tokens / step time,
per GPU), the trainer process's peak allocated memory (vLLM's weights and KV cache included: the engine is in the
trainer's process and, at sleep level 0, in torch's allocator) beside the dry-run plan of the same command, the
device's peak used memory (nvidia-smi, polled every second), and the sync probe. Writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

VOCAB_SYMBOLS = 201_081  # + copy : = + <pad> <bos> <eos> <unk> = GPT-OSS's 201,088 ids


def overrides(args: argparse.Namespace) -> list[str]:
    return [
        "model.name=gpt_oss_20b", "model.init_device=device", "data.task=copy", f"data.task_params={{k: {args.k}, n_digits: {VOCAB_SYMBOLS}}}",
        "data.path=null", "data.prompt_format=raw", f"data.max_prompt_length={args.k + 8}",
        f"data.batch_size={args.batch}", f"rollout.max_response_length={args.response}",
        f"rollout.micro_batch_size={args.micro}", "algorithm.dynamic_sampling.enable=false",
        f"algorithm.mini_batch_size={args.batch * 16}", f"algorithm.overlong.buffer_length={max(1, args.response // 4)}",
        f"trainer.total_steps={args.steps}", "trainer.save_every=0", *args.set,
    ]


class DevicePeak(threading.Thread):
    """The device's used memory at its highest (nvidia-smi), polled every second."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_mib = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=10).stdout
                self.peak_mib = max(self.peak_mib, float(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/lora20b")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="prompts per step (x 16 samples)")
    ap.add_argument("--response", type=int, default=1024, help="response tokens (every response reaches it)")
    ap.add_argument("--micro", type=int, default=128, help="sequences generated together (the engine's KV cache)")
    ap.add_argument("--k", type=int, default=64, help="symbols per prompt")
    ap.add_argument("--set", nargs="*", default=[], help="more key=value overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = "recipes/gpt_oss_dapo_lora.yaml"
    common = [sys.executable, "-m", "polyrl", "run", recipe, "--backend", args.backend]
    plan_cmd = [*common, "--dry-run", "--json", *overrides(args)]
    try:
        import torch

        plan_cmd[plan_cmd.index("--dry-run") + 1:plan_cmd.index("--dry-run") + 1] = [
            "--device-memory", f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"]
    except Exception:
        pass
    done = subprocess.run(plan_cmd, capture_output=True, text=True)
    plan = json.loads(done.stdout)["memory_plan"] if done.stdout.strip().startswith("{") else {"error": done.stderr}
    print(f"plan: peak {plan.get('peak_gib')} GiB, phases {plan.get('phases')}", flush=True)
    run_dir = out / "run"
    cmd = [*common, "--output", str(run_dir), "--no-progress", *overrides(args)]
    print("$ " + " ".join(cmd), flush=True)
    poll = DevicePeak()
    poll.start()
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    poll.stop.set()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if (
        run_dir / "metrics.jsonl").exists() else []
    seqs = args.batch * 16
    steps = []
    for m in rows:
        gen = seqs * m.get("response/length_mean", 0.0)
        train_s = m.get("time/old_logprob_s", 0.0) + m.get("time/update_s", 0.0)
        steps.append({
            "step": m["step"], "step_s": m.get("time/step_s"), "rollout_s": m.get("time/rollout_s"),
            "old_logprob_s": m.get("time/old_logprob_s"), "update_s": m.get("time/update_s"),
            "sync_s": m.get("time/sync_s"), "tokens": m.get("batch/tokens"), "generated_tokens": gen,
            "generated_tok_s": gen / m["time/rollout_s"] if m.get("time/rollout_s") else None,
            "trained_tok_s": m["batch/tokens"] / train_s if train_s else None,
            "e2e_tok_s_per_gpu": m["batch/tokens"] / m["time/step_s"] if m.get("time/step_s") else None,
            "peak_gib": m.get("memory/peak_gib"), "probe_prefill": m.get("rollout/sync_probe_prefill"),
            "probe_decode": m.get("rollout/sync_probe_decode"), "logprob_diff": m.get("rollout/logprob_diff"),
        })
    later = steps[1:] or steps  # the first step pays the engine's first CUDA-graph replays and allocator warm-up
    summary = {
        "command": " ".join(cmd), "rc": rc, "wall_s": wall, "plan": plan, "steps": steps,
        "device_peak_used_gib": poll.peak_mib / 1024,
        "median_after_step_1": {k: statistics.median(s[k] for s in later if s[k] is not None)
                                for k in ("step_s", "generated_tok_s", "trained_tok_s", "e2e_tok_s_per_gpu")
                                if any(s[k] is not None for s in later)},
        "peak_gib": max((s["peak_gib"] or 0.0) for s in steps) if steps else None,
    }
    if summary["peak_gib"] and plan.get("peak_gib"):
        summary["plan_vs_measured"] = plan["peak_gib"] / summary["peak_gib"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{'step':>4} {'step s':>7} {'gen tok/s':>10} {'train tok/s':>11} {'e2e tok/s':>10} {'peak GiB':>9} {'probe':>9}")
    for s in steps:
        print(f"{s['step']:>4} {s['step_s'] or 0:7.1f} {s['generated_tok_s'] or 0:10.0f} {s['trained_tok_s'] or 0:11.0f} "
              f"{s['e2e_tok_s_per_gpu'] or 0:10.0f} {s['peak_gib'] or 0:9.1f} "
              f"{max(s['probe_prefill'] or 0, s['probe_decode'] or 0):9.2e}")
    print(f"rc {rc}, wall {wall:.0f} s; plan peak {plan.get('peak_gib')} GiB vs measured {summary['peak_gib']} "
          f"(device used at most {summary['device_peak_used_gib']:.1f} GiB)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
