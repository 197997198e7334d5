"""Expert iteration before RL, measured: the base model's held-out figures and a per-seed summary of the three
stages of docs/expert_iteration.md (issue 43).

    python scripts/ei_study.py base OUT [--recipe smollm2_instruction_following] [KEY=VALUE ...]
    python scripts/ei_study.py summary --base OUT SEED=PIPELINE_DIR [SEED=PIPELINE_DIR ...]

``base`` evaluates the recipe's own model (``model.path``) exactly as a training run of that recipe evaluates at
step 0 (:func:`posttrain.loop.heldout.heldout_evaluation` over :class:`posttrain.evaluation.heldout.HeldoutRun`:
the same held-out sets, renderer, verifier and seeds), and writes ``OUT/metrics.jsonl`` (one row, step 0) and
``OUT/heldout_outcomes.jsonl`` (per-problem outcomes). With ``eval.heldout_seed`` fixed in the recipe, every seed's
stage 3 is evaluated on the same problems, so one base evaluation pairs with all of them.

``summary`` reads each pipeline directory (``sample/``, ``sft/``, ``rl/`` and ``times.log`` / ``*.time`` as
/tmp pipeline scripts write them: ``PIPELINE/{stage}.time`` is GNU ``time -v`` output) and prints per seed and
held-out set: greedy accuracy of the base model, of the SFT'd policy (stage 3's first evaluation) and at stage 3's
last evaluation; the rise base -> end and SFT -> end with paired bootstrap 95% intervals
(:func:`posttrain.diagnostics.intervals.rise_interval`, Efron & Tibshirani 1993, ch. 13); stage 1's kept rows;
wall per stage and peak RSS. Per constraint family (``heldout_unseen``): the share of that family's constraints
met, base -> end, with a normal-approximation 95% interval of the difference of two proportions
(``d +- 1.96 sqrt(p0 (1 - p0) / n + p1 (1 - p1) / n)``, ``n`` = held-out prompts asking the family; unpaired, so
wider than a paired interval would be).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from posttrain.diagnostics.heldout_outcomes import SetOutcomes, append_outcomes, read_outcomes
from posttrain.diagnostics.intervals import Interval, rise_interval

SETS = ("heldout", "heldout_unseen")


def base_eval(out: Path, recipe: str, overrides: list[str]) -> dict[str, float]:
    """Evaluate ``recipe``'s model as its run does at step 0; write ``out``'s two files; return the metrics."""
    from posttrain.evaluation.heldout import HeldoutRun
    from posttrain.loop.builders import build_model
    from posttrain.loop.heldout import heldout_evaluation
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config(recipe, overrides)
    tok, model = build_model(cfg)
    model.eval()
    hr = HeldoutRun.from_config(cfg, model, tok)
    try:
        ev = heldout_evaluation(hr)
    finally:
        hr.close()
    out.mkdir(parents=True, exist_ok=True)
    append_outcomes(out, 0, ev.outcomes)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 0, **ev.metrics}) + "\n")
    (out / "base.json").write_text(json.dumps({"recipe": recipe, "overrides": overrides,
                                               "model": cfg.model.path, "seed": cfg.seed}, indent=2))
    return ev.metrics


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _pair(first: SetOutcomes, last: SetOutcomes) -> Interval:
    a = {p: (v, c) for p, v, c in zip(first.prompt_ids, first.valid, first.correct, strict=True)}
    b = {p: (v, c) for p, v, c in zip(last.prompt_ids, last.valid, last.correct, strict=True)}
    ids = sorted(set(a) & set(b))
    return rise_interval(([a[i][0] for i in ids], [a[i][1] for i in ids]),
                         ([b[i][0] for i in ids], [b[i][1] for i in ids]))


def _peak_rss_gb(time_file: Path) -> float | None:
    if not time_file.is_file():
        return None
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_file.read_text())
    return int(m.group(1)) / 1024**2 if m else None


def _wall_min(time_file: Path) -> float | None:
    if not time_file.is_file():
        return None
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", time_file.read_text())
    if not m:
        return None
    parts = [float(x) for x in m.group(1).split(":")]
    secs = sum(x * 60 ** i for i, x in enumerate(reversed(parts)))
    return secs / 60


def _asked(recipe: str, overrides: list[str], split: str) -> dict[str, int]:
    """Held-out prompts of ``split`` asking each constraint family (``ifc/<family>`` -> count)."""
    from posttrain.loop.builders import build_task
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config(recipe, overrides)
    task = build_task(cfg)
    counts: dict[str, int] = {}
    for ex in task.examples(split, cfg.eval.size, seed=cfg.eval.heldout_seed_of(cfg.seed)):
        for spec in json.loads(str(ex.meta["constraints"])):
            key = f"ifc/{spec['family']}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _fmt(iv: Interval) -> str:
    return f"{100 * iv.estimate:+.1f} [{100 * iv.low:+.1f}, {100 * iv.high:+.1f}]"


def summary(base: Path, pipelines: dict[int, Path]) -> None:
    """Print the per-seed table and the per-family table (module docstring)."""
    bo = read_outcomes(base)
    bm = _rows(base / "metrics.jsonl")[-1]
    cfg_b = json.loads((base / "base.json").read_text())
    lines = ["| seed | set | base | SFT (stage 3 step 0) | end (stage 3 last) | rise base -> end [95%] | "
             "rise SFT -> end [95%] |", "|---|---|---|---|---|---|---|"]
    fam_rows: dict[str, list[str]] = {}
    notes = []
    asked = _asked(cfg_b["recipe"], cfg_b["overrides"], "heldout_unseen")
    for seed, pdir in sorted(pipelines.items()):
        ro = read_outcomes(pdir / "rl")
        for name in SETS:
            steps = sorted(ro.get(name, {}))
            if not steps:
                lines.append(f"| {seed} | {name} | {bo[name][0].accuracy:.3f} | (no stage 3 evaluation yet) | | | |")
                continue
            sft, end = ro[name][steps[0]], ro[name][steps[-1]]
            lines.append(f"| {seed} | `{name}` | {bo[name][0].accuracy:.3f} | {sft.accuracy:.3f} | "
                         f"{end.accuracy:.3f} (step {steps[-1]}) | **{_fmt(_pair(bo[name][0], end))}** | "
                         f"{_fmt(_pair(sft, end))} |")
        sm = json.loads((pdir / "sample" / "summary.json").read_text()) if (pdir / "sample" / "summary.json").is_file() else {}
        walls = {st: _wall_min(pdir / f"{st}.time") for st in ("sample", "sft", "rl")}
        rss = max((x for x in (_peak_rss_gb(pdir / f"{st}.time") for st in ("sample", "sft", "rl")) if x is not None),
                  default=None)
        wall_txt = " + ".join(f"{st} {w:.1f}" for st, w in walls.items() if w is not None)
        total = sum(w for w in walls.values() if w is not None)
        notes.append(f"- seed {seed}: stage 1 {json.dumps({k: sm[k] for k in sm if k in ('samples', 'kept', 'prompts', 'correct', 'kept_prompts', 'status')})}; "
                     f"wall {wall_txt} = {total:.1f} min; peak RSS {rss:.1f} GiB" if rss is not None else
                     f"- seed {seed}: stage 1 {sm}; wall {wall_txt}")
        rm = _rows(pdir / "rl" / "metrics.jsonl")
        last = [r for r in rm if "heldout_unseen/accuracy" in r]
        if not last:
            continue
        end_m = last[-1]
        for k in sorted(x for x in bm if x.startswith("heldout_unseen/ifc/")):
            fam = k.removeprefix("heldout_unseen/")
            p0, p1 = float(bm[k]), float(end_m.get(k, float("nan")))  # type: ignore[arg-type]
            n = asked.get(fam, 0)
            half = 1.96 * math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n) if n else float("nan")
            d = p1 - p0
            flag = " (fell beyond its interval)" if d + half < 0 else ""
            fam_rows.setdefault(fam, [f"{fam.removeprefix('ifc/')} (n={n})", f"{p0:.2f}"]).append(
                f"{p1:.2f}: {100 * d:+.0f} [{100 * (d - half):+.0f}, {100 * (d + half):+.0f}]{flag}")
    print("\n".join(lines))
    print()
    print("\n".join(notes))
    print()
    seeds = sorted(pipelines)
    print("| family (unseen prompts asking it) | base | " + " | ".join(f"seed {s} end: change [95%]" for s in seeds) + " |")
    print("|---|---|" + "---|" * len(seeds))
    for _, row in sorted(fam_rows.items()):
        print("| " + " | ".join(row) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base")
    b.add_argument("out", type=Path)
    b.add_argument("--recipe", default="smollm2_instruction_following")
    b.add_argument("overrides", nargs="*")
    s = sub.add_parser("summary")
    s.add_argument("--base", type=Path, required=True)
    s.add_argument("pipelines", nargs="+", help="SEED=PIPELINE_DIR")
    a = ap.parse_args()
    if a.cmd == "base":
        m = base_eval(a.out, a.recipe, a.overrides)
        print(json.dumps({k: v for k, v in m.items() if k.endswith("/accuracy")}, indent=2))
    else:
        summary(a.base, {int(x.split("=", 1)[0]): Path(x.split("=", 1)[1]) for x in a.pipelines})


if __name__ == "__main__":
    main()
