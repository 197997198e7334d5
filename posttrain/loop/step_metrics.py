"""Per-step data metrics (the learner reports its own: loss, clip fractions, ratio, KL, entropy).

Documented keys (all floats):

- ``reward/mean``, ``reward/std``: composed total over usable trajectories
- ``reward/<component>``: mean of each raw, unweighted component
- ``train/accuracy``: fraction of usable trajectories with status ``correct``
- ``status/<name>``: count per status (``infra_error`` included: excluded from the update)
- ``length/mean|p50|p95|max``: generated tokens per trajectory
- ``finish/truncated_rate``: fraction of trajectories ending by the length limit
- ``adv/zero_group_frac``: fraction of groups whose advantages are all zero (no signal)
- ``logkappa/p99``: 99th percentile of |behavior - old| log-prob over the action tokens sampled under
  pi_old's own weights (engine mismatch; absent when none; lag: the learner's ``lag/logratio_abs_*``)
- ``kl/ref_mean``: mean token KL estimate to the reference (when a reference exists)
- ``tokens/generated``, ``tokens/trained``: action tokens sampled / entering the loss
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from posttrain.trajectory import Finish, Status, Trajectory, TrajectoryBatch

if TYPE_CHECKING:
    from posttrain.loop.targets import Targets


def _pct(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.to(torch.float64), q)) if x.numel() else float("nan")


def status_counts(all_trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``status/<name>`` for every :class:`~posttrain.trajectory.Status`: how many of ``all_trajs`` (every
    trajectory the step writes to the ledger, ``infra_error`` and ``env_failure`` included) hold it.

    The one count of a step's statuses: a step with no usable trajectory (every verification failed)
    reports it too, so the metrics always count exactly what the ledger holds.
    """
    counts = Counter(t.status.value for t in all_trajs if t.status is not None)
    return {f"status/{s.value}": float(counts.get(s.value, 0)) for s in Status}


def length_metrics(all_trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``length/mean|p50|p95|max`` (generated tokens per trajectory) and ``finish/truncated_rate`` (the
    fraction that ended at the length limit) over ``all_trajs`` (every trajectory of the step, at least one):
    what ``guards.min_response_length`` and ``guards.max_truncation_rate`` read, in every trainer that samples."""
    lengths = torch.tensor([t.num_actions for t in all_trajs], dtype=torch.float64)
    return {"length/mean": float(lengths.mean()), "length/p50": _pct(lengths, 0.5), "length/p95": _pct(lengths, 0.95),
            "length/max": float(lengths.max()),
            "finish/truncated_rate": sum(t.finish is Finish.TRUNCATED for t in all_trajs) / len(all_trajs)}


def step_metrics(batch: TrajectoryBatch, all_trajs: Sequence[Trajectory], targets: Targets, *,
                 learner_version: int | None = None) -> dict[str, float]:
    """Data metrics of one step (see the module docstring for each key); ``learner_version``: the
    version pi_old was computed under (None: every action token counts as same-version)."""
    usable = batch.trajectories
    m: dict[str, float] = {}
    totals = torch.tensor([float(t.reward.total) for t in usable], dtype=torch.float64)  # type: ignore[arg-type]
    m["reward/mean"] = float(totals.mean())
    m["reward/std"] = float(totals.std(unbiased=False))
    comps: dict[str, list[float]] = {}
    for t in usable:
        for k, v in t.reward.components.items():
            comps.setdefault(k, []).append(v)
    m.update({f"reward/{k}": sum(v) / len(v) for k, v in comps.items()})
    m["train/accuracy"] = sum(t.status is Status.CORRECT for t in usable) / len(usable)
    m.update(status_counts(all_trajs))
    m.update(length_metrics(all_trajs))
    mask = batch.action_mask > 0
    adv_abs = (targets.advantages.abs() * mask).sum(dim=1)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(usable):
        groups.setdefault(t.group_id, []).append(i)
    zero = sum(bool((adv_abs[idx] == 0).all()) for idx in groups.values())
    m["adv/zero_group_frac"] = zero / len(groups)
    assert batch.old_logprob is not None, "step_metrics needs pi_old frozen on the batch"
    # engine mismatch only: tokens sampled under the weights pi_old was computed with (lag has its own
    # lag/logratio_* metrics from the learner)
    same = mask if learner_version is None else mask & (batch.behavior_version == learner_version)
    lk = (batch.behavior_logprob - batch.old_logprob.to(torch.float64)).abs()[same]
    if lk.numel():
        m["logkappa/p99"] = _pct(lk, 0.99)
    if targets.token_kl is not None:
        m["kl/ref_mean"] = float(targets.token_kl[mask].mean())
    m["tokens/generated"] = float(sum(t.num_actions for t in all_trajs))
    m["tokens/trained"] = float(mask.sum())
    return m
