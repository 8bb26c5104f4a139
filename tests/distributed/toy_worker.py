"""A toy SPMD training loop for the distributed tests: FSDP2 + clip + DCP checkpoint, no trainer.

Run as ``torchrun ... toy_worker.py OUT_JSON CKPT_DIR STEPS [SAVE_AT]`` (or plainly, one process). Each
step trains on the same global batch of 8 rows, split over ranks; the loss is the global token mean
(per-rank sum all-reduced and divided by the global count), so any world size gives the same numbers.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from polyrl.core import checkpoint as C
from polyrl.core import distributed as D
from polyrl.core.sharding import apply_sharding, clip_grad_norm
from polyrl.backends.cpu import CpuBackend


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


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def main() -> None:
    out, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    save_at = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    backend = CpuBackend()
    ctx = D.init_distributed(backend)
    torch.manual_seed(0)
    model = apply_sharding(Toy(), backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    counter = Counter()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "trainer": counter}
    start = C.load_latest_checkpoint(ckpt, state) or 0
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 16, (8, 6), generator=data) for _ in range(steps)]
    records = []
    for step in range(start, steps):
        x = batches[step][D.rank_slice(8)]
        logits = model(x[:, :-1])
        tok = nn.functional.cross_entropy(logits.reshape(-1, 16), x[:, 1:].reshape(-1), reduction="sum")
        n = torch.tensor(float(x[:, 1:].numel()))
        D.all_reduce_(n)
        # FSDP averages gradients over ranks; scale so the global gradient is that of the global token mean.
        loss = tok / n * ctx.world_size
        loss.backward()
        gnorm = clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.step = step + 1
        m = D.all_reduce_metrics({"loss": (tok / n).item()}, op="sum")
        records.append({"step": step + 1, "loss": m["loss"], "grad_norm": float(gnorm)})
        if save_at and counter.step % save_at == 0:
            C.save_checkpoint(ckpt, counter.step, state, keep=2)
    if ctx.is_main:
        with open(out, "w") as f:
            json.dump(records, f)
    D.shutdown_distributed()


if __name__ == "__main__":
    main()
