"""``posttrain demo``: the embedded default, end to end on a CPU in minutes.

Builds a tiny model with the project's own code, warms it up with SFT on a built-in
verifiable task, runs GRPO, evaluates on held-out prompts, and writes a report (PNG plot,
table, ``report.json`` with ``heldout_accuracy_before`` / ``heldout_accuracy_after`` /
``wall_seconds``) into the run directory.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from posttrain.loop.validate import load_run_config


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="SFT warm-up + GRPO on a tiny model and a built-in task, with a report")
    p.add_argument("overrides", nargs="*", help="key=value overrides of recipes/demo.yaml")
    p.add_argument("--run-dir", default="runs/demo", help="where the ledger, checkpoints and report go")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from posttrain.evaluation.report import (
        heldout_series,
        report_table,
        rise_lines,
        series_label,
        write_report,
    )
    from posttrain.loop.console import progress_bars
    from posttrain.loop.training_loop import train

    cfg = load_run_config("demo", [f"run_dir={args.run_dir}", *args.overrides])
    from posttrain.loop.preflight import preflight

    preflight(cfg)  # config errors of step 1 fail here, before anything is moved or written
    run_dir = Path(cfg.run_dir or args.run_dir)
    if (run_dir / "checkpoints").exists() and not cfg.resume:
        # A fresh demo each time: keep old runs auditable by moving them aside, never deleting.
        aside = run_dir.with_name(f"{run_dir.name}.old-{int(time.time())}")
        run_dir.rename(aside)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    console = Console()
    console.print(f"[bold]posttrain demo[/bold]: {cfg.model.path} on task {cfg.task.name} {cfg.task.kwargs}")
    for axis, desc in cfg.axes().items():
        console.print(f"  {axis:<11} {desc}")
    t0 = time.perf_counter()
    with progress_bars(enabled=not args.no_progress) as progress:
        st = train(cfg, progress=progress)
    wall = time.perf_counter() - t0
    e = cfg.eval
    series = heldout_series(run_dir)
    rep = write_report(run_dir, st, extra={"wall_seconds": wall, "task": cfg.task.name, "model": cfg.model.path,
                                           "heldout_temperature": e.temperature,
                                           "heldout_sampled_temperature": e.sampled_temperature},
                       labels={k: series_label(k, e.temperature, e.sampled_temperature) for k in series})
    console.print(report_table(rep))
    console.print(f"SFT model (step 0) -> RL model, {wall:.0f} s:")
    for line in rise_lines(series, e.temperature, e.sampled_temperature):
        console.print(f"  {line}")
    console.print(f"report: {run_dir / 'report.json'}" + (f", plot: {rep['plot']}" if rep.get("plot") else ""))
    return 0
