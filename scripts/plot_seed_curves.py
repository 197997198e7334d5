"""Plot held-out accuracy per evaluated step of several runs (one line per run and held-out set) and
one training metric per step (default ``reward/mean``), from each run's ``metrics.jsonl``: the seed
figures of docs/models.md.

    python scripts/plot_seed_curves.py OUT.png RUN_DIR [RUN_DIR ...] [--label seed1 ...] [--train-metric length/mean]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SETS = (("heldout", "in-distribution", "-"), ("heldout_unseen", "unseen", "--"))


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of ``run_dir/metrics.jsonl`` (one per step; held-out keys on evaluated steps)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--label", nargs="*", default=None, help="one label per run (default: the directory name)")
    ap.add_argument("--train-metric", default="reward/mean", help="the training metric of the right panel")
    args = ap.parse_args()
    labels = args.label or [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"--label: {len(labels)} labels for {len(args.runs)} runs")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (run, label) in enumerate(zip(args.runs, labels, strict=True)):
        rows = read_metrics(run)
        color = f"C{i}"
        for prefix, name, style in SETS:
            pts = [(r["step"], r[f"{prefix}/accuracy"]) for r in rows if f"{prefix}/accuracy" in r]
            if pts:
                acc.plot(*zip(*pts, strict=True), style, marker="o", color=color, label=f"{label} {name}")
        steps = [(r["step"], r[args.train_metric]) for r in rows if args.train_metric in r]
        if steps:
            rew.plot(*zip(*steps, strict=True), color=color, label=label)
    acc.set(xlabel="step", ylabel="greedy accuracy", title="held-out accuracy")
    rew.set(xlabel="step", ylabel=args.train_metric, title=f"training {args.train_metric}")
    acc.legend(fontsize=7)
    rew.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
