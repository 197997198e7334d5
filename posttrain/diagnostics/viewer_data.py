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
import pyarrow.compute as pc
import pyarrow.parquet as pq

from posttrain.diagnostics.load import current_logprob, open_ledger, summarize_row
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
        with pq.ParquetFile(path) as f:  # one open for the schema and the read
            have = set(f.schema_arrow.names)
            return f.read(columns=[n for n in names if n in have])
    except (OSError, pa.ArrowInvalid):
        return None


# step file -> ((mtime_ns, size), its list_steps entry). Ledger files are written once (atomically), so a
# step whose file is unchanged is not read again: refreshing the steps list of a long run costs a stat per step.
_STEP_CACHE: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}


def _step_entry(led: Ledger, step: int) -> dict[str, Any] | None:
    """The :func:`list_steps` entry of ``step`` (``None`` when its file is gone or incomplete)."""
    path = led.traj_dir / f"step_{step:06d}.parquet"
    try:
        st = path.stat()
    except OSError:
        return None
    key, stamp = str(path.resolve()), (st.st_mtime_ns, st.st_size)
    hit = _STEP_CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    table = _step_columns(led, step, ["status", "reward_total"])
    if table is None:
        return None
    status = pc.fill_null(table.column("status"), "unscored") if "status" in table.column_names else None
    counts = ({} if status is None else
              {str(c["values"]): int(c["counts"]) for c in pc.value_counts(status).to_pylist()})
    mean = pc.mean(table.column("reward_total")).as_py() if "reward_total" in table.column_names else None
    entry = {"step": step, "n": table.num_rows, "reward_mean": mean, "status": dict(sorted(counts.items()))}
    _STEP_CACHE[key] = (stamp, entry)
    return entry


def list_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable step: trajectory count, mean reward and status counts.

    Reads two scalar columns per step (never the token arrays), counts them in Arrow and remembers the
    answer of an unchanged file, so a ledger of thousands of steps stays one small document."""
    led = open_ledger(run_dir)
    return [{**e} for step in led.steps() if (e := _step_entry(led, step)) is not None]


def _step_rows(led: Ledger, step: int, columns: list[str] | None, key: str, values: list[str]
               ) -> list[dict[str, Any]]:
    """The rows of ``step`` whose ``key`` is one of ``values`` (a filtered read: the other rows' token arrays
    are not turned into Python objects); ``FileNotFoundError`` when the file is gone or incomplete."""
    path = led.traj_dir / f"step_{step:06d}.parquet"
    try:
        rows: list[dict[str, Any]] = pq.read_table(path, columns=columns,
                                                   filters=pc.field(key).isin(values)).to_pylist()
    except (OSError, pa.ArrowInvalid):
        raise FileNotFoundError(f"step {step} is not (yet) a complete file in the ledger of {led.root}") from None
    return rows


def _one_row(led: Ledger, step: int, traj_id: str) -> dict[str, Any]:
    """Every column of trajectory ``traj_id`` of ``step`` (``KeyError`` when there is none)."""
    rows = _step_rows(led, step, None, "traj_id", [traj_id])
    if not rows:
        raise KeyError(f"no trajectory {traj_id!r} in step {step}")
    return rows[0]


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


# The scalar columns behind the group list; ``action_mask`` only where ``num_actions`` is missing (old ledgers).
_GROUP_COLUMNS = ["traj_id", "group_id", "prompt_id", "status", "finish", "reward_total", "policy_lag", "verifier",
                  "num_actions", "hidden_status", "hidden_verifier"]
DEFAULT_PAGE = 50  # groups per /api/step page
MAX_PAGE = 1000


def _lengths(led: Ledger, step: int, table: pa.Table) -> np.ndarray:
    """Action-token count of each row: the scalar ``num_actions`` column, else summed from ``action_mask``."""
    if "num_actions" in table.column_names and table.column("num_actions").null_count == 0:
        return table.column("num_actions").to_numpy().astype(np.int64)
    masks = _step_columns(led, step, ["action_mask"])
    if masks is None or "action_mask" not in masks.column_names:
        raise FileNotFoundError(f"step {step} has no action_mask column")
    return np.array([sum(m or ()) for m in masks.column("action_mask").to_pylist()], dtype=np.int64)


def _numbers(table: pa.Table, name: str) -> np.ndarray:
    """A nullable numeric column as float64 with NaN for null (or all NaN when the column is absent)."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    return np.asarray(table.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


def _keep_mask(f: Filters, status: np.ndarray, lag: np.ndarray, reward: np.ndarray, length: np.ndarray
               ) -> np.ndarray:
    """:meth:`Filters.keep` over whole columns (NaN: no value, which fails any bound on that field)."""
    keep = np.ones(len(status), dtype=bool)
    if f.status:
        keep &= np.isin(status, sorted(f.status))
    for v, lo, hi in ((lag, f.lag_min, f.lag_max), (reward, f.reward_min, f.reward_max),
                      (length.astype(np.float64), f.len_min, f.len_max)):
        if lo is not None:
            keep &= ~np.isnan(v) & (v >= lo)
        if hi is not None:
            keep &= ~np.isnan(v) & (v <= hi)
    return keep


def _advantage_source(led: Ledger, step: int) -> bool:
    """Whether ``step`` stores per-token advantages (any non-null row of the ``advantage`` column)."""
    adv = _step_columns(led, step, ["advantage"])
    return adv is not None and "advantage" in adv.column_names and adv.column("advantage").null_count < adv.num_rows


def _page_advantages(led: Ledger, step: int, ids: list[str], rewards: dict[str, list[tuple[str, float | None]]]
                     ) -> tuple[dict[str, float | None], str]:
    """traj_id -> advantage of the trajectories ``ids`` (see :func:`row_advantages`) and its source.

    Token arrays are read for these rows only (a filtered read); ``rewards`` holds each of their groups'
    ``(traj_id, reward)`` pairs, for the recomputed advantage of a ledger that stores none."""
    if ids and _advantage_source(led, step):
        rows = _step_rows(led, step, ["traj_id", "action_mask", "advantage"], "traj_id", ids)
        return {r["traj_id"]: _mean_advantage(r) for r in rows}, "ledger"
    flat = [{"traj_id": t, "group_id": g, "reward_total": r} for g, members in rewards.items() for t, r in members]
    adv = group_advantages(flat)
    return {i: adv.get(i) for i in ids}, "recomputed"


def _mean_advantage(row: dict[str, Any]) -> float | None:
    """The mean over action tokens of a row's stored per-token advantage (``None`` without one)."""
    mask = np.asarray(row["action_mask"], dtype=bool)
    adv = row.get("advantage")
    return float(np.asarray(adv, dtype=np.float64)[mask].mean()) if adv is not None and mask.any() else None


def step_groups(run_dir: str | Path, step: int, filters: Filters, offset: int = 0,
                limit: int | None = None) -> dict[str, Any]:
    """The groups of ``step`` with their trajectories' summaries, after ``filters``, one page at a time.

    Filters apply before paging: ``shown`` counts every trajectory that passes them and ``groups_total``
    every group with at least one; ``groups`` holds at most ``limit`` of those groups (all with ``None``)
    starting at ``offset`` in ledger order, and ``next_offset`` is where the next page starts (``None`` after
    the last). Only scalar columns are read for the whole step; token arrays (the per-token advantage)
    only for the page's trajectories. A trajectory's summary: ``traj_id``, ``group_id``, ``prompt_id``,
    ``status``, ``finish``, ``reward``, ``length`` (action tokens), ``lag``, ``verifier``, the hidden
    verdict, ``advantage`` (as in :func:`row_advantages`) and ``group_success``.
    """
    if offset < 0:
        raise ValueError(f"offset={offset} must be >= 0")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1")
    led = open_ledger(run_dir)
    table = _step_columns(led, step, _GROUP_COLUMNS)
    if table is None or "group_id" not in table.column_names:
        raise FileNotFoundError(f"step {step} is not (yet) a complete file in the ledger of {run_dir}")
    n = table.num_rows
    codes = np.asarray(table.column("group_id").combine_chunks().dictionary_encode().indices.to_numpy(),
                       dtype=np.int64)  # groups numbered in order of first appearance
    status = np.asarray(pc.fill_null(table.column("status"), "unscored").to_numpy(zero_copy_only=False), dtype=object)
    lag, reward, length = _numbers(table, "policy_lag"), _numbers(table, "reward_total"), _lengths(led, step, table)
    n_groups = int(codes.max()) + 1 if n else 0
    scored = ~np.isin(status, ["infra_error", "unscored"])
    n_scored = np.bincount(codes, weights=scored, minlength=n_groups)
    n_correct = np.bincount(codes, weights=scored & (status == "correct"), minlength=n_groups)
    size = np.bincount(codes, minlength=n_groups)
    keep = _keep_mask(filters, status, lag, reward, length)
    kept_groups = np.unique(codes[keep])
    page = kept_groups[offset:] if limit is None else kept_groups[offset:offset + limit]
    in_page = np.flatnonzero(np.isin(codes, page))
    rows = table.take(pa.array(in_page, type=pa.int64())).to_pylist()
    rewards: dict[str, list[tuple[str, float | None]]] = {}
    for r in rows:
        rewards.setdefault(r["group_id"], []).append((r["traj_id"], r["reward_total"]))
    page_rows = [(i, r) for i, r in zip(in_page.tolist(), rows, strict=True) if keep[i]]
    adv, _ = _page_advantages(led, step, [r["traj_id"] for _, r in page_rows], rewards)
    groups: dict[int, dict[str, Any]] = {}
    for i, r in page_rows:
        c = int(codes[i])
        rate = float(n_correct[c] / n_scored[c]) if n_scored[c] else None
        g = groups.setdefault(c, {"group_id": r["group_id"], "prompt_id": r["prompt_id"], "success_rate": rate,
                                  "n": int(size[c]), "trajectories": []})
        g["trajectories"].append({
            "step": step, "traj_id": r["traj_id"], "group_id": r["group_id"], "prompt_id": r["prompt_id"],
            "status": r["status"] or "unscored", "finish": r.get("finish"), "reward": r["reward_total"],
            "length": int(length[i]), "lag": r.get("policy_lag"), "verifier": r.get("verifier"),
            "hidden_status": r.get("hidden_status"), "hidden_verifier": r.get("hidden_verifier"),
            "advantage": adv[r["traj_id"]], "group_success": rate})
    end = offset + len(page)
    return {"step": step, "total": n, "shown": int(keep.sum()), "groups_total": len(kept_groups),
            "offset": offset, "limit": limit, "next_offset": end if end < len(kept_groups) else None,
            "groups": [groups[int(c)] for c in page]}


def _f(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def trajectory_detail(run_dir: str | Path, step: int, traj_id: str, decode: Callable[[int], str]) -> dict[str, Any]:
    """Per-token view of one trajectory: text, role, the four log-prob identities, colour fields.

    Non-action tokens carry ``None`` for every policy quantity (they are not policy actions).
    ``fields`` lists the colour fields that have at least one value.
    """
    led = open_ledger(run_dir)
    row = _one_row(led, step, traj_id)
    if _advantage_source(led, step):
        adv, adv_source = _mean_advantage(row), "ledger"
    else:
        group = _step_rows(led, step, ["traj_id", "group_id", "reward_total"], "group_id", [row["group_id"]])
        adv, adv_source = group_advantages(group)[traj_id], "recomputed"
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
            # filtered in Arrow first: only the few passing rows become Python objects
            want = pc.equal(table.column("status"), "correct")
            if "hidden_status" in table.column_names:
                hidden = table.column("hidden_status")
                want = pc.or_kleene(want, pc.and_(pc.is_valid(hidden), pc.not_equal(hidden, "")))
            cols = table.filter(pc.fill_null(want, False)).to_pylist()
            out.extend({**r, "step": step} for r in cols)
    return out
