"""Summarise a behaviour-correction study: runs of one recipe that differ only in ``correction.name`` (and seed),
sampled by a bf16 engine against an fp32 learner (docs/models.md, "bf16 rollouts and their correction").

    python scripts/correction_study.py ARM=RUN_DIR[,RUN_DIR...] [ARM=...] --baseline none [--markdown]

Per run: greedy accuracy of each held-out set at every evaluated step, the rise first -> last with its paired
bootstrap 95% interval (:func:`posttrain.diagnostics.intervals.rise_interval`), the train/rollout mismatch
|log kappa| = |log mu - log pi_old| over the steps (mean of the per-step means, mean of the per-step p99, max),
and the fraction of tokens the correction truncated (TIS: kappa > C) or masked (IcePop: kappa outside
[alpha, beta]). Per arm against the baseline arm: the last evaluation's accuracy difference, paired over problems
and pooled over seeds (the held-out problems are the same in every run when ``eval.heldout_seed`` is set; runs
are paired by seed), with a bootstrap 95% interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from posttrain.diagnostics.intervals import Interval, rise_interval

SETS = ("heldout", "heldout_unseen")
FRACTIONS = ("correction/truncated", "correction/masked_low", "correction/masked_high")


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outcomes(run: Path) -> dict[tuple[int, str], dict[str, tuple[int, int]]]:
    """``(step, set) -> {prompt_id: (valid, correct)}`` from ``run/heldout_outcomes.jsonl``."""
    out: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
    for r in _rows(run / "heldout_outcomes.jsonl"):
        ids, valid, correct = r["prompt_ids"], r["valid"], r["correct"]
        assert isinstance(ids, list) and isinstance(valid, list) and isinstance(correct, list)
        key = (int(r["step"]), str(r["set"]))
        out[key] = {str(p): (int(v), int(c)) for p, v, c in zip(ids, valid, correct, strict=True)}
    return out


def run_summary(run: Path) -> dict[str, object]:
    """One run's figures (module docstring)."""
    metrics = _rows(run / "metrics.jsonl")
    oc = outcomes(run)
    steps = sorted({s for s, _ in oc})
    res: dict[str, object] = {"run": str(run), "steps": steps}
    for name in SETS:
        res[f"{name}/acc"] = [sum(c for _, c in oc[(s, name)].values()) / max(1, sum(v for v, _ in oc[(s, name)].values()))
                              for s in steps]
        first, last = oc[(steps[0], name)], oc[(steps[-1], name)]
        ids = sorted(first)
        pair = (([first[i][0] for i in ids], [first[i][1] for i in ids]),
                ([last[i][0] for i in ids], [last[i][1] for i in ids]))
        res[f"{name}/rise"] = rise_interval(*pair)
    lk = [m for m in metrics if "logkappa_abs_mean" in m]
    res["logkappa"] = (float(np.mean([float(m["logkappa_abs_mean"]) for m in lk])),  # type: ignore[arg-type]
                       float(np.mean([float(m["logkappa/p99"]) for m in lk])),  # type: ignore[arg-type]
                       float(max(float(m["logkappa_abs_max"]) for m in lk)))  # type: ignore[arg-type]
    res["fractions"] = {k: float(np.mean([float(m.get(k, 0.0)) for m in lk])) for k in FRACTIONS  # type: ignore[arg-type]
                        if any(k in m for m in lk)}
    res["kept"] = float(np.mean([float(m.get("correction/kept_token_frac", 1.0)) for m in lk]))  # type: ignore[arg-type]
    res["tokens"] = float(sum(float(m.get("tokens/generated", 0.0)) for m in metrics))  # type: ignore[arg-type]
    return res


def paired_difference(arm: list[Path], base: list[Path], name: str, *, resamples: int = 2000,
                      seed: int = 0) -> tuple[float, float, float]:
    """Mean over (seed, problem) of ``correct_arm - correct_base`` at each run's last evaluation, runs paired in
    the given order, with a bootstrap 95% interval over the pooled pairs."""
    diffs: list[int] = []
    for a, b in zip(arm, base, strict=True):
        oa, ob = outcomes(a), outcomes(b)
        la = oa[(max(s for s, n in oa if n == name), name)]
        lb = ob[(max(s for s, n in ob if n == name), name)]
        diffs += [la[i][1] - lb[i][1] for i in sorted(set(la) & set(lb))]
    d = np.asarray(diffs, dtype=float)
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    return float(d.mean()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms", nargs="+", help="ARM=RUN_DIR[,RUN_DIR...] (runs in seed order)")
    ap.add_argument("--baseline", required=True, help="the arm the others are compared with")
    args = ap.parse_args()
    arms = {a.split("=", 1)[0]: [Path(p) for p in a.split("=", 1)[1].split(",")] for a in args.arms}
    print("| arm | run | heldout greedy by step | unseen greedy by step | unseen rise [95%] | |log k| mean / p99 / max "
          "| truncated or masked | kept tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, runs in arms.items():
        for run in runs:
            s = run_summary(run)
            r = s["heldout_unseen/rise"]
            assert isinstance(r, Interval)
            lk = s["logkappa"]
            fr = ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in s["fractions"].items()) or "-"  # type: ignore[union-attr]
            print(f"| {arm} | {run.name} | {' / '.join(f'{x:.3f}' for x in s['heldout/acc'])} | "  # type: ignore[union-attr]
                  f"{' / '.join(f'{x:.3f}' for x in s['heldout_unseen/acc'])} | "  # type: ignore[union-attr]
                  f"{100 * r.estimate:+.1f} [{100 * r.low:+.1f}, {100 * r.high:+.1f}] | "
                  f"{lk[0]:.3f} / {lk[1]:.3f} / {lk[2]:.2f} | {fr} | {s['kept']:.4f} |")  # type: ignore[index]
    print()
    for arm, runs in arms.items():
        if arm == args.baseline:
            continue
        for name in SETS:
            m, lo, hi = paired_difference(runs, arms[args.baseline], name)
            print(f"- {arm} - {args.baseline}, {name}, last evaluation: {100 * m:+.1f} points "
                  f"[{100 * lo:+.1f}, {100 * hi:+.1f}] (paired over problems, {len(runs)} seeds pooled)")


if __name__ == "__main__":
    main()
