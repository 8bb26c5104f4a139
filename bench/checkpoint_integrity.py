"""What checkpoint integrity costs: a DCP save with polyrl's hashing writer against torch DCP's own writer
(the peer) on the same state, and the verification before a resume (sizes + every digest) against DCP's
own load of the same checkpoint. Single process, on this machine's disk; the state is a model-like dict of
fp32/bf16 tensors of ``--gib`` GiB in total.

    python bench/checkpoint_integrity.py --gib 2            # prints a table, writes bench/results/...json

At scale the cost grows with the bytes each rank writes or verifies; the table extrapolates the measured
throughput to one rank's share of a GPT-OSS-20B DAPO checkpoint (bf16 weights + fp32 Adam moments + fp32
master copy: ~16 bytes per parameter, 21e9 parameters, over 8 ranks). The page cache is not dropped (that
needs root): the load and verify figures read from memory, so they show the CPU cost of hashing, not the
disk's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from polyrl.core.run import integrity as I  # noqa: E402


def _state(gib: float) -> dict[str, torch.Tensor]:
    """Tensors of 64 MiB (fp32) and 32 MiB (bf16), alternating, random contents (no compressible runs)."""
    g = torch.Generator().manual_seed(0)
    state, total, i = {}, 0, 0
    while total < gib * (1 << 30):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        t = torch.randn(4096, 4096, generator=g).to(dtype)
        state[f"layer{i}.weight"] = t
        total += t.numel() * t.element_size()
        i += 1
    return state


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "checkpoint_integrity.json"))
    args = ap.parse_args()
    state = _state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="polyrl-ckpt-bench-", dir=args.dir))
    try:
        plain_dir, hashed_dir = root / "plain", root / "hashed"

        def save_plain() -> None:
            shutil.rmtree(plain_dir, ignore_errors=True)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(plain_dir)))

        written: dict = {}

        def save_hashed() -> None:
            shutil.rmtree(hashed_dir, ignore_errors=True)
            writer, got = I.hashing_storage_writer(hashed_dir)
            dcp.save(state, storage_writer=writer)
            written.clear()
            written.update(got)

        # interleaved, so drift in the machine's load hits both alike
        t_plain, t_hashed = [], []
        for _ in range(args.repeats):
            t_plain += _timed(save_plain, 1)
            t_hashed += _timed(save_hashed, 1)
        assert written and all(v is not None for v in written.values()), written
        files = {name: {"size": size, "digest": digest} for name, (size, digest) in written.items()}
        marker = {"world_size": 1, "hash": I.HASH, "files": {**files, **_fake_extra(hashed_dir)}}

        def load() -> None:
            target = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(hashed_dir)))

        def verify() -> None:
            I.verify_files(hashed_dir, marker)

        t_load, t_verify = [], []
        for _ in range(args.repeats):
            t_load += _timed(load, 1)
            t_verify += _timed(verify, 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in
           (("save_dcp", t_plain), ("save_polyrl", t_hashed), ("load_dcp", t_load), ("verify_polyrl", t_verify))}
    gb = nbytes / 1e9
    rank_share_gb = 21e9 * 16 / 8 / 1e9
    rows = [
        ("save", "polyrl (DCP + sha256 while writing)", med["save_polyrl"], "torch DCP FileSystemWriter", med["save_dcp"]),
        ("resume check", "polyrl verify (sizes + sha256, threads)", med["verify_polyrl"], "torch DCP load", med["load_dcp"]),
    ]
    print(f"{gb:.2f} GB of tensors, median of {args.repeats}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'what':<13} {'ours':<42} {'s':>7} {'GB/s':>6}   {'peer':<27} {'s':>7}  ratio ours/peer")
    result_rows = []
    for what, ours, t_ours, peer, t_peer in rows:
        print(f"{what:<13} {ours:<42} {t_ours:7.2f} {gb / t_ours:6.2f}   {peer:<27} {t_peer:7.2f}  {t_ours / t_peer:.2f}")
        result_rows.append({"what": what, "ours": ours, "ours_s": round(t_ours, 3), "peer": peer,
                            "peer_s": round(t_peer, 3), "ratio": round(t_ours / t_peer, 3)})
    hash_overhead_s = med["save_polyrl"] - med["save_dcp"]
    print(f"extra time of hashing while saving: {hash_overhead_s:+.2f} s ({hash_overhead_s / gb:+.3f} s/GB); "
          f"verify throughput {gb / med['verify_polyrl']:.2f} GB/s")
    print(f"extrapolated to one rank's share of a GPT-OSS-20B DAPO checkpoint ({rank_share_gb:.0f} GB, 8 ranks): "
          f"save +{max(hash_overhead_s, 0) / gb * rank_share_gb:.0f} s, verify {rank_share_gb / (gb / med['verify_polyrl']):.0f} s")
    out = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "gb": round(gb, 3),
           "repeats": args.repeats, "rows": result_rows,
           "samples_s": {"save_dcp": t_plain, "save_polyrl": t_hashed, "load_dcp": t_load, "verify_polyrl": t_verify},
           "rank_share_gb_gpt_oss_20b_8ranks": rank_share_gb}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _fake_extra(step_dir: Path) -> dict:
    """verify_files insists on the per-rank extra state polyrl writes beside DCP's files; this bench writes
    only DCP's, so it adds an empty one (hashed like the rest)."""
    extra = step_dir / "extra" / "rank_0.pt"
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_bytes(b"")
    return {"extra/rank_0.pt": I.digest_file(extra)}


if __name__ == "__main__":
    sys.exit(main())
