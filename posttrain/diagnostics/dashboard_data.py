"""The JSON documents behind the run dashboard of ``posttrain view``: curves, symptoms, checkpoints.

One :class:`RunData` per run directory follows ``metrics.jsonl`` as it grows: each refresh reads
only the bytes appended since the last one, and only complete lines (a torn last line, the run
mid-write, waits for its newline; a line that does not parse is skipped and counted). A line for a
step already read (a resumed run re-logging steps, a guard's ``stopped`` line) updates that step as
``posttrain report`` reads it (the later line wins) and bumps :attr:`RunData.gen`, which tells the
page to reload the curves instead of appending to them.

Curves (:data:`PANELS`) hold only the series the run logged, every trainer's own metrics included;
numeric keys no panel names are offered one at a time (``other``). Each series has three x
coordinates: the step, the generated tokens so far (cumulative ``tokens/generated``, as ``posttrain
compare`` counts the budget) and the wall seconds so far (cumulative ``time/step_s``, or
``step_seconds`` for the preference / reward-model trainers). A series longer than
:data:`MAX_POINTS` is downsampled by largest-triangle-three-buckets (Steinarsson 2013), which keeps
real points (the first, the last and the visual extremes), so a point still names its step.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posttrain.diagnostics.heldout_outcomes import OUTCOMES_FILE, SetOutcomes, read_outcomes
from posttrain.diagnostics.intervals import accuracy_interval
from posttrain.diagnostics.load import _fill_group_success, open_ledger, read_step_table, summarize_row
from posttrain.diagnostics.runs import checkpoints, read_config, recipe_axes, run_status
from posttrain.diagnostics.symptoms import Symptom, all_symptoms

MAX_POINTS = 1000
"""Points per series sent to the page at most; longer series are downsampled (LTTB)."""

SFT_LOSS = "sft/loss"
"""The SFT warm-up's losses (``sft_losses.json``), one per SFT step: a panel of its own, x = SFT step."""

TOKENS_PER_S = "derived/tokens_per_s"
"""A derived series: ``tokens/generated / time/step_s`` of each step."""

_HELDOUT_ACC = re.compile(r"^(heldout[a-z0-9_]*)/(accuracy|pair_accuracy)$")


@dataclasses.dataclass(frozen=True)
class Panel:
    """One chart: ``traces`` are ``(metric key, label, axis)`` with axis ``y`` or ``y2`` (right), ``log``
    a log-scaled left axis; ``symptoms`` the symptom names marked on it."""

    id: str
    title: str
    traces: tuple[tuple[str, str, str], ...]
    log: bool = False
    symptoms: tuple[str, ...] = ()


PANELS: tuple[Panel, ...] = (
    Panel(
        "reward",
        "training reward",
        (
            ("reward/mean", "reward mean", "y"),
            ("train/accuracy", "train accuracy", "y"),
            ("pair_accuracy", "pair accuracy (train)", "y"),
            ("margin", "margin (train)", "y2"),
        ),
        symptoms=("stable, then sudden collapse",),
    ),
    Panel("heldout", "held-out accuracy (95% bootstrap band)", (), symptoms=("reward up, held-out down",)),
    Panel(
        "kl",
        "KL and beta",
        (
            ("kl", "KL (learner)", "y"),
            ("kl/ref_mean", "KL to reference (data)", "y"),
            ("distill/reverse_kl_mean", "reverse KL to teacher", "y"),
            ("kl_coef", "beta (kl_coef)", "y2"),
        ),
    ),
    Panel("entropy", "policy entropy", (("entropy", "entropy", "y"),), symptoms=("entropy collapse",)),
    Panel(
        "clip",
        "clip fractions",
        (
            ("clip_frac_low", "clip low", "y"),
            ("clip_frac_high", "clip high", "y"),
            ("value_clip_frac", "value clip", "y"),
            ("correction/truncated", "correction truncated", "y"),
        ),
    ),
    Panel(
        "ratio",
        "importance ratio",
        (("ratio_mean", "ratio mean", "y"), ("ratio_min", "ratio min", "y"), ("ratio_max", "ratio max", "y")),
    ),
    Panel(
        "logkappa",
        "|log kappa|: behaviour vs learner (log scale)",
        (
            ("logkappa_abs_mean", "|log kappa| mean", "y"),
            ("logkappa/p99", "|log kappa| p99", "y"),
            ("logkappa_abs_max", "|log kappa| max", "y"),
            ("lag/logratio_abs_mean", "|log ratio| of lagged", "y"),
        ),
        log=True,
    ),
    Panel(
        "length",
        "response length and truncation",
        (
            ("length/mean", "length mean", "y"),
            ("length/p95", "length p95", "y"),
            ("finish/truncated_rate", "truncation rate", "y2"),
        ),
        symptoms=("response length drift",),
    ),
    Panel(
        "staleness",
        "staleness / lag",
        (
            ("lag/mean", "lag mean", "y"),
            ("lag/max", "lag max", "y"),
            ("version_span/mean", "version span", "y"),
            ("staleness/accepted_token_frac", "accepted token fraction", "y2"),
        ),
        symptoms=("async: throughput up, efficiency down",),
    ),
    Panel(
        "loss",
        "loss and gradient norm",
        (
            ("loss", "loss", "y"),
            ("pg_loss", "policy loss", "y"),
            ("value_loss", "value loss", "y"),
            ("grad_norm", "grad norm", "y2"),
        ),
        symptoms=("loss often zero",),
    ),
    Panel("throughput", "generated tokens per second", ((TOKENS_PER_S, "tokens / s", "y"),)),
    Panel(
        "time",
        "step time split (s)",
        (
            ("time/rollout_s", "rollout", "y"),
            ("time/reward_s", "reward", "y"),
            ("time/learner_s", "learner", "y"),
            ("time/learner_wait_s", "learner wait", "y"),
            ("time/quiesce_wait_s", "wait for the next call", "y"),
            ("time/weight_sync_s", "weight sync", "y"),
            ("time/eval_s", "evaluation", "y"),
            ("time/step_s", "whole step", "y"),
            ("step_seconds", "whole step", "y"),
        ),
    ),
)
"""The run page's charts, in page order; a panel shows only the traces the run logged."""

# Keys no chart should offer: bookkeeping, not a curve.
_NOT_CURVES = frozenset({"step", "version", "optimizer_steps"})


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def lttb(n_points: int, xs: Sequence[float], ys: Sequence[float]) -> list[int]:
    """Indices of ``n_points`` of ``(xs, ys)`` chosen by largest-triangle-three-buckets (Steinarsson 2013),
    first and last included; every index when there are no more than ``n_points``."""
    n = len(xs)
    if n <= n_points or n_points < 3:
        return list(range(n))
    out = [0]
    every = (n - 2) / (n_points - 2)
    a = 0
    for i in range(n_points - 2):
        lo, hi = int(i * every) + 1, int((i + 1) * every) + 1
        nlo, nhi = hi, min(int((i + 2) * every) + 1, n)
        avg_x = sum(xs[nlo:nhi]) / (nhi - nlo)
        avg_y = sum(ys[nlo:nhi]) / (nhi - nlo)
        best, best_area = lo, -1.0
        for j in range(lo, hi):
            area = abs((xs[a] - avg_x) * (ys[j] - ys[a]) - (xs[a] - xs[j]) * (avg_y - ys[a]))
            if area > best_area:
                best, best_area = j, area
        out.append(best)
        a = best
    out.append(n - 1)
    return out


class RunData:
    """What the dashboard shows of one run directory, refreshed from its files on each call (thread-safe)."""

    def __init__(self, run: Path) -> None:
        self.run = Path(run)
        self.path = self.run / "metrics.jsonl"
        self._lock = threading.Lock()
        self._symptoms_lock = threading.Lock()  # one symptom scan at a time (it fills the ledger cache)
        self._reset()
        self._outcomes_key: tuple[int, int] | None = None
        self._outcomes: dict[str, dict[int, SetOutcomes]] = {}
        self._intervals: dict[tuple[str, int], tuple[float, float, float, int]] = {}
        self._symptoms_key: tuple[int, int, int] | None = None
        self._symptoms: list[dict[str, Any]] = []

    def _reset(self) -> None:
        self.gen = getattr(self, "gen", 0) + 1
        self._ino: int | None = None
        self._offset = 0
        self.by_step: dict[int, dict[str, Any]] = {}
        self.skipped = 0
        self._rows: list[dict[str, Any]] = []
        self._steps: list[int] = []
        self._x: dict[int, tuple[float, float]] = {}
        self._keys: set[str] = set()
        self._axes = {"step": True, "tokens": False, "wall": False}
        self._ledger: dict[int, tuple[tuple[int, int], list[dict[str, Any]]]] = {}

    def refresh(self) -> None:
        """Read what ``metrics.jsonl`` gained since the last call (complete lines only)."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except OSError:
                if self._ino is not None:
                    self._reset()
                return
            if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
                self._reset()  # replaced or truncated: read again from the start
            self._ino = st.st_ino
            if st.st_size == self._offset:
                return
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read(st.st_size - self._offset)
            end = data.rfind(b"\n")
            if end < 0:
                return  # no complete line yet
            self._offset += end + 1
            last = max(self.by_step, default=-1)
            changed = False
            for line in data[:end].split(b"\n"):
                if not line.strip():
                    continue
                try:
                    m = json.loads(line)
                    step = int(m["step"])
                except (ValueError, KeyError, TypeError):
                    self.skipped += 1
                    continue
                if step <= last:
                    changed = True  # an earlier step logged again: the page reloads
                self.by_step.setdefault(step, {}).update(m)
                self._keys.update(k for k, v in m.items() if _num(v) is not None)
                last = max(last, step)
            if changed:
                self.gen += 1
            self._rebuild()

    def _rebuild(self) -> None:
        self._steps = sorted(self.by_step)
        self._rows = [self.by_step[s] for s in self._steps]
        tok = sec = 0.0
        self._x = {}
        for s, m in zip(self._steps, self._rows, strict=True):
            tok += _num(m.get("tokens/generated")) or 0.0
            sec += _num(m.get("time/step_s")) or _num(m.get("step_seconds")) or 0.0
            self._x[s] = (tok, sec)
        self._axes = {"step": True, "tokens": tok > 0, "wall": sec > 0}

    def rows(self) -> list[dict[str, Any]]:
        """The per-step metrics read so far, in step order (NaN as None, as
        :func:`~posttrain.diagnostics.load.read_metrics` gives them)."""
        self.refresh()
        return [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}
            for m in self._rows
        ]

    # --- curves -------------------------------------------------------------------------------------------
    def _value(self, m: dict[str, Any], key: str) -> float | None:
        if key == TOKENS_PER_S:
            tok, sec = (
                _num(m.get("tokens/generated")),
                _num(m.get("time/step_s")) or _num(m.get("step_seconds")),
            )
            return tok / sec if tok is not None and sec else None
        return _num(m.get(key))

    def keys(self) -> list[str]:
        """Every numeric key some step logged (plus the derived tokens-per-second), sorted."""
        found = self._keys - _NOT_CURVES
        if "tokens/generated" in found and ({"time/step_s", "step_seconds"} & found):
            found.add(TOKENS_PER_S)
        return sorted(found)

    def panels(self) -> list[dict[str, Any]]:
        """The panels of :data:`PANELS` the run has data for, each with the traces it logged."""
        have = set(self.keys())
        out = []
        for p in PANELS:
            traces = [t for t in p.traces if t[0] in have]
            if p.id == "heldout":
                traces = [
                    (k, k.rsplit("/", 1)[0] + (" (pairs)" if k.endswith("pair_accuracy") else ""), "y")
                    for k in sorted(have)
                    if _HELDOUT_ACC.match(k)
                ]
            if traces:
                out.append(
                    {
                        "id": p.id,
                        "title": p.title,
                        "log": p.log,
                        "symptoms": list(p.symptoms),
                        "traces": [{"key": k, "label": lab, "axis": ax} for k, lab, ax in traces],
                    }
                )
        return out

    def _series(self, key: str, after: int | None, full: bool = False) -> dict[str, list[float]]:
        step: list[float] = []
        tok: list[float] = []
        wall: list[float] = []
        y: list[float] = []
        start = 0 if after is None else bisect.bisect_right(self._steps, after)
        for s, m in zip(self._steps[start:], self._rows[start:], strict=True):
            v = self._value(m, key)
            if v is not None:
                step.append(s)
                tok.append(self._x[s][0])
                wall.append(self._x[s][1])
                y.append(v)
        if after is None and not full and len(step) > MAX_POINTS:
            keep = lttb(MAX_POINTS, step, y)
            step, tok, wall, y = ([a[i] for i in keep] for a in (step, tok, wall, y))
        return {"step": step, "tokens": tok, "wall": wall, "y": y}

    def _interval(self, name: str, step: int) -> tuple[float, float, float, int] | None:
        o = self._outcomes.get(name, {}).get(step)
        if o is None:
            return None
        if (name, step) not in self._intervals:
            iv = accuracy_interval(o.valid, o.correct)
            self._intervals[(name, step)] = (iv.estimate, iv.low, iv.high, iv.n)
        return self._intervals[(name, step)]

    def _refresh_outcomes(self) -> None:
        try:
            st = os.stat(self.run / OUTCOMES_FILE)
            key = (st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key != self._outcomes_key:
            self._outcomes_key = key
            self._outcomes = read_outcomes(self.run) if key else {}
            self._intervals = {}

    def _band(self, key: str, after: int | None) -> dict[str, list[float]] | None:
        match = _HELDOUT_ACC.match(key)
        if not match or match.group(2) != "accuracy":
            return None
        name = match.group(1)
        out: dict[str, list[float]] = {"step": [], "tokens": [], "wall": [], "low": [], "high": []}
        for s in sorted(self._outcomes.get(name, {})):
            if (after is not None and s <= after) or s not in self._x:
                continue
            iv = self._interval(name, s)
            if iv is None or not math.isfinite(iv[1]):
                continue
            for k, v in (
                ("step", s),
                ("tokens", self._x[s][0]),
                ("wall", self._x[s][1]),
                ("low", iv[1]),
                ("high", iv[2]),
            ):
                out[k].append(v)
        return out if out["step"] else None

    def curves(
        self, after: int | None = None, gen: int | None = None, keys: Sequence[str] = (), full: bool = False
    ) -> dict[str, Any]:
        """The curves document: every panel's series plus those of ``keys``, complete, or only the points
        after step ``after`` when ``gen`` is still :attr:`gen` (else complete, with ``"reset": true``).
        ``full``: every point, not downsampled to :data:`MAX_POINTS`."""
        self.refresh()
        with self._lock:
            self._refresh_outcomes()
            reset = after is None or gen != self.gen
            since = None if reset else after
            panels = self.panels()
            want = [t["key"] for p in panels for t in p["traces"]] + [k for k in keys if k]
            have = set(self.keys())
            series: dict[str, dict[str, list[float]]] = {}
            bands: dict[str, dict[str, list[float]]] = {}
            for k in want:
                if k not in have:
                    continue
                series[k] = self._series(k, since, full)
                if (b := self._band(k, since)) is not None:
                    bands[k] = b
            if reset and (sft := self._sft_losses()):
                panels.append(
                    {
                        "id": "sft",
                        "title": "SFT warm-up loss",
                        "log": False,
                        "symptoms": [],
                        "xfixed": "SFT step",
                        "traces": [{"key": SFT_LOSS, "label": "SFT loss", "axis": "y"}],
                    }
                )
                steps = [float(i) for i in range(1, len(sft) + 1)]
                series[SFT_LOSS] = {"step": steps, "tokens": steps, "wall": steps, "y": sft}
            elif not reset and (self.run / "sft_losses.json").is_file():
                panels.append(
                    {
                        "id": "sft",
                        "title": "SFT warm-up loss",
                        "log": False,
                        "symptoms": [],
                        "xfixed": "SFT step",
                        "traces": [{"key": SFT_LOSS, "label": "SFT loss", "axis": "y"}],
                    }
                )
            used = {t["key"] for p in panels for t in p["traces"]}
            return {
                "gen": self.gen,
                "reset": reset,
                "last_step": max(self.by_step, default=None),
                "n_steps": len(self._rows),
                "skipped_lines": self.skipped,
                "panels": panels,
                "other_keys": [k for k in sorted(have) if k not in used],
                "axes": dict(self._axes),
                "series": series,
                "bands": bands,
                "rejected": self._rejected(since),
            }

    def _rejected(self, after: int | None) -> list[dict[str, Any]]:
        """The held-out evaluations whose revision was rejected (after step ``after``): the held-out chart
        marks them."""
        start = 0 if after is None else bisect.bisect_right(self._steps, after)
        rows = zip(self._steps[start:], self._rows[start:], strict=True)
        return [{"step": s, "tokens": self._x[s][0], "wall": self._x[s][1], "y": _num(m["heldout/accuracy"]),
                 "reason": m.get("revision_reason") or ""}
                for s, m in rows
                if m.get("revision") == "rejected" and _num(m.get("heldout/accuracy")) is not None]

    def _sft_losses(self) -> list[float]:
        try:
            data = json.loads((self.run / "sft_losses.json").read_text())
        except (OSError, ValueError):
            return []
        return [float(v) for v in data if _num(v) is not None] if isinstance(data, list) else []

    # --- symptoms -----------------------------------------------------------------------------------------
    def symptoms(self) -> list[dict[str, Any]]:
        """``posttrain report``'s symptom rules on this run, each with the step it first flags at.

        The verdict and evidence are the report's (metrics and ledger); ``step`` is the first step at
        which the rule, run on the metrics up to that step, flags (searched on a grid of 64 prefixes,
        then refined step by step; the rules' flags read the metrics only), with its tokens / wall x.
        """
        with self._symptoms_lock:
            return self._symptoms_now()

    def _symptoms_now(self) -> list[dict[str, Any]]:
        rows = self.rows()
        led = self.run / "ledger" / "trajectories"
        n_files = sum(1 for _ in led.glob("step_*.parquet")) if led.is_dir() else 0
        key = (self.gen, len(rows), n_files)
        if key == self._symptoms_key:
            return self._symptoms
        summaries = self._summaries() if n_files else []
        out = []
        for i, s in enumerate(all_symptoms(rows, summaries)):
            d = dataclasses.asdict(s)
            d["step"] = d["tokens"] = d["wall"] = None
            if s.flagged:
                at = _first_flag(rows, functools.partial(_rule, i))
                if at is not None:
                    step = int(rows[at]["step"])
                    d.update(
                        step=step,
                        tokens=self._x.get(step, (0.0, 0.0))[0],
                        wall=self._x.get(step, (0.0, 0.0))[1],
                    )
            out.append(d)
        self._symptoms_key, self._symptoms = key, out
        return out

    def _summaries(self) -> list[dict[str, Any]]:
        """The ledger's trajectory summaries (as :func:`~posttrain.diagnostics.load.load_summaries`),
        each step file read once (again only when its size or time changes)."""
        try:
            led = open_ledger(self.run)
        except FileNotFoundError:
            return []
        out: list[dict[str, Any]] = []
        seen = set()
        for step in led.steps():
            path = led.traj_dir / f"step_{step:06d}.parquet"
            try:
                st = path.stat()
            except OSError:
                continue
            key = (st.st_size, st.st_mtime_ns)
            if step not in self._ledger or self._ledger[step][0] != key:
                table = read_step_table(led, step)
                if table is None:
                    continue  # mid-write: read on a later call
                self._ledger[step] = (key, [summarize_row(step, r) for r in table.to_pylist()])
            seen.add(step)
            out.extend(dict(r) for r in self._ledger[step][1])
        for step in set(self._ledger) - seen:
            del self._ledger[step]
        _fill_group_success(out)
        return out

    # --- the rest of the run ---------------------------------------------------------------------------
    def summary(self, rid: str) -> dict[str, Any]:
        """The runs-page row: status, recipe, trainer, steps, the last held-out figure with its interval."""
        rows = self.rows()
        cfg = read_config(self.run)
        status, why = run_status(self.run, rows, cfg)
        with self._lock:
            self._refresh_outcomes()
            heldout = self._headline(rows)
        try:
            mtime = max(os.stat(p).st_mtime for p in (self.run, self.path) if p.exists())
        except OSError:
            mtime = None
        return {
            "id": rid,
            "path": str(self.run),
            "name": cfg.get("name"),
            "trainer": cfg.get("trainer", "rl") if cfg else None,
            "status": status,
            "status_why": why,
            "last_step": int(rows[-1]["step"]) if rows else None,
            "steps": cfg.get("steps"),
            "axes": recipe_axes(cfg),
            "heldout": heldout,
            "updated": mtime,
            "skipped_lines": self.skipped,
        }

    def _headline(self, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        keys = sorted(
            {k for m in rows for k in m if _HELDOUT_ACC.match(k)},
            key=lambda k: (k != "heldout/accuracy", k.endswith("pair_accuracy"), k),
        )
        if not keys:
            return None
        k = keys[0]
        last = next((m for m in reversed(rows) if _num(m.get(k)) is not None), None)
        if last is None:
            return None
        name, step = k.split("/")[0], int(last["step"])
        iv = self._interval(name, step) if k.endswith("/accuracy") else None
        return {
            "key": k,
            "step": step,
            "value": _num(last[k]),
            "low": iv[1] if iv and math.isfinite(iv[1]) else None,
            "high": iv[2] if iv and math.isfinite(iv[2]) else None,
            "n": iv[3] if iv else None,
        }

    def checkpoints(self) -> dict[str, Any]:
        """The run's checkpoints with the revision judged at their step, and every promote / reject
        decision."""
        rows = self.rows()
        decisions = [
            {
                "step": int(m["step"]),
                "decision": m["revision"],
                "reason": m.get("revision_reason") or "",
                "heldout": _num(m.get("heldout/accuracy")),
            }
            for m in rows
            if m.get("revision") in ("promoted", "rejected")
        ]
        by_step = {d["step"]: d for d in decisions}
        promoted = [d["step"] for d in decisions if d["decision"] == "promoted"]
        ckpts = [
            {
                **c,
                "decision": by_step.get(c["step"], {}).get("decision"),
                "promoted_latest": bool(promoted) and c["step"] == promoted[-1],
            }
            for c in checkpoints(self.run)
        ]
        return {"checkpoints": ckpts, "decisions": decisions}

    def config(self) -> dict[str, Any]:
        """``config.yaml`` as written, the six axes, and the configs a forced resume kept."""
        path = self.run / "config.yaml"
        try:
            text = path.read_text()
        except OSError:
            text = None
        return {
            "path": str(path),
            "text": text,
            "axes": recipe_axes(read_config(self.run)),
            "replaced": sorted(p.name for p in self.run.glob("config.step_*.yaml")),
        }


def _rule(i: int, rows: list[dict[str, Any]]) -> Symptom:
    """Symptom ``i`` of :func:`~posttrain.diagnostics.symptoms.all_symptoms` on ``rows`` alone (no ledger)."""
    return all_symptoms(rows, [])[i]


def _first_flag(rows: list[dict[str, Any]], rule: Callable[[list[dict[str, Any]]], Symptom]) -> int | None:
    """Index of the first row whose prefix ``rows[:i+1]`` the rule flags (grid of 64, then refined)."""
    n = len(rows)
    grid = sorted({max(1, round(n * j / 64)) for j in range(1, 65)})
    prev = 0
    for k in grid:
        if rule(rows[:k]).flagged:
            for j in range(prev + 1, k + 1):
                if rule(rows[:j]).flagged:
                    return j - 1
            return k - 1
        prev = k
    return None
