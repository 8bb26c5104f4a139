"""How much of an attention kernel's time the order of its programs can waste: a model of the launch, no GPU.

Causal attention gives programs unequal work (a q tile late in its document sees many keys; a key block early in
its document is seen by many queries). The GPU starts programs in grid order as slots free up, so a heavy program
that starts late runs on alone at the end: the tail. This script replays a launch as a greedy list schedule (each
program, in launch order, takes the slot that frees first) and prints the finishing time over the ideal (all work
spread evenly over the slots), for the grid orders of polyrl's kernels at GPT-OSS shapes (8 kv heads):

- ``fwd`` / ``dq``: program = (q tile, kv head), tiles fastest: by default in token order (a document's light tiles
  first), with ``HEAVY_FIRST`` last tile first;
- ``dkdv``: program = (key block, kv head), by default key blocks fastest; ``HEADS_INNER``: kv heads fastest.

Work is counted in tokens seen (plus a fixed cost per program for its loads and stores), slots are concurrent
programs per GPU (SMs x programs per SM, from the kernel's registers: bench/kernel_resources.py). The model ignores
memory effects; it says where ordering matters, the GPU says by how much (bench/attention_sweep.py's heavy-first and
heads-inner variants). One check of its scale: heavy-first took 0.97x-0.99x the forward's and dQ's time on an H200
where the model gives 0.97x.

    python bench/launch_tail.py [--layouts 4x4096,1x16384] [--sms 132] [--fixed 64]
"""

from __future__ import annotations

import argparse
import heapq

H_KV = 8
# kernel -> (tokens per program along T, programs per SM at the Hopper pick, walks "q" tiles or "k" blocks)
# ("dkdv-n128": the 128-key tiles on 8 warps, one program per SM)
KERNELS = {"fwd": (16, 2, "q"), "dq": (32, 1, "q"), "dkdv": (64, 2, "k"), "dkdv-n128": (128, 1, "k")}


def finish_time(order: list, work: dict, slots: int) -> float:
    """Greedy list schedule: each program, in launch order, starts on the slot that frees first."""
    free = [0.0] * slots
    end = 0.0
    for p in order:
        t = heapq.heappop(free) + work[p]
        end = max(end, t)
        heapq.heappush(free, t)
    return end


ORDERS = {"fwd": ("default", "heavy-first"), "dq": ("default", "heavy-first"), "dkdv": ("default", "heads-inner"),
          "dkdv-n128": ("default", "heads-inner")}


def tail(layout: str, kernel: str, order: str, sms: int = 132, fixed: float = 64.0) -> float:
    """Finishing time over the ideal for one kernel, layout ("4x4096": documents x tokens) and grid order (ORDERS:
    "default", "heavy-first" for the q-tile kernels, "heads-inner" for dK/dV)."""
    if order not in ORDERS[kernel]:
        raise ValueError(f"{kernel}: order {order!r}, expected one of {', '.join(ORDERS[kernel])}")
    docs, length = (int(x) for x in layout.split("x"))
    block, per_sm, walks = KERNELS[kernel]
    n_blocks = docs * length // block
    work = {}
    for b in range(n_blocks):
        pos = (b * block) % length
        seen = pos + block / 2 if walks == "q" else length - pos - block / 2
        for h in range(H_KV):
            work[(b, h)] = seen + fixed
    blocks = list(range(n_blocks))
    if order == "heavy-first":
        blocks.reverse()  # the last q tiles (which see the most keys) first
    if order == "heads-inner":
        launch = [(b, h) for b in blocks for h in range(H_KV)]
    else:
        launch = [(b, h) for h in range(H_KV) for b in blocks]
    slots = sms * per_sm
    return finish_time(launch, work, slots) / (sum(work.values()) / slots)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="4x4096,1x16384")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H100 SXM and H200: 132)")
    ap.add_argument("--fixed", type=float, default=64.0, help="a program's fixed cost, in tokens of its walk")
    args = ap.parse_args(argv)
    rows = [(kernel, order) for kernel, orders in ORDERS.items() for order in orders]
    print(f"{'layout':9s} {'kernel':9s} {'grid order':12s} finish / ideal")
    for layout in args.layouts.split(","):
        for kernel, order in rows:
            print(f"{layout:9s} {kernel:9s} {order:12s} {tail(layout, kernel, order, args.sms, args.fixed):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
