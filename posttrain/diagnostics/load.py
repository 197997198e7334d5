"""Read a run directory: per-trajectory summaries from the Parquet ledger, per-step metrics.

Works on a run that is still writing: step files are re-listed on every call (the ledger's
own listing ignores the temp files of an in-flight atomic write) and a file that cannot be read
is skipped rather than failing the whole read.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.trajectory import Ledger

# The ledger's column is ``current_logprob`` (pi_theta as the update saw it); a user's ledger may
# carry the same quantity under another of these names. Ledgers written before the column existed
# lack it: |log rho| is then absent, with the reason (see ``rho_absent_reason``).
CURRENT_LOGPROB_COLUMNS = ("current_logprob", "logprob", "new_logprob")


def open_ledger(run_dir: str | Path) -> Ledger:
    """The ledger of ``run_dir`` (a run directory holding ``ledger/`` or the ledger itself).

    Raises ``FileNotFoundError`` (one line naming the path) when there is no ledger there.
    """
    root = Path(run_dir)
    led = Ledger(root / "ledger" if (root / "ledger").is_dir() else root)
    if not led.traj_dir.is_dir() and not led.metrics_dir.is_dir():
        raise FileNotFoundError(f"no ledger under {root} (expected ledger/trajectories/step_*.parquet)")
    return led


def read_step_table(led: Ledger, step: int) -> pa.Table | None:
    """The trajectory table of ``step``, or ``None`` when the file is gone or unreadable."""
    try:
        return pq.read_table(led.traj_dir / f"step_{step:06d}.parquet")
    except (OSError, pa.ArrowInvalid):
        # Renamed away by a resume (discard_after) or not a complete Parquet file: skip it.
        return None


def current_logprob(row: dict[str, Any]) -> list[float] | None:
    """The per-token current-policy log-probs of a ledger row, if the ledger holds any."""
    for name in CURRENT_LOGPROB_COLUMNS:
        if row.get(name) is not None:
            return list(row[name])
    return None


def _abs_mean_max(d: np.ndarray) -> tuple[float | None, float | None]:
    if d.size == 0:
        return None, None
    a = np.abs(d)
    return float(a.mean()), float(a.max())


def summarize_row(step: int, row: dict[str, Any]) -> dict[str, Any]:
    """Scalar features of one ledger row (one trajectory); every field JSON-serialisable.

    ``abs_log_kappa_*`` is ``|old - behavior|`` over action tokens (train/rollout mismatch),
    ``abs_log_rho_*`` is ``|current - old|`` (only when the ledger holds current log-probs),
    ``ref_kl_mean`` the mean ``old - ref`` (k1 estimate, only with a reference),
    ``teacher_gap_mean`` the mean ``old - teacher`` (only in an on-policy distillation run: ``loss.distill``) and
    ``surprisal_mean`` the mean ``-behavior`` log-prob, an estimate of the sampler's entropy.
    ``group_success`` is filled in by :func:`load_summaries`.
    """
    mask = np.asarray(row["action_mask"], dtype=bool)
    beh = np.asarray(row["behavior_logprob"], dtype=np.float64)[mask]
    out: dict[str, Any] = {
        "step": step, "traj_id": row["traj_id"], "group_id": row["group_id"], "prompt_id": row["prompt_id"],
        "status": row["status"] or "unscored", "finish": row["finish"], "reward": row["reward_total"],
        "length": int(mask.sum()), "lag": row.get("policy_lag"), "verifier": row.get("verifier"),
        "abs_log_kappa_mean": None, "abs_log_kappa_max": None, "abs_log_rho_mean": None, "abs_log_rho_max": None,
        "ref_kl_mean": None, "surprisal_mean": float(-beh.mean()) if beh.size else None, "group_success": None,
        "has_current_column": any(name in row for name in CURRENT_LOGPROB_COLUMNS),
        "advantage_mean": None, "hidden_status": row.get("hidden_status"), "hidden_verifier": row.get("hidden_verifier"),
    }
    adv = row.get("advantage")
    if adv is not None and mask.any():
        out["advantage_mean"] = float(np.asarray(adv, dtype=np.float64)[mask].mean())
    old = row.get("old_logprob")
    if old is not None:
        o = np.asarray(old, dtype=np.float64)[mask]
        out["abs_log_kappa_mean"], out["abs_log_kappa_max"] = _abs_mean_max(o - beh)
        cur = current_logprob(row)
        if cur is not None:
            out["abs_log_rho_mean"], out["abs_log_rho_max"] = _abs_mean_max(np.asarray(cur)[mask] - o)
        if row.get("ref_logprob") is not None and o.size:
            out["ref_kl_mean"] = float((o - np.asarray(row["ref_logprob"], dtype=np.float64)[mask]).mean())
        if row.get("teacher_logprob") is not None and o.size:
            out["teacher_gap_mean"] = float((o - np.asarray(row["teacher_logprob"], dtype=np.float64)[mask]).mean())
    return out


def rho_absent_reason(rows: list[dict[str, Any]]) -> str:
    """Why no trajectory of ``rows`` (:func:`summarize_row` dicts) has a |log rho|; "" if some do."""
    if any(r.get("abs_log_rho_mean") is not None for r in rows):
        return ""
    if not rows:
        return "no trajectories in the ledger"
    if not any(r.get("has_current_column") for r in rows):
        return ("absent: no current-policy log-probs: this ledger was written before they were recorded "
                "(no current_logprob column); see the step-level ratio_min/ratio_max trend instead")
    if not any(r.get("abs_log_kappa_mean") is not None for r in rows):
        return "absent: no trajectory has frozen old log-probs, so current - old cannot be formed"
    return ("absent: no current-policy log-probs in any trajectory (the current_logprob column is empty: the "
            "learner did not record them, e.g. rows computed on another process's shard)")


def _fill_group_success(rows: list[dict[str, Any]]) -> None:
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["step"], r["group_id"])].append(r)
    for members in groups.values():
        scored = [m for m in members if m["status"] not in ("infra_error", "unscored")]
        rate = sum(m["status"] == "correct" for m in scored) / len(scored) if scored else None
        for m in members:
            m["group_success"] = rate


def load_summaries(run_dir: str | Path, steps: list[int] | None = None) -> list[dict[str, Any]]:
    """One :func:`summarize_row` dict per trajectory of every complete step (or of ``steps``)."""
    led = open_ledger(run_dir)
    rows: list[dict[str, Any]] = []
    for s in led.steps() if steps is None else steps:
        table = read_step_table(led, s)
        if table is not None:
            rows.extend(summarize_row(s, r) for r in table.to_pylist())
    _fill_group_success(rows)
    return rows


def _clean(v: Any) -> Any:
    # NaN is not JSON; a metric that could not be computed is "absent", not a number.
    return None if isinstance(v, float) and math.isnan(v) else v


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per-step metric dicts in step order: ``metrics.jsonl`` when present, else the ledger's.

    ``metrics.jsonl`` also holds the step-0 held-out evaluation; a torn last line (a run still
    writing) is skipped.
    """
    root = Path(run_dir)
    path = root / "metrics.jsonl"
    if path.is_file():
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append({k: _clean(v) for k, v in json.loads(line).items()})
            except json.JSONDecodeError:
                continue
        by_step: dict[int, dict[str, Any]] = {}
        for m in out:
            # A resumed run may log a step twice; the later line is the one the ledger kept.
            by_step.setdefault(int(m["step"]), {}).update(m)
        return [by_step[s] for s in sorted(by_step)]
    led = open_ledger(root)
    return [{k: _clean(v) for k, v in m.items()} for m in led.read_metrics()]
