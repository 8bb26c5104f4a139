"""A toy SPMD training loop for the distributed tests: FSDP2 + clipping + DCP checkpoints, no trainer.

``python toy_worker.py RUN_DIR STEPS SAVE_EVERY`` (plainly, or under torchrun). It exercises exactly
the pieces the trainer wires together: each step draws the global batch of 8 rows from the global torch
RNG (so resuming must restore RNG state), trains on this rank's slice with a global token-mean loss,
clips, steps AdamW + an LR schedule, appends one line to RUN_DIR/metrics.jsonl (rank 0) and checkpoints
every SAVE_EVERY steps. Rerunning the same command resumes from the newest complete checkpoint and
first drops metric lines past it. ``TOY_STEP_SLEEP_S`` slows each step so a test can kill it mid-step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from polyrl.backends.cpu import CpuBackend
from polyrl.core import distributed as D
from polyrl.core.distributed.process import end_process
from polyrl.core.distributed.sharding import apply_sharding, clip_grad_norm
from polyrl.core.run import checkpoint as C


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 12)
        self.layers = nn.ModuleList([nn.Linear(12, 12) for _ in range(3)])
        self.head = nn.Linear(12, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


class Progress:
    """The trainer-state stand-in: step counter and a KL-controller-like float."""

    def __init__(self) -> None:
        self.step, self.beta = 0, 0.1

    def state_dict(self) -> dict:
        return {"step": self.step, "beta": self.beta}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.beta = sd["step"], sd["beta"]


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def main() -> None:
    run_dir, steps, save_every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sleep_s = float(os.environ.get("TOY_STEP_SLEEP_S", "0"))
    backend = CpuBackend()
    ctx = D.init_distributed(backend)
    torch.manual_seed(0)  # same init and same global batches on every rank
    vocab = 16
    net = Toy()
    model = apply_sharding(net, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    progress = Progress()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "trainer": progress}
    start = C.load_latest_checkpoint(run_dir / "checkpoints", state) or 0
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    if ctx.is_main:
        _truncate_metrics(metrics_path, start)
    for step in range(start, steps):
        batch = torch.randint(0, vocab, (8, 6))  # global batch from the (restored) global RNG
        x = batch[D.rank_slice(8)]
        logits = _logits(model, x[:, :-1])
        tok = nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="sum")
        n = torch.tensor(float(x[:, 1:].numel()))
        D.all_reduce_(n)
        # Gradients are summed over ranks (apply_sharding): each rank's share of the global token mean.
        (tok / n).backward()
        if sleep_s:
            time.sleep(sleep_s)
        gnorm = clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step, progress.beta = step + 1, progress.beta * 1.1
        m = D.all_reduce_metrics({"loss": (tok / n).item()}, op="sum")
        if ctx.is_main:
            with open(metrics_path, "a") as f:
                f.write(
                    json.dumps({"step": step + 1, "loss": m["loss"], "grad_norm": float(gnorm), "beta": progress.beta})
                    + "\n"
                )
        if progress.step % save_every == 0:
            C.save_checkpoint(run_dir / "checkpoints", progress.step, state, keep=2)
    end_process(0)  # as `polyrl run` ends: a barrier, the group destroyed, no interpreter teardown


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


if __name__ == "__main__":
    main()
