"""``posttrain inspect ledger RUN_DIR``: a run's trajectories summarised by status, length, reward."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (holding ledger/) or the ledger directory itself")
    p.add_argument("--steps", default=None, help="comma-separated steps (default: all)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from posttrain.trajectory import Ledger

    root = Path(args.run_dir)
    led = Ledger(root / "ledger" if (root / "ledger").is_dir() else root)
    steps = led.steps()
    if not steps:
        raise FileNotFoundError(f"no ledger steps under {led.root} (expected trajectories/step_*.parquet)")
    if args.steps:
        try:
            want = [int(s) for s in args.steps.split(",")]
        except ValueError:
            raise ValueError(f"--steps must be comma-separated integers, got {args.steps!r}") from None
        missing = sorted(set(want) - set(steps))
        if missing:
            raise ValueError(f"steps not in the ledger: {missing}")
        steps = want
    con = Console()
    per_step = Table(title=f"ledger {led.root}: {len(steps)} steps")
    for col in ("step", "trajs", "correct", "wrong", "invalid", "timeout", "env_fail", "infra", "reward", "len mean",
                "len max", "truncated", "versions"):
        per_step.add_column(col, justify="right")
    total: Counter[str] = Counter()
    lengths: list[int] = []
    for s in steps:
        trajs = led.read_trajectories([s])
        st = Counter(t.status.value if t.status else "unscored" for t in trajs)
        total.update(st)
        ln = [t.num_actions for t in trajs]
        lengths.extend(ln)
        rewards = [t.reward.total for t in trajs if t.reward.total is not None]
        versions = sorted({int(v) for t in trajs for v in t.behavior_version[t.action_mask.astype(bool)]})
        per_step.add_row(
            str(s), str(len(trajs)), str(st["correct"]), str(st["wrong"]), str(st["invalid"]), str(st["timeout"]),
            str(st["env_failure"]), str(st["infra_error"]),
            f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
            f"{sum(ln) / len(ln):.1f}" if ln else "-", str(max(ln, default=0)),
            str(sum(t.finish.value == "truncated" for t in trajs)),
            ",".join(map(str, versions)) if len(versions) <= 4 else f"{versions[0]}..{versions[-1]}",
        )
    con.print(per_step)
    n = sum(total.values())
    con.print("status totals: " + ", ".join(f"{k} {v} ({v / n:.1%})" for k, v in sorted(total.items())))
    if lengths:
        srt = sorted(lengths)
        con.print(f"response length: mean {sum(srt) / len(srt):.2f}, p50 {srt[len(srt) // 2]}, "
                  f"p95 {srt[int(0.95 * (len(srt) - 1))]}, max {srt[-1]}")
    return 0
