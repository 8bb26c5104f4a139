"""The step and recipe levels of ``polyrl parity``: the trainer itself on a backend against the cpu reference.

**step** — one full RL update of each tiny recipe on fixed rollouts, through the trainer's public stages. The
cpu reference builds a ``Trainer`` (seeded as the recipe says) and runs ``collect()`` → ``prepare_update()`` →
``update()``; the ``UpdateInputs`` (the batch, old and reference log-probs, values, advantages, returns) are the
update's whole input. A second ``Trainer`` on the backend, same seed, so same initial weights (checked), runs
``update()`` on those same inputs, moved to its device. Compared: the loss and the pre-clip gradient norm of each update
(relative difference), the per-parameter-tensor update ``theta_after - theta_before`` (relative norm difference
per tensor; the worst and the median tensor), the update's counters (clip fractions, DAPO's clip-higher
split ``clipfrac_low`` / ``clipfrac_high``, the critic's ``vf_clipfrac``: absolute difference; skipped
non-finite updates: must be equal), and the DAPO rollout counters (overlong-penalized sequences, filtered
groups, generation batches) of the backend's own generation from the same weights and sampling seeds.

**recipe** — ``polyrl run RECIPE --backend NAME --seed S --output DIR trainer.total_steps=N`` for each
tiny recipe and seed, on the backend and on ``cpu``, through the CLI in a subprocess (the product, not a
re-implementation), reading ``metrics.jsonl``. Individual trajectories may diverge chaotically (a last-bit
difference flips one sampled token, and the runs part ways), so the statistic is over seed-averaged
curves: the mean absolute difference of the seed-averaged reward curves, and the difference of the
final reward (seed-averaged, mean of the last ``max(1, N // 5)`` steps). The loss curves are compared the
same way. Bars: :mod:`polyrl.core.tolerances` (``step.*`` and ``recipe.*``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from polyrl.core.plugins import Backend

TINY_RECIPES = ("gpt_oss_dapo_tiny", "deepseek_ppo_tiny")
# Recipe level defaults: `polyrl parity --backend cpu` stays within a few minutes on 2 CPU cores (the
# four runs of one seed pair take ~1 min there); a device run should pass more (docs/parity.md).
DEFAULT_STEPS = 30
DEFAULT_SEEDS = (0, 1)
STEP_SEED = 0
# Counters an update reports (absolute difference of fractions) and which model reports them.
_UPDATE_COUNTERS = ("actor/pg_clipfrac", "actor/clipfrac_low", "actor/clipfrac_high", "critic/vf_clipfrac")
_ROLLOUT_COUNTERS = ("overlong_penalized", "groups_filtered", "gen_batches")


def _recipe_spec(name: str) -> str:
    return f"recipes/{name}.yaml"


def _snapshot(model: Any) -> dict[str, Any]:
    return {n: p.detach().to("cpu", copy=True).double() for n, p in model.named_parameters()}


def update_differences(before_ref: dict, after_ref: dict, before: dict, after: dict) -> list[tuple[str, float]]:
    """Per parameter tensor, ``||d - d_ref|| / ||d_ref||`` with ``d = after - before``; tensors that neither
    run changed are left out (an unused expert), one that only one run changed counts its absolute change."""
    from polyrl.core.tolerances import relative_error

    out = []
    for name, b_ref in before_ref.items():
        d_ref = after_ref[name] - b_ref
        d = after[name] - before[name]
        if float(d_ref.norm()) == 0.0 and float(d.norm()) == 0.0:
            continue
        out.append((name, relative_error(d, d_ref)))
    return out


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def _load_cfg(recipe: str, dtype: str | None, seed: int, extra: Sequence[str] = ()) -> Any:
    from polyrl.core.config import load_config

    overrides = [f"trainer.seed={seed}", *extra]
    if dtype is not None:
        overrides.append(f"model.dtype={dtype}")
    return load_config(_recipe_spec(recipe), overrides)


def step_parity(backend: Backend, dtype: str | None, emit: Callable[[Any], None],
                recipes: Sequence[str] = TINY_RECIPES, overrides: Sequence[str] = ()) -> None:
    """Rows of the step level for both tiny recipes (see the module docstring). ``dtype``: the models'
    dtype (default: the recipe's own ``model.dtype``).

    Runs under torch's deterministic algorithms, as ``polyrl run`` does on the reference backend: torch's CPU
    ``index_put_(accumulate=True)`` (the MoE expert gather's backward) otherwise adds floats with racing
    atomics across threads, and the reference would not equal itself."""
    import torch

    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _step_parity(backend, dtype, emit, recipes, overrides)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _step_parity(backend: Backend, dtype: str | None, emit: Callable[[Any], None], recipes: Sequence[str],
                 overrides: Sequence[str] = ()) -> None:
    import torch

    from polyrl.core.plugins import list_backends
    from polyrl.core.trainer import Trainer, flatten
    from polyrl.parity.rows import FAIL, NOT_RUN, PASS, ParityRow

    cpu = list_backends()["cpu"]
    for recipe in recipes:
        ref_cfg = _load_cfg(recipe, None, STEP_SEED, ["trainer.num_threads=0", *overrides])  # the recipe's dtype
        cfg = _load_cfg(recipe, dtype, STEP_SEED, ["trainer.num_threads=0", *overrides])
        run_dtype = cfg.model.dtype
        name = f"{recipe} step"

        def row(case: str, err: float | None, key: str, detail: str = "", _name: str = name,
                _dtype: str = run_dtype) -> None:
            from polyrl.core.tolerances import TOLERANCES

            bar = TOLERANCES.get((key, _dtype))
            if bar is None:
                emit(ParityRow("step", f"{_name}: {case}", NOT_RUN, err, None,
                               f"no tolerance for {(key, _dtype)} in polyrl/core/tolerances.py", _dtype))
                return
            ok = err is not None and err <= bar  # NaN never passes
            emit(ParityRow("step", f"{_name}: {case}", PASS if ok else FAIL, err, bar, detail, _dtype))

        # 1. the cpu reference: one real trainer step through the public stages, on its own rollout
        ref = Trainer(ref_cfg, cpu)
        exp = ref.collect()
        if exp.batch is None:
            emit(ParityRow("step", f"{name}: all", NOT_RUN, detail="the reference rollout kept no group",
                           dtype=run_dtype))
            continue
        models = {"actor": ref.models.actor, "critic": ref.models.critic}
        before_ref = {k: _snapshot(m) for k, m in models.items() if m is not None}
        inputs = ref.prepare_update(exp)  # old log-probs, advantages, returns: the update's whole input
        m_ref = flatten(ref.update(inputs))  # metric name -> value, as the run logs them
        after_ref = {k: _snapshot(m) for k, m in models.items() if m is not None}
        # 2. the backend: same seed, its own generation (for the rollout counters), then the same update inputs
        dut = Trainer(cfg, backend)  # its models' attention is bound to ``backend`` when they are built
        dmodels = {"actor": dut.models.actor, "critic": dut.models.critic}
        before = {k: _snapshot(m) for k, m in dmodels.items() if m is not None}
        dt = getattr(torch, run_dtype)  # the reference's weights rounded to the backend's dtype
        same_init = all(torch.equal(before[k][n], before_ref[k][n].to(dt).double()) for k in before for n in before[k])
        own = dut.collect()
        m_got = flatten(dut.update(inputs.to(dut.device)))
        after = {k: _snapshot(m) for k, m in dmodels.items() if m is not None}
        if not same_init:
            emit(ParityRow("step", f"{name}: initial weights", FAIL,
                           detail="the backend's trainer did not start from the reference's weights", dtype=run_dtype))
            continue
        n_seq = exp.batch.size
        # 3. rows: per update (critic first, as the trainer runs them), then the counters
        for model in ("critic", "actor"):
            if model not in before_ref or f"{model}/grad_norm" not in m_ref:
                continue
            loss_key = "loss/value" if model == "critic" else "loss/total"
            row(f"{model} loss", _rel(m_got[loss_key], m_ref[loss_key]), "step.loss",
                f"{m_got[loss_key]:.6g} vs cpu {m_ref[loss_key]:.6g}")
            gn = f"{model}/grad_norm"
            row(f"{model} grad norm", _rel(m_got[gn], m_ref[gn]), "step.grad_norm",
                f"{m_got[gn]:.6g} vs cpu {m_ref[gn]:.6g}")
            diffs = update_differences(before_ref[model], after_ref[model], before[model], after[model])
            worst_name, worst = max(diffs, key=lambda d: d[1])
            median = statistics.median(d for _, d in diffs)
            row(f"{model} update, worst tensor", worst, "step.update.worst", f"{worst_name} (of {len(diffs)})")
            row(f"{model} update, median tensor", median, "step.update.median", f"over {len(diffs)} tensors")
        counters = {k: (m_got[k], m_ref[k]) for k in _UPDATE_COUNTERS if k in m_ref}
        if counters:
            worst_c = max(abs(g - r) for g, r in counters.values())
            row("update counters (clip fractions)", worst_c, "step.clipfrac",
                ", ".join(f"{k.split('/')[1]} {g:.4f} vs {r:.4f}" for k, (g, r) in counters.items()))
        skipped = (dut.state.counters.nonfinite_skipped, ref.state.counters.nonfinite_skipped)
        row("non-finite updates skipped", float(abs(skipped[0] - skipped[1])), "step.nonfinite_skipped",
            f"{skipped[0]} vs cpu {skipped[1]}")
        if own.batch is None:
            emit(ParityRow("step", f"{name}: rollout counters", FAIL, detail="the backend's rollout kept no group",
                           dtype=run_dtype))
            continue
        pairs = {k: (getattr(own.counts, k), getattr(exp.counts, k)) for k in _ROLLOUT_COUNTERS}
        same_samples = sum(a == b for a, b in zip(own.batch.responses, exp.batch.responses)) \
            if own.batch.size == exp.batch.size else 0
        worst_r = max(abs(g - r) for g, r in pairs.values()) / n_seq
        row("rollout counters (per sequence)", worst_r, "step.rollout_counters",
            ", ".join(f"{k} {g} vs {r}" for k, (g, r) in pairs.items())
            + f"; {same_samples}/{exp.batch.size} responses sampled identically")


# --- recipe level ------------------------------------------------------------------------------------------
def read_curves(metrics_file: Path) -> dict[str, list[float]]:
    """``reward/mean`` and the loss (``loss/total``, the actor's) per step from a run's metrics.jsonl."""
    reward, loss = [], []
    for line in metrics_file.read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        reward.append(float(m["reward/mean"]))
        loss.append(float(m["loss/total"]) if "loss/total" in m else None)  # None: no update that step
    return {"reward": reward, "loss": loss}


def seed_average(curves: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Point-wise mean over seeds; None where a seed has no value at that step."""
    n = min(len(c) for c in curves)
    return [None if any(c[t] is None for c in curves) else statistics.fmean(c[t] for c in curves) for t in range(n)]


def curve_statistics(dut: Sequence[float], ref: Sequence[float]) -> dict[str, float]:
    """Mean absolute difference of two (seed-averaged) curves, and the difference of their final value (the
    mean of the last ``max(1, N // 5)`` points: one step's batch is noisier than the trend)."""
    pairs = [(a, b) for a, b in zip(dut, ref) if a is not None and b is not None]  # steps both have (NaN stays)
    n = len(pairs)
    if n == 0 or len(dut) != len(ref):
        return {"mae": math.inf, "final": math.inf, "final_dut": math.nan, "final_ref": math.nan}
    mae = statistics.fmean(abs(a - b) for a, b in pairs)
    k = max(1, n // 5)
    fd, fr = statistics.fmean(a for a, _ in pairs[n - k :]), statistics.fmean(b for _, b in pairs[n - k :])
    return {"mae": mae, "final": abs(fd - fr), "final_dut": fd, "final_ref": fr}


def _polyrl_run(recipe: str, backend: str, seed: int, steps: int, out: Path, emulate: bool,
                dtype: str | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "polyrl", "run", _recipe_spec(recipe), "--backend", backend, "--seed", str(seed),
           "--output", str(out), "--no-progress", *overrides, f"trainer.total_steps={steps}", "trainer.save_every=0",
           "trainer.num_threads=1", *([f"model.dtype={dtype}"] if dtype else [])]
    if emulate:
        cmd.append("--emulate")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    res: dict[str, Any] = {"cmd": cmd, "rc": proc.returncode}
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        res["error"] = f"`polyrl run {recipe} --backend {backend} --seed {seed}` exited {proc.returncode}: {tail}"
        return res
    res.update(read_curves(metrics))
    if len(res["reward"]) != steps:
        res["error"] = f"`polyrl run {recipe} --backend {backend} --seed {seed}` logged {len(res['reward'])} of {steps} steps"
    return res


def recipe_parity(backend: Backend, emit: Callable[[Any], None], *, steps: int = DEFAULT_STEPS,
                  seeds: Sequence[int] = DEFAULT_SEEDS, emulate: bool = False, jobs: int = 2,
                  dtype: str | None = None, recipes: Sequence[str] = TINY_RECIPES,
                  overrides: Sequence[str] = ()) -> None:
    """Rows of the recipe level: per tiny recipe, reward MAE, final reward difference, loss MAE."""
    from polyrl.core.tolerances import TOLERANCES
    from polyrl.parity.rows import FAIL, PASS, ParityRow

    with tempfile.TemporaryDirectory(prefix="polyrl-parity-") as tmp:
        jobs_list = [(recipe, side, seed) for recipe in recipes for seed in seeds for side in ("backend", "cpu")]

        def one(job: tuple[str, str, int]) -> dict[str, Any]:
            recipe, side, seed = job
            out = Path(tmp) / f"{recipe}-{side}-{seed}"
            if side == "cpu":  # the reference: the recipe as written (its own dtype), with the same overrides
                return _polyrl_run(recipe, "cpu", seed, steps, out, False, overrides=overrides)
            return _polyrl_run(recipe, backend.name, seed, steps, out, emulate, dtype, overrides)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = dict(zip(jobs_list, pool.map(one, jobs_list)))
    for recipe in recipes:
        name = f"{recipe} x{len(seeds)} seeds, {steps} steps"
        runs = {side: [results[(recipe, side, s)] for s in seeds] for side in ("backend", "cpu")}
        errors = [r["error"] for side in runs.values() for r in side if "error" in r]
        if errors:
            emit(ParityRow("recipe", f"{name}: runs", FAIL, detail=errors[0], dtype=dtype or "recipe"))
            continue
        run_dtype = dtype or _load_cfg(recipe, None, 0, overrides).model.dtype
        avg = {side: {k: seed_average([r[k] for r in rs]) for k in ("reward", "loss")} for side, rs in runs.items()}
        rew = curve_statistics(avg["backend"]["reward"], avg["cpu"]["reward"])
        loss = curve_statistics(avg["backend"]["loss"], avg["cpu"]["loss"])
        # seed-to-seed spread of the cpu reward curves: the scale of the chaos the statistic averages over
        per_step_sd = [statistics.pstdev(r["reward"][t] for r in runs["cpu"]) for t in range(len(avg["cpu"]["reward"]))]
        spread = statistics.fmean(per_step_sd) / math.sqrt(len(seeds))
        # where each seed's pair of trajectories first parts (None: identical rewards throughout)
        parted = [next((t + 1 for t, (a, b) in enumerate(zip(rb["reward"], rc["reward"])) if a != b), None)
                  for rb, rc in zip(runs["backend"], runs["cpu"])]
        same = sum(p is None for p in parted)
        parted_text = f"{same}/{len(seeds)} seeds with identical reward curves" + (
            "" if same == len(seeds) else
            "; the others part at step " + ", ".join(str(p) for p in parted if p is not None))
        curves = {"steps": list(range(1, len(avg["cpu"]["reward"]) + 1)), "seeds": list(seeds),
                  "backend": backend.name, "emulated": emulate,
                  "per_seed": {side: [{"reward": r["reward"], "loss": r["loss"]} for r in rs]
                               for side, rs in runs.items()},
                  "mean": avg, "parted_at": parted}
        for case, err, key, detail, extra in (
            ("reward MAE", rew["mae"], "recipe.reward_mae",
             f"seed-averaged curves; {parted_text}; cpu seed spread (sd/sqrt(seeds)) {spread:.4f}",
             {"curves": curves}),
            ("final reward difference", rew["final"], "recipe.final_reward",
             f"{rew['final_dut']:.4f} vs cpu {rew['final_ref']:.4f} (mean of the last {max(1, steps // 5)} steps)", {}),
            ("loss MAE", loss["mae"], "recipe.loss_mae", "seed-averaged loss/total curves", {}),
        ):
            bar = TOLERANCES.get((key, run_dtype))
            ok = bar is not None and err <= bar
            emit(ParityRow("recipe", f"{name}: {case}", PASS if ok else FAIL, err, bar,
                           detail if bar is not None else f"no tolerance for {(key, run_dtype)}", run_dtype, extra))
