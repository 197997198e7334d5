"""``build_report``: everything ``posttrain report`` writes, computed from the run directory alone."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.diagnostics.heldout_breakdown_report import breakdown_rows
from posttrain.diagnostics.html import render_report_html
from posttrain.diagnostics.intervals_html import AccuracySummaryView
from posttrain.diagnostics.load import load_summaries, read_metrics
from posttrain.diagnostics.plots import plot_strata, plot_trends
from posttrain.diagnostics.second_verifier import disagreements
from posttrain.diagnostics.strata import all_strata
from posttrain.diagnostics.symptoms import all_symptoms
from posttrain.diagnostics.trends import all_trends
from posttrain.diagnostics.viewer_data import passed_rows


def heldout_report(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out curve in the shape of :func:`posttrain.evaluation.report.report_table`'s input."""
    curve = [{"step": int(m["step"]), "accuracy": float(m["heldout/accuracy"]),
              "reward": float(m.get("heldout/reward_mean") or 0.0)}
             for m in metrics if isinstance(m.get("heldout/accuracy"), (int, float))]
    return {"heldout_curve": curve}


def build_report(run_dir: str | Path, out_dir: str | Path | None = None,
                 heldout_intervals: Sequence[AccuracySummaryView] = ()) -> dict[str, Any]:
    """Compute strata, trends and symptoms of ``run_dir``; write JSON, PNGs and one HTML page.

    Output goes to ``out_dir`` (default ``<run_dir>/diagnostics``): ``diagnostics.json``,
    ``strata.png`` and ``trends.png`` (when matplotlib is installed) and ``report.html``, which also
    shows ``heldout_intervals`` (the held-out accuracy summaries with their bootstrap intervals that
    ``posttrain report`` computes; :mod:`posttrain.diagnostics.intervals_html`).
    Returns the JSON document, with ``files`` listing what was written.
    """
    run = Path(run_dir)
    rows, metrics = load_summaries(run), read_metrics(run)
    if not rows and not metrics:
        raise FileNotFoundError(f"{run}: the ledger has no complete step yet")
    out = Path(out_dir) if out_dir is not None else run / "diagnostics"
    out.mkdir(parents=True, exist_ok=True)
    strata, trends, symptoms = all_strata(rows), all_trends(rows, metrics), all_symptoms(metrics, rows)
    doc: dict[str, Any] = {
        "run_dir": str(run),
        "trajectories": len(rows),
        "steps": sorted({r["step"] for r in rows}),
        "strata": [dataclasses.asdict(t) for t in strata],
        "trends": {k: [list(p) for p in v] for k, v in trends.items()},
        "symptoms": [dataclasses.asdict(s) for s in symptoms],
        # Passed by the training verifier, failed by the run's eval.hidden_verifier (from the ledger).
        "hidden_verifier": disagreements(passed_rows(run), None),
        **heldout_report(metrics),
        # Per constraint family / tool calls per episode, first -> last evaluation (heldout_breakdown_report).
        "heldout_breakdown": [dataclasses.asdict(r) for r in breakdown_rows(metrics)],
    }
    files = [p for p in (plot_strata(strata, out / "strata.png"), plot_trends(trends, out / "trends.png")) if p]
    (out / "report.html").write_text(render_report_html(doc, [p.name for p in files], heldout_intervals))
    doc["files"] = [str(p) for p in [*files, out / "report.html", out / "diagnostics.json"]]
    (out / "diagnostics.json").write_text(json.dumps(doc, indent=2))
    return doc
