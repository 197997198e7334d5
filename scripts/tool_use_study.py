"""Tool use measured over seeds: the with-tool / without-tool table of ``smollm2_tool_calc_warm`` runs (issue 43).

    python scripts/tool_use_study.py S=RUN_DIR [S=RUN_DIR ...]

Each ``RUN_DIR`` is a finished ``posttrain train smollm2_tool_calc_warm seed=S eval.heldout_seed=0 ...`` run (the
same held-out problems for every seed), and ``RUN_DIR.time`` beside it, when present, GNU ``time -v`` output of the
command. Per seed it prints greedy held-out accuracy with the tool (``heldout``) and on the same problems with the
tool removed (``heldout_notool``, ``env.eval_without_tools``) at the first and last evaluation; the rise of the
with-tool accuracy first -> last; the difference with - without at the last evaluation; each with its paired
bootstrap 95% interval over problems (:func:`posttrain.diagnostics.intervals.rise_interval`, Efron & Tibshirani
1993, ch. 13); held-out tool calls per episode; wall and peak RSS.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ei_study import _pair, _peak_rss_gb, _rows, _wall_min

from posttrain.diagnostics.heldout_outcomes import read_outcomes
from posttrain.diagnostics.intervals import Interval


def _fmt(i: Interval) -> str:
    return f"{100 * i.estimate:+.1f} [{100 * i.low:+.1f}, {100 * i.high:+.1f}]"


def summary(runs: dict[int, Path]) -> None:
    """Print the markdown table of :mod:`this script <tool_use_study>` for ``runs`` (seed -> run directory)."""
    print("| seed | problems | with tool: step 0 -> end | without: step 0 -> end | rise with tool [95%] | "
          "with - without at end [95%] | tool calls / held-out episode (end) | wall | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seed, run in sorted(runs.items()):
        outcomes = read_outcomes(run)
        tool, bare = outcomes["heldout"], outcomes["heldout_notool"]
        first, last = min(tool), max(tool)
        metrics = {int(str(r["step"])): r for r in _rows(run / "metrics.jsonl")}
        calls = metrics.get(last, {}).get("heldout/tool_calls_mean")
        time_file = run.parent / f"{run.name}.time"
        wall, rss = _wall_min(time_file), _peak_rss_gb(time_file)
        print(f"| {seed} | {len(tool[last].per_problem().prompt_ids)} | "
              f"{tool[first].accuracy:.3f} -> {tool[last].accuracy:.3f} (step {last}) | "
              f"{bare[first].accuracy:.3f} -> {bare[last].accuracy:.3f} | "
              f"{_fmt(_pair(tool[first].per_problem(), tool[last].per_problem()))} | "
              f"**{_fmt(_pair(bare[last].per_problem(), tool[last].per_problem()))}** | "
              f"{'' if calls is None else f'{float(str(calls)):.2f}'} | "
              f"{'' if wall is None else f'{wall:.1f} min'} | {'' if rss is None else f'{rss:.1f} GiB'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="SEED=RUN_DIR")
    a = ap.parse_args()
    summary({int(x.split("=", 1)[0]): Path(x.split("=", 1)[1]) for x in a.runs})


if __name__ == "__main__":
    main()
