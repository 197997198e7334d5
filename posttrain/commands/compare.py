"""``posttrain compare A B [...] --seeds N --budget-tokens T``: recipes at an equal token budget.

Each argument is a recipe (trained here, ``N`` seeds into ``<out>/<label>/seed<k>``; finished
runs there are reused), a run directory, or a directory of ``seed*`` run directories. Refuses
runs whose base checkpoint, tokenizer/template, verifier version or held-out set differ unless
``--force``; lists every other config difference. The first argument is the baseline.
Where runs recorded per-problem held-out outcomes, each recipe's accuracy difference from the
baseline at the budget gets a paired bootstrap interval per held-out set; ``--target KEY=VALUE``
reports the generated tokens and seconds at which each run first reached a target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from posttrain.commands.compare_outcomes import paired_intervals, parse_target, tokens_to_reach


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``compare`` command."""
    p = sub.add_parser("compare", help="compare recipes at an equal generated-token budget, with seed bands")
    p.add_argument("items", nargs="+", metavar="RECIPE_OR_RUN", help="recipes (names/YAML) or run directories; "
                   "a directory of seed*/ runs counts as one recipe; the first is the baseline")
    p.add_argument("--seeds", type=int, default=3, help="seeds per recipe to train (default 3; seeds 0..N-1)")
    p.add_argument("--budget-tokens", type=float, default=None,
                   help="generated-token budget (default: the largest budget every run reached)")
    p.add_argument("--out", default="runs/compare", help="where recipes are trained and results written")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override passed to every training run (e.g. --set steps=20)")
    p.add_argument("--force", action="store_true", help="compare even if a required identity differs")
    p.add_argument("--target", action="append", default=[], metavar="KEY=VALUE",
                   help="report the generated tokens and seconds at which each run first reached KEY >= VALUE "
                   "(e.g. heldout_unseen/accuracy=0.5); VALUE 'teacher': the distillation teacher's recorded KEY")
    p.set_defaults(func=run)


def _finished(run_dir: Path) -> bool:
    from posttrain.diagnostics.fairness import read_config
    from posttrain.diagnostics.load import read_metrics

    if not (run_dir / "config.yaml").is_file() or not (run_dir / "metrics.jsonl").is_file():
        return False
    metrics = read_metrics(run_dir)
    return bool(metrics) and int(metrics[-1]["step"]) >= int(read_config(run_dir).get("steps", 0))


def stale_settings(recipe: str, run_dir: Path, overrides: list[str]) -> list[str]:
    """Keys whose value in a finished run's ``config.yaml`` is not what ``recipe`` + ``overrides`` give.

    Keys present on one side only (a config schema that grew since the run) are not compared.
    """
    import yaml

    from posttrain.config import dump_config
    from posttrain.diagnostics.fairness import IGNORED_KEYS, flatten, read_config
    from posttrain.loop.validate import load_run_config

    want = flatten(yaml.safe_load(dump_config(load_run_config(recipe, overrides))))
    have = flatten(read_config(run_dir))
    return sorted(k for k in set(want) & set(have) if k not in IGNORED_KEYS and want[k] != have[k])


def train_seed(recipe: str, run_dir: Path, seed: int, overrides: list[str]) -> None:
    """Train one seed of ``recipe`` into ``run_dir`` as a subprocess (``posttrain train``)."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir}: holds an unfinished run; delete it (or pass the finished run directory)")
    cmd = [sys.executable, "-m", "posttrain.cli", "train", recipe, "--no-progress", *overrides,
           f"run_dir={run_dir}", f"seed={seed}"]
    print(f"training: {' '.join(cmd[2:])}", flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        raise ValueError(f"{run_dir}: training {recipe} seed {seed} failed (see its output above)")


def _is_recipe(item: str) -> bool:
    """Whether ``item`` names a recipe ``posttrain train`` can read: a YAML file or a shipped name."""
    from posttrain.config.loading import resolve_recipe_path
    from posttrain.errors import ConfigError

    try:
        resolve_recipe_path(item)
    except ConfigError:
        return False
    return True


def check_items(items: list[str]) -> None:
    """``ValueError``, one line naming every argument that is neither a run directory (``config.yaml``), a
    directory of ``seed*/`` runs, nor a recipe (a YAML path or a shipped name), before anything is trained."""
    bad = [item for item in items if not Path(item).is_dir() and not _is_recipe(item)]
    if bad:
        raise ValueError(f"{', '.join(bad)}: no such run directory or recipe (each argument is a run directory "
                         "holding config.yaml, a directory of seed*/ runs, a recipe YAML file, or a shipped recipe "
                         "name that `posttrain train --help` lists)")


def resolve(items: list[str], seeds: int, out: Path, overrides: list[str]) -> dict[str, list[Path]]:
    """label -> run directories, training what is missing (after :func:`check_items` accepted every item)."""
    check_items(items)
    groups: dict[str, list[Path]] = {}
    for item in items:
        p = Path(item)
        if (p / "config.yaml").is_file():
            runs, label = [p], p.name
        elif p.is_dir() and (runs := sorted(d for d in p.glob("seed*") if (d / "config.yaml").is_file())):
            label = p.name
        elif p.is_dir():
            raise FileNotFoundError(f"{p}: neither a run directory (config.yaml) nor a directory of seed*/ runs")
        else:
            label = p.stem
            runs = [out / label / f"seed{k}" for k in range(seeds)]
            for k, rd in enumerate(runs):
                if not _finished(rd):
                    train_seed(item, rd, k, overrides)
                elif stale := stale_settings(item, rd, overrides):
                    # Reusing it would silently compare a different recipe than the one asked for.
                    raise ValueError(f"{rd}: finished run of {item} with other settings ({', '.join(stale[:5])}); "
                                     "delete it or use another --out")
        while label in groups:
            label += "'"
        groups[label] = runs
    return groups


def run(args: argparse.Namespace) -> int:
    """Resolve/train the runs, check fairness, report the budget-matched differences."""
    from posttrain.diagnostics.budget import accuracy_at, difference, run_curve
    from posttrain.diagnostics.compare_plot import plot_compare
    from posttrain.diagnostics.fairness import blocking_differences, config_differences, identity, read_config
    from posttrain.diagnostics.load import read_metrics

    if len(args.items) < 2:
        raise ValueError("compare needs at least two recipes or run directories")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    for item in args.target:  # a malformed target fails before anything is trained
        parse_target(item)
    out = Path(args.out)
    groups = resolve(args.items, args.seeds, out, args.set)
    blocking = blocking_differences({lab: [identity(r) for r in runs] for lab, runs in groups.items()})
    for line in blocking:
        print(f"{'WARNING (forced)' if args.force else 'REFUSED'}: {line}")
    if blocking and not args.force:
        raise ValueError("runs are not comparable (see above); pass --force to compare anyway")
    diffs = config_differences({lab: read_config(runs[0]) for lab, runs in groups.items()})
    print("other differences (first run of each):" if diffs else "no other config differences")
    for key, vals in diffs.items():
        print(f"  {key}: " + ", ".join(f"{lab}={v}" for lab, v in vals.items()))
    curves = {lab: [run_curve(read_metrics(r)) for r in runs] for lab, runs in groups.items()}
    seeds_of = {lab: [int(read_config(r).get("seed", 0)) for r in runs] for lab, runs in groups.items()}
    budget = args.budget_tokens
    if budget is None:
        budget = min(c.total_tokens for cs in curves.values() for c in cs)
    acc = {lab: {s: a for s, c in zip(seeds_of[lab], cs, strict=True) if (a := accuracy_at(c, budget)) is not None}
           for lab, cs in curves.items()}
    print(f"held-out accuracy at {budget:.0f} generated tokens:")
    for lab, cs in curves.items():
        short = [s for s, c in zip(seeds_of[lab], cs, strict=True) if s not in acc[lab]]
        got = list(acc[lab].values())
        mean = f"{sum(got) / len(got):.3f}" if got else "-"
        print(f"  {lab}: mean {mean} over {len(got)} seeds {sorted(acc[lab].items())}"
              + (f"; seeds {short} never reached the budget (or had no evaluation within it)" if short else ""))
    base = next(iter(groups))
    result: dict[str, Any] = {"budget_tokens": budget, "baseline": base, "accuracy": {k: {str(s): a for s, a in v.items()}
                              for k, v in acc.items()}, "blocking": blocking, "forced": bool(blocking and args.force),
                              "differences": {k: {lab: repr(v) for lab, v in vs.items()} for k, vs in diffs.items()},
                              "diff_vs_baseline": {}, "runs": {k: [str(r) for r in v] for k, v in groups.items()}}
    for lab in list(groups)[1:]:
        d = difference(acc[base], acc[lab])
        if d is None:
            print(f"  {lab} - {base}: no estimate (a side has no run that reached the budget)")
            continue
        ci = f"[{d.low:+.3f}, {d.high:+.3f}]" if d.low is not None else "(no interval)"
        print(f"  {lab} - {base}: {d.mean:+.3f}, 95% CI {ci} ({d.method})")
        result["diff_vs_baseline"][lab] = dataclasses.asdict(d)
    result["paired_intervals"] = paired_intervals(groups, curves, seeds_of, budget)
    result["tokens_to_reach"] = tokens_to_reach(groups, curves, seeds_of, args.target)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_compare(curves, out / "compare.png", budget)
    result["plot"] = str(png) if png else None
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'compare.json'}" + (f" and {png}" if png else ""))
    return 0
