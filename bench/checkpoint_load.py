"""What loading a published (quantized) checkpoint costs: time and peak host memory of ``build_model`` on a
GPT-OSS-architecture checkpoint with MXFP4 experts and a DeepSeek-V3-architecture one with block-FP8 linears,
written by the tests' encoder (tests/published_checkpoints.py) at a width where the experts dominate as in the
real models, against the plain load of the same model in bf16; and ``polyrl export`` of the published directory.

    python bench/checkpoint_load.py                # prints a table, writes bench/results/checkpoint_load.json

Each measurement runs in a fresh process: peak anonymous memory (RssAnon, sampled every 5 ms: the tensors;
the shards' mmap'd pages are file-backed and reclaimable, reported apart as VmHWM) above the process's memory
just before the call, divided by the model's bytes in the training dtype. The page cache is warm (the files
were just written): the time is the CPU cost of reading and dequantizing, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the encoder of the published layouts lives with the tests

ARCHS = {
    # 8 layers, 16 experts of width 1024: ~0.55 G parameters, 94% of them in the experts (GPT-OSS-20B: ~90%)
    "gpt_oss": ("gpt_oss_tiny", {"hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 8,
                                 "num_local_experts": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
                                 "head_dim": 64, "vocab_size": 8192}),
    # 6 layers (1 dense), 32 experts of width 512 + a shared one, MLA at width 1024: ~0.35 G parameters
    "deepseek_v3": ("deepseek_v3_tiny", {"hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 512,
                                         "num_hidden_layers": 6, "n_routed_experts": 32, "num_attention_heads": 16,
                                         "num_key_value_heads": 16, "q_lora_rank": 384, "kv_lora_rank": 256,
                                         "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                                         "n_group": 4, "topk_group": 2, "vocab_size": 8192}),
}

_CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from polyrl.core.models import build_model
from polyrl.core.models.checkpoint_formats import dequantize_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], status("RssAnon"))
        time.sleep(0.005)
what, src, out = sys.argv[2], sys.argv[3], sys.argv[4]
torch.set_num_threads(2)
base = status("RssAnon")
t = threading.Thread(target=sample, daemon=True); t.start()
start = time.perf_counter()
if what == "export":
    dequantize_checkpoint(src, out, torch.bfloat16)
    nbytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
else:
    model = build_model(src, dtype=torch.bfloat16, attn_implementation="eager")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
seconds = time.perf_counter() - start
stop.set(); t.join()
peak[0] = max(peak[0], status("RssAnon"))
print(json.dumps({"seconds": seconds, "model_bytes": nbytes, "peak_anon_above_start": peak[0] - base,
                  "vm_hwm": status("VmHWM")}))
"""


def _measure(what: str, src: Path, out: Path) -> dict:
    env = dict(os.environ, POLYRL_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), what, str(src), str(out)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write(arch: str, root: Path, depth: int = 1) -> tuple[Path, Path]:
    import torch
    from published_checkpoints import TINY

    from polyrl.core.models import build_model

    _, write = TINY[arch]
    name, fields = ARCHS[arch]
    fields = {**fields, "num_hidden_layers": fields["num_hidden_layers"] * depth}
    original = root / f"{arch}-bf16"
    model = build_model(name, dtype=torch.bfloat16, seed=0, overrides=fields, attn_implementation="eager")
    model.save_pretrained(original, max_shard_size="200MB")
    del model
    write(original, root / f"{arch}-published", shards=4)
    return original, root / f"{arch}-published"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "checkpoint_load.json"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for arch in ARCHS:
            # twice as deep: what grows with the model and what stays one layer's worth
            for depth in (1, 2):
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir()
                original, published = _write(arch, root, depth)
                cases = [("bf16 (plain load)", "load", original), ("published (dequantizing)", "load", published),
                         ("export published -> bf16", "export", published)]
                for label, what, src in cases if depth == 1 else cases[1:2]:
                    out = root / f"{arch}-export"
                    m = _measure(what, src, out)
                    m.update(arch=arch, layers=ARCHS[arch][1]["num_hidden_layers"] * depth, case=label,
                             gb=m["model_bytes"] / 1e9)
                    m["s_per_gb"] = m["seconds"] / m["gb"]
                    m["peak_over_model"] = m["peak_anon_above_start"] / m["model_bytes"]
                    rows.append(m)
                    print(f"{arch:12s} {m['layers']:3d} layers {label:26s} {m['gb']:5.2f} GB {m['seconds']:6.2f} s "
                          f"{m['s_per_gb']:5.2f} s/GB  peak anon +{m['peak_anon_above_start'] / 1e9:5.2f} GB = "
                          f"{m['peak_over_model']:4.2f} x model  VmHWM {m['vm_hwm'] / 1e9:5.2f} GB", flush=True)
    Path(args.out).write_text(json.dumps({
        "host": platform.node(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
