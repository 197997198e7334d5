"""The report as one self-contained HTML page (PNG plots referenced next to it)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from posttrain.diagnostics.intervals_html import AccuracySummaryView, intervals_section


def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: ``-`` for missing, fixed decimals for floats."""
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else escape(str(v))


def table_html(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    """A plain HTML table; cells go through :func:`fmt` (escaped)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}th{background:#f3f3f3}
td:first-child{text-align:left}.flag{background:#fde2e2}.note{color:#777;font-style:italic}img{max-width:100%}
tr.rise td{border-bottom:2px solid #999;font-weight:bold}"""


def render_report_html(doc: dict[str, Any], images: Sequence[str],
                       intervals: Sequence[AccuracySummaryView] = ()) -> str:
    """The report page of a :func:`~posttrain.diagnostics.build.build_report` document; ``intervals`` (the
    held-out accuracy summaries of ``posttrain report``) add their section after the held-out curve
    (:func:`~posttrain.diagnostics.intervals_html.intervals_section`)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>posttrain report</title><style>{_CSS}</style>"
             f"</head><body><h1>Run report: {escape(doc['run_dir'])}</h1>",
             f"<p>{doc['trajectories']} trajectories over {len(doc['steps'])} ledger steps.</p>",
             "<h2>Failure symptoms</h2>"]
    rows = "".join(
        f"<tr class='{'flag' if s['flagged'] else ''}'><td>{escape(s['name'])}</td>"
        f"<td>{'FLAGGED' if s['flagged'] else 'no'}</td><td>{escape(s['evidence'])}</td><td>{escape(s['check'])}</td></tr>"
        for s in doc["symptoms"])
    parts.append(f"<table><tr><th>symptom</th><th>flagged</th><th>evidence</th><th>check first</th></tr>{rows}</table>")
    hv = doc.get("hidden_verifier")
    if hv is not None:
        parts.append("<h2>Passed by the training verifier, failed by the hidden one</h2>"
                     f"<p class='note'>{escape(hv['explanation'])}</p>")
        if hv["items"]:
            parts.append(table_html(
                ["step", "trajectory", "reward", "response", "reference", "training verifier", "hidden verdict"],
                [[i["step"], i["traj_id"], i["reward"], i["response"], i["reference"], i["train_verifier"],
                  i["second_status"]] for i in hv["items"]], cls="hidden"))
    if doc["heldout_curve"]:
        parts.append("<h2>Held-out accuracy</h2>" + table_html(
            ["step", "accuracy", "reward"], [[c["step"], c["accuracy"], c["reward"]] for c in doc["heldout_curve"]]))
    if intervals:
        parts.append(intervals_section(intervals))
    if doc.get("heldout_breakdown"):
        parts.append("<h2>Held-out breakdown: constraint families, tool calls per episode</h2>" + table_html(
            ["metric", "first step", "first", "last step", "last", "change"],
            [[r["key"], r["first_step"], r["first"], r["last_step"], r["last"], r["last"] - r["first"]]
             for r in doc["heldout_breakdown"]]))
    parts.append("<h2>Strata</h2>")
    for t in doc["strata"]:
        parts.append(f"<h3>{escape(t['feature'])}</h3>")
        if t["note"]:
            parts.append(f"<p class='note'>{escape(t['note'])}</p>")
            continue
        parts.append(table_html(["stratum", "n", "reward", "accuracy", "length", "truncated"],
                                [[s["label"], s["n"], s["reward_mean"], s["accuracy"], s["length_mean"],
                                  s["truncated_rate"]] for s in t["strata"]]))
    parts.append("<h2>Plots</h2>" + "".join(f"<p><img src='{escape(i)}' alt='{escape(i)}'></p>" for i in images))
    if not images:
        parts.append("<p class='note'>no plots: install the plot extra (matplotlib)</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
