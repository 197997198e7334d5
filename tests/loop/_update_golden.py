"""Issue 12 part 1: what one update step records, captured so the batch refactor can be compared
with the code before it (golden arrays in ``golden/update_step_pre12.npz``).

``capture(name, run_dir)`` trains one of :data:`CASES` for :data:`STEPS` steps on the micro model
and returns flat arrays: per ledger trajectory its tokens, old / ref log-probs and versions and
reward; per step the advantages (and returns) the update trained on, read where the loop hands
them to ``step_metrics``; the metric keys of every step and the ledger's trajectory columns; the
actor (and critic) weights after the last step.

Regenerate (only from the code *before* a change that must not move these numbers)::

    .venv/bin/python tests/loop/_update_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "update_step_pre12.npz"
STEPS = 3
_BASE = ["model.path=builtin:micro", "task.name=flaky_task:digit_first", "task.kwargs={terms: 2}",
         "sampling.max_new_tokens=3", "optim.lr=1e-2", "eval.size=8", "eval.every=100",
         "logging.progress=false", f"steps={STEPS}", f"checkpoint_every={STEPS}"]
_GRPO = ["sampling.prompts_per_step=8", "sampling.group_size=4", "loss.kl_estimator=k3", "loss.kl_coef=0.05"]
# name -> (recipe, overrides): fused / unfused pi_old, PPO with a critic (GAE, KL in the reward,
# 2 epochs x 2 mini-batches) and a behaviour correction (TIS, which turns fusing off).
# The recipes as they were when the golden arrays were recorded (the shipped ones have since gained an
# SFT warm-up and several mini-batches per step, issue 22): this test is about the update, not the recipes.
_GRPO_RECIPE = str(HERE / "golden" / "grpo_pre22.yaml")
_PPO_RECIPE = str(HERE / "golden" / "ppo_pre22.yaml")
CASES: dict[str, tuple[str, list[str]]] = {
    "grpo_fused": (_GRPO_RECIPE, [*_GRPO, "optim.fuse_old_logprob=true"]),
    "grpo_unfused": (_GRPO_RECIPE, [*_GRPO, "optim.fuse_old_logprob=false"]),
    "ppo_critic": (_PPO_RECIPE, ["sampling.prompts_per_step=8", "sampling.group_size=1", "critic.lr=1e-2"]),
    "grpo_tis": (_GRPO_RECIPE, [*_GRPO, "correction.name=tis", "correction.kwargs={cap: 1.5}"]),
}


def capture(name: str, run_dir: Path) -> dict[str, np.ndarray]:
    """Train case ``name`` into ``run_dir`` and return its arrays (keys prefixed ``name/``)."""
    from safetensors.torch import load_file

    import posttrain.loop.run as run_module
    import posttrain.loop.training_loop as training_loop
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory import Ledger

    recipe, over = CASES[name]
    seen: list[tuple[list[str], np.ndarray, np.ndarray | None]] = []
    real = run_module.step_metrics  # called by the stage loop/run.py judge_update

    def spy(batch: Any, trajs: Any, tg: Any, *args: Any, **kwargs: Any) -> Any:
        mask = batch.action_mask.double()
        ret = None if tg.returns is None else (tg.returns.double() * mask).numpy()
        seen.append(([t.traj_id for t in batch.trajectories], (tg.advantages.double() * mask).numpy(), ret))
        return real(batch, trajs, tg, *args, **kwargs)

    sys.path.insert(0, str(HERE))  # flaky_task
    run_module.step_metrics = spy
    try:
        training_loop.train(load_run_config(recipe, [*_BASE, *over, f"run_dir={run_dir}"]))
    finally:
        run_module.step_metrics = real
        sys.path.remove(str(HERE))
    led = Ledger(run_dir / "ledger")
    trajs = led.read_trajectories()
    out: dict[str, np.ndarray] = {
        "traj_ids": np.array([t.traj_id for t in trajs]),
        "lengths": np.array([t.length for t in trajs]),
        "token_ids": np.concatenate([t.token_ids for t in trajs]),
        "old_logprob": np.concatenate([t.old_logprob for t in trajs]),  # type: ignore[list-item]
        "old_version": np.array([t.old_version for t in trajs]),
        "reward_total": np.array([t.reward.total for t in trajs], dtype=np.float64),
    }
    if all(t.ref_logprob is not None for t in trajs):
        out["ref_logprob"] = np.concatenate([t.ref_logprob for t in trajs])  # type: ignore[list-item]
        out["ref_version"] = np.array([t.ref_version for t in trajs])
    # per step, rows in the order the update saw them, cut to each row's length
    out["adv_traj_ids"] = np.array([i for ids, _, _ in seen for i in ids])
    by_id = {t.traj_id: t.length for t in trajs}
    out["advantages"] = np.concatenate([a[r, : by_id[i]] for ids, a, _ in seen for r, i in enumerate(ids)])
    if all(ret is not None for _, _, ret in seen):
        out["returns"] = np.concatenate([x[r, : by_id[i]] for ids, _, x in seen for r, i in enumerate(ids)])  # type: ignore[index]
    metrics = led.read_metrics()
    out["metric_keys"] = np.array(sorted({f"{i}:{k}" for i, m in enumerate(metrics) for k in m}))
    out["ledger_columns"] = np.array(sorted(_ledger_columns(run_dir / "ledger")))
    ck = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    for k, v in load_file(str(ck / "actor" / "model.safetensors")).items():
        out[f"actor.{k}"] = v.numpy()
    for p in sorted((ck).glob("critic/**/*.safetensors")):
        for k, v in load_file(str(p)).items():
            out[f"critic.{p.relative_to(ck / 'critic').as_posix()}.{k}"] = v.numpy()
    return {f"{name}/{k}": v for k, v in out.items()}


def _ledger_columns(root: Path) -> set[str]:
    import pyarrow.parquet as pq

    cols: set[str] = set()
    for kind in ("trajectories", "metrics"):
        for f in sorted((root / kind).glob("step_*.parquet")):
            cols |= {f"{kind}:{c}" for c in pq.read_schema(f).names}
    return cols


def main() -> None:
    """Write :data:`GOLDEN` from the current code."""
    import tempfile

    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            arrays.update(capture(name, Path(tmp) / name))
    GOLDEN.parent.mkdir(exist_ok=True)
    np.savez_compressed(GOLDEN, **arrays)
    print(f"wrote {GOLDEN} ({len(arrays)} arrays)")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    main()
