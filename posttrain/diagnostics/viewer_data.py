"""The JSON documents behind ``posttrain view``: steps -> groups -> trajectories -> tokens.

Pure functions of a run directory (no HTTP here, so tests call them directly). Step files are
re-listed on every call and an unreadable (partially written) file is skipped, so the viewer
follows a run that is still writing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.diagnostics.load import current_logprob, open_ledger, read_step_table, summarize_row
from posttrain.trajectory import Ledger

# colour field -> legend text. Only fields the ledger can support are offered per trajectory.
COLOUR_FIELDS: dict[str, str] = {
    "advantage": "the advantage the update used, per token, as stored in the ledger (a ledger written "
                 "before advantages were stored: (r - group mean) / group std, recomputed)",
    "log_kappa": "log kappa = old - behaviour log-prob (train/rollout mismatch)",
    "log_rho": "log rho = current - old log-prob (needs current log-probs in the ledger)",
    "surprisal": "-behaviour log-prob: a one-sample estimate of the sampler's entropy",
    "ref_kl": "old - ref log-prob (k1 KL estimate; needs a reference)",
}


@dataclasses.dataclass(frozen=True)
class Filters:
    """Trajectory filters of the viewer; ``None`` means unbounded, empty ``status`` means any."""

    status: frozenset[str] = frozenset()
    lag_min: int | None = None
    lag_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    len_min: int | None = None
    len_max: int | None = None

    @classmethod
    def from_query(cls, q: dict[str, str]) -> Filters:
        """From URL query values; raises ``ValueError`` naming a malformed parameter."""
        def num(name: str, typ: Callable[[str], Any]) -> Any:
            v = q.get(name, "").strip()
            if not v:
                return None
            try:
                return typ(v)
            except ValueError:
                raise ValueError(f"filter {name}={v!r} is not a number") from None

        return cls(frozenset(s for s in q.get("status", "").split(",") if s), num("lag_min", int),
                   num("lag_max", int), num("reward_min", float), num("reward_max", float),
                   num("len_min", int), num("len_max", int))

    def keep(self, s: dict[str, Any]) -> bool:
        """Whether a :func:`~posttrain.diagnostics.load.summarize_row` summary passes every filter."""
        def within(v: float | None, lo: float | None, hi: float | None) -> bool:
            if lo is None and hi is None:
                return True
            return v is not None and (lo is None or v >= lo) and (hi is None or v <= hi)

        return ((not self.status or s["status"] in self.status) and within(s["lag"], self.lag_min, self.lag_max)
                and within(s["reward"], self.reward_min, self.reward_max)
                and within(s["length"], self.len_min, self.len_max))


def _step_columns(led: Ledger, step: int, names: list[str]) -> pa.Table | None:
    """Only the columns ``names`` (those the file has) of ``step``'s table: a step's token arrays are most
    of its bytes. ``None`` when the file is gone or not (yet) a complete Parquet file."""
    path = led.traj_dir / f"step_{step:06d}.parquet"
    try:
        have = set(pq.ParquetFile(path).schema_arrow.names)
        return pq.read_table(path, columns=[n for n in names if n in have])
    except (OSError, pa.ArrowInvalid):
        return None


def list_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable step: trajectory count, mean reward and status counts."""
    led = open_ledger(run_dir)
    out = []
    for step in led.steps():
        table = _step_columns(led, step, ["status", "reward_total"])
        if table is None:
            continue
        statuses = [s or "unscored" for s in table.column("status").to_pylist()]
        rewards = [r for r in table.column("reward_total").to_pylist() if r is not None]
        out.append({"step": step, "n": table.num_rows,
                    "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                    "status": {k: statuses.count(k) for k in sorted(set(statuses))}})
    return out


def _rows(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    table = read_step_table(open_ledger(run_dir), step)
    if table is None:
        raise FileNotFoundError(f"step {step} is not (yet) a complete file in the ledger of {run_dir}")
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def group_advantages(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """traj_id -> (reward - group mean) / group std (population std); 0 for a zero-std group.

    Trajectories without a reward (infra errors) get ``None`` and are left out of their group.
    """
    groups: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        if r["reward_total"] is not None:
            groups.setdefault(r["group_id"], []).append((r["traj_id"], float(r["reward_total"])))
    out: dict[str, float | None] = {r["traj_id"]: None for r in rows}
    for members in groups.values():
        vals = np.array([v for _, v in members])
        std = float(vals.std())
        for tid, v in members:
            out[tid] = (v - float(vals.mean())) / std if std > 0 else 0.0
    return out


def row_advantages(rows: list[dict[str, Any]]) -> tuple[dict[str, float | None], str]:
    """traj_id -> advantage of each row and where it came from (``"ledger"`` or ``"recomputed"``).

    ``"ledger"``: the mean over action tokens of the stored per-token ``advantage`` the update
    used (rows without one, e.g. infra errors, get ``None``). A ledger written before advantages
    were stored falls back to :func:`group_advantages`.
    """
    if any(r.get("advantage") is not None for r in rows):
        out: dict[str, float | None] = {}
        for r in rows:
            mask = np.asarray(r["action_mask"], dtype=bool)
            adv = r.get("advantage")
            out[r["traj_id"]] = (float(np.asarray(adv, dtype=np.float64)[mask].mean())
                                 if adv is not None and mask.any() else None)
        return out, "ledger"
    return group_advantages(rows), "recomputed"


def step_groups(run_dir: str | Path, step: int, filters: Filters) -> dict[str, Any]:
    """The groups of ``step`` with their trajectories' summaries, after ``filters``."""
    rows = _rows(run_dir, step)
    adv, _ = row_advantages(rows)
    summaries = [summarize_row(step, r) for r in rows]
    by_group: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        by_group.setdefault(s["group_id"], []).append(s)
    groups = []
    for gid, members in by_group.items():
        scored = [m for m in members if m["status"] not in ("infra_error", "unscored")]
        rate = sum(m["status"] == "correct" for m in scored) / len(scored) if scored else None
        kept = [{**m, "advantage": adv[m["traj_id"]], "group_success": rate} for m in members if filters.keep(m)]
        if kept:
            groups.append({"group_id": gid, "prompt_id": members[0]["prompt_id"], "success_rate": rate,
                           "n": len(members), "trajectories": kept})
    return {"step": step, "total": len(rows), "shown": sum(len(g["trajectories"]) for g in groups), "groups": groups}


def _f(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def trajectory_detail(run_dir: str | Path, step: int, traj_id: str, decode: Callable[[int], str]) -> dict[str, Any]:
    """Per-token view of one trajectory: text, role, the four log-prob identities, colour fields.

    Non-action tokens carry ``None`` for every policy quantity (they are not policy actions).
    ``fields`` lists the colour fields that have at least one value.
    """
    rows = _rows(run_dir, step)
    row = next((r for r in rows if r["traj_id"] == traj_id), None)
    if row is None:
        raise KeyError(f"no trajectory {traj_id!r} in step {step}")
    adv_by_row, adv_source = row_advantages(rows)
    adv = adv_by_row[traj_id]
    stored_adv = row.get("advantage")
    cur = current_logprob(row)
    tokens = []
    for i, tid in enumerate(row["token_ids"]):
        act = bool(row["action_mask"][i])
        beh = row["behavior_logprob"][i] if act else None
        old = row["old_logprob"][i] if act and row["old_logprob"] is not None else None
        ref = row["ref_logprob"][i] if act and row["ref_logprob"] is not None else None
        now = cur[i] if act and cur is not None else None
        tokens.append({
            "text": decode(int(tid)), "id": int(tid), "role": row["roles"][i], "action": act,
            "behavior": _f(beh), "old": _f(old), "ref": _f(ref), "current": _f(now),
            "version": int(row["behavior_version"][i]),
            "log_kappa": _f(old - beh) if old is not None and beh is not None else None,
            "log_rho": _f(now - old) if now is not None and old is not None else None,
            "surprisal": _f(-beh) if beh is not None else None,
            "ref_kl": _f(old - ref) if old is not None and ref is not None else None,
            "advantage": (_f(stored_adv[i]) if stored_adv is not None else _f(adv)) if act else None,
        })
    fields = {k: v for k, v in COLOUR_FIELDS.items() if any(t[k] is not None for t in tokens)}
    summary = summarize_row(step, row)
    return {"summary": {**summary, "advantage": adv, "advantage_source": adv_source},
            "meta": json.loads(row["meta"] or "{}"),
            "old_version": row["old_version"], "ref_version": row["ref_version"],
            "fields": fields, "missing_fields": {k: v for k, v in COLOUR_FIELDS.items() if k not in fields},
            "tokens": tokens}


def passed_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Ledger rows the training verifier marked ``correct`` or that carry a hidden verdict (``step`` added).

    Rows of every readable step; the rows with a hidden verdict let the audit name the run's
    hidden verifier even when nothing passed the training one."""
    led = open_ledger(run_dir)
    out: list[dict[str, Any]] = []
    names = ["traj_id", "group_id", "status", "reward_total", "verifier", "meta", "hidden_verifier", "hidden_status"]
    for step in led.steps():
        table = _step_columns(led, step, names)
        if table is not None:
            cols = table.to_pylist()
            out.extend({**r, "step": step} for r in cols if r["status"] == "correct" or r.get("hidden_status"))
    return out
