"""``posttrain report RUN_DIR``: stratified diagnostics, trends and the failure-symptom table.

Reads the ledger and metrics only (no model, no GPU). Prints the per-step ledger table of
``posttrain inspect ledger``, the held-out table of :mod:`posttrain.evaluation.report`, the held-out
accuracy of every held-out set with bootstrap 95% intervals (first, best and last evaluation, and the
rise first -> last: :func:`~posttrain.evaluation.report.accuracy_summaries`), the held-out breakdown
(per constraint family and tool calls per episode, first -> last:
:mod:`~posttrain.diagnostics.heldout_breakdown_report`), the strata and the symptom table; writes JSON
(``heldout_intervals.json`` beside ``diagnostics.json``), PNGs and ``report.html`` (the same intervals
and breakdown included; see docs/diagnostics.md).

Per trainer (the run's ``config.yaml``): a run with learned reward components (``reward.model``,
``reward.judge``) adds each one's agreement with the verifier (``learned_agreement.json``); a distillation
run (``loss.distill``) the teacher log-prob gap strata (``teacher_gap_strata.json``). A run whose trainer samples
nothing and trains on pairs (its entry in :data:`posttrain.config.trainers.TRAINERS`: an offline
``trainer: preference`` or a ``trainer: reward_model`` run) has no ledger: its report is the held-out pair
accuracy curve with first / best / last (``pair_accuracy.json``). One that samples nothing and trains on no
pairs (``trainer: sft``) has no report yet: one line says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from posttrain.commands import inspect_ledger


def register(sub: Any) -> None:
    """Add the ``report`` command."""
    p = sub.add_parser("report", help="stratified diagnostics and failure symptoms of a run, from its ledger")
    p.add_argument("run_dir", help="a run directory (holding ledger/ and metrics.jsonl)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/diagnostics)")
    p.add_argument("--quiet", action="store_true", help="write the files, print only their paths")
    p.set_defaults(func=run)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _eval_temperatures(run_dir: Path) -> tuple[float, float | None]:
    """``(eval.temperature, eval.sampled_temperature)`` of the run's ``config.yaml`` (defaults 0 and None)."""
    from posttrain.loop.run_dir import read_config_yaml

    e = (read_config_yaml(run_dir / "config.yaml") or {}).get("eval") or {}
    t, st = e.get("temperature", 0.0), e.get("sampled_temperature")
    return (float(t) if isinstance(t, (int, float)) else 0.0), (float(st) if isinstance(st, (int, float)) else None)


def _pair_trainer(run_dir: Path, config: dict[str, Any]) -> str | None:
    """The trainer's name for a run that trains on pairs without sampling (its registry entry's ``samples`` and
    ``reads_pairs`` of the run's ``config``), None for a run that samples; a
    :class:`~posttrain.errors.UserError` (one line) for a run that does neither, which has no report yet."""
    from posttrain.config.trainers import recorded_trainer
    from posttrain.errors import UserError

    entry, view = recorded_trainer(config, str(run_dir / "config.yaml"))
    if entry.samples(view):
        return None
    if entry.reads_pairs(view):
        return entry.name
    raise UserError(f"{run_dir}: a trainer={entry.name} run samples no responses and trains on no pairs: posttrain "
                    f"report has no report for it yet (its {entry.heldout} is in {run_dir / 'metrics.jsonl'})")


def _pair_report(args: argparse.Namespace, run_dir: Path, trainer: str) -> int:
    """The report of an offline preference or reward-model run: its held-out pair accuracy curve."""
    from rich.console import Console

    from posttrain.evaluation.report import pair_accuracy_curve, pair_accuracy_summary, pair_accuracy_table

    curve = pair_accuracy_curve(run_dir)
    if not curve:
        raise FileNotFoundError(f"{run_dir}: a trainer={trainer} run with no held-out pair evaluation in "
                                "metrics.jsonl yet")
    out = Path(args.out) if args.out is not None else run_dir / "diagnostics"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pair_accuracy.json"
    path.write_text(json.dumps({"trainer": trainer, "curve": curve, "summary": pair_accuracy_summary(curve)}, indent=2))
    if not args.quiet:
        con = Console()
        con.print(pair_accuracy_table(curve, trainer))
        con.print(f"trainer={trainer} samples no responses (no ledger): the RL strata, trends and failure symptoms "
                  "do not apply; no interval: per-pair outcomes are not recorded")
    print(f"wrote {path}")
    return 0


def _strata_table(t: dict[str, Any]) -> Any:
    from rich.table import Table

    tab = Table(title=f"by {t['feature']}")
    for col in ("stratum", "n", "reward", "accuracy", "length", "truncated"):
        tab.add_column(col, justify="right")
    for s in t["strata"]:
        tab.add_row(s["label"], str(s["n"]), _fmt(s["reward_mean"]), _fmt(s["accuracy"]),
                    _fmt(s["length_mean"]), _fmt(s["truncated_rate"]))
    return tab


def _breakdown_table(rows: list[dict[str, Any]]) -> Any:
    """The held-out breakdown (per constraint family, tool calls per episode) as a rich Table."""
    from rich.table import Table

    tab = Table(title="held-out breakdown: constraint families (share met), tool calls per episode")
    for col in ("metric", "first step", "first", "last step", "last", "change"):
        tab.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        tab.add_row(r["key"], str(r["first_step"]), _fmt(r["first"]), str(r["last_step"]), _fmt(r["last"]),
                    f"{r['last'] - r['first']:+.3f}")
    return tab


def _trainer_sections(run_dir: Path, config: dict[str, Any], out: Path) -> tuple[list[Any], list[Path]]:
    """What a run's trainer adds to the report: learned-reward agreement lines and the teacher gap strata
    table (printables, files written); nothing for a plain RL run."""
    from posttrain.diagnostics.learned_reward import run_agreements

    printables: list[Any] = []
    files: list[Path] = []
    agreements = run_agreements(run_dir, config)
    if agreements:
        printables += [line for a in agreements for line in a.lines()]
        files.append(out / "learned_agreement.json")
        files[-1].write_text(json.dumps([dataclasses.asdict(a) for a in agreements], indent=2))
    if (config.get("loss") or {}).get("distill"):
        from posttrain.diagnostics.load import load_summaries
        from posttrain.diagnostics.strata import teacher_gap_strata

        table = dataclasses.asdict(teacher_gap_strata(load_summaries(run_dir)))
        printables.append(f"[bold]{table['feature']}[/bold]: {table['note']}" if table["note"] else _strata_table(table))
        files.append(out / "teacher_gap_strata.json")
        files[-1].write_text(json.dumps(table, indent=2))
    return printables, files


def run(args: argparse.Namespace) -> int:
    """Build the report of ``args.run_dir``; exit code 0."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.diagnostics.build import build_report
    from posttrain.evaluation.report import (
        accuracy_summaries,
        heldout_series,
        intervals_table,
        report_table,
        summaries_json,
    )
    from posttrain.loop.run_dir import read_config_yaml

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{args.run_dir}: no such run directory")
    config = read_config_yaml(run_dir / "config.yaml") or {}
    pair_trainer = _pair_trainer(run_dir, config)
    if pair_trainer is not None:
        return _pair_report(args, run_dir, pair_trainer)
    summaries = accuracy_summaries(heldout_series(run_dir), *_eval_temperatures(run_dir))
    doc = build_report(args.run_dir, args.out, summaries)
    extra, extra_files = _trainer_sections(run_dir, config, Path(args.out) if args.out is not None
                                           else run_dir / "diagnostics")
    intervals_path = Path(args.out) if args.out is not None else run_dir / "diagnostics"
    intervals_path = intervals_path / "heldout_intervals.json"
    intervals_path.write_text(json.dumps(summaries_json(summaries), indent=2))
    con = Console()
    if not args.quiet:
        if doc["trajectories"]:
            inspect_ledger.run(argparse.Namespace(run_dir=args.run_dir, steps=None))
        if doc["heldout_curve"]:
            con.print(report_table(doc))
        if summaries:
            con.print(intervals_table(summaries))
        if doc["heldout_breakdown"]:
            con.print(_breakdown_table(doc["heldout_breakdown"]))
        for t in doc["strata"]:
            if t["note"]:
                con.print(f"[bold]{t['feature']}[/bold]: {t['note']}")
                continue
            con.print(_strata_table(t))
        for item in extra:
            con.print(item)
        hv = doc["hidden_verifier"]
        con.print(f"[bold]passed by the training verifier, failed by the hidden one[/bold]: {hv['explanation']}")
        if hv["items"]:
            tab = Table()
            for col in ("step", "trajectory", "reward", "response", "reference", "hidden verdict"):
                tab.add_column(col)
            for i in hv["items"]:
                tab.add_row(str(i["step"]), i["traj_id"], _fmt(i["reward"]), repr(i["response"]), repr(i["reference"]),
                            i["second_status"])
            con.print(tab)
        sym = Table(title="failure symptoms", show_lines=True)
        for col in ("symptom", "flagged", "evidence", "check first"):
            sym.add_column(col)
        for s in doc["symptoms"]:
            sym.add_row(s["name"], "[red]YES[/red]" if s["flagged"] else "no", s["evidence"], s["check"])
        con.print(sym)
    for f in [*doc["files"], str(intervals_path), *map(str, extra_files)]:
        print(f"wrote {f}")
    return 0
