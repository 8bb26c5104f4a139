"""``polyrl export CHECKPOINT OUT_DIR``: a training checkpoint as a Hugging Face model directory.

CHECKPOINT is a step directory (``runs/x/checkpoints/step_00000010``), a checkpoints directory or a run
directory (the newest complete checkpoint is taken). OUT_DIR receives ``model.safetensors``,
``config.json`` and the tokenizer; ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it.
CHECKPOINT may also be a published checkpoint directory in MXFP4 (GPT-OSS) or block FP8 (DeepSeek-V3): OUT_DIR
then receives its weights dequantized, shard by shard, with its config (no quantization block), tokenizer and
chat template.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as HF safetensors + config + tokenizer")
    p.add_argument("checkpoint", help="step directory, checkpoints directory or run directory")
    p.add_argument("out_dir", help="empty or new directory for the HF model")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype; auto: the dtype the run trained in (bfloat16 for a published directory)")


def main(args: argparse.Namespace) -> int:
    from polyrl.core.run.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype)
    print(f"exported {args.checkpoint} -> {out}")
    return 0
