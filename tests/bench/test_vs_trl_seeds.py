"""``posttrain bench vs-trl --seeds``: one comparison per seed on held-out problems drawn once, and the pooled
posttrain - TRL difference with its intervals (hand-computed here; the sides stubbed except in the smoke run)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from posttrain.bench import vs_trl
from posttrain.bench.vs_trl_seeds import (
    SeedResult,
    SideFigures,
    parse_seeds,
    seeded_overrides,
    seeds_table,
    summarize,
)
from posttrain.diagnostics.heldout_outcomes import SetOutcomes
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.config import RunConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", dest="json_path", default=None)
    vs_trl.add_arguments(parser)
    return parser


def test_seeds_parse_and_bad_items_are_refused_by_name() -> None:
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds(" 7 ") == [7]
    for bad, word in (("0,,1", "''"), ("a", "'a'"), ("1,1", "twice"), ("-1", "'-1'"), ("1.5", "'1.5'")):
        with pytest.raises(argparse.ArgumentTypeError, match=word):
            parse_seeds(bad)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--seeds", "0,x"])


def test_seeded_overrides_fix_the_heldout_problems_and_refuse_a_seed() -> None:
    assert seeded_overrides(["a=1"], [3, 4]) == (["a=1", "eval.heldout_seed=3"], 3)
    assert seeded_overrides(["eval.heldout_seed=9"], [0, 1]) == (["eval.heldout_seed=9"], 9)
    assert seeded_overrides(["a=1"], [3, 4], recipe_heldout_seed=0) == (["a=1"], 0)  # the recipe fixes its own
    assert seeded_overrides(["eval.heldout_seed=9"], [3], recipe_heldout_seed=0) == (["eval.heldout_seed=9"], 9)
    with pytest.raises(UserError, match="seed= override cannot take effect"):
        seeded_overrides(["seed=2"], [0, 1])
    with pytest.raises(UserError, match="fixed seed"):
        seeded_overrides(["eval.heldout_seed=null"], [0, 1])


def _side(correct: list[int], step_s: float, ids: list[str] | None = None) -> SideFigures:
    ids = ids or [f"p{i}" for i in range(len(correct))]
    return SideFigures(sum(correct) / len(correct), step_s, SetOutcomes(tuple(ids), (1,) * len(ids), tuple(correct)))


def _side_json(correct: list[int], step_s: float) -> dict[str, Any]:
    """A stubbed side's result as the bench's JSON holds it."""
    ids = [f"p{i}" for i in range(len(correct))]
    return {"heldout_accuracy": sum(correct) / len(correct), "step_s_mean": step_s,
            "heldout": {"outcomes": {"prompt_ids": ids, "valid": [1] * len(ids), "correct": correct}}}


def test_summary_equals_a_hand_computation() -> None:
    """Two seeds on the same four problems. Seed 0: posttrain right on p0-p2, TRL on p0 (diff +0.50); seed 1:
    posttrain on p0, TRL on p0-p1 (diff -0.25). Pooled: posttrain 4/8, TRL 3/8 -> +0.125; per seed the
    mean is +0.125 and the paired t over 2 seeds is +-12.706 * sd / sqrt(2) with sd = |0.5 + 0.25| / sqrt(2)."""
    s = summarize(0, [SeedResult(0, 0.3, _side([1, 1, 1, 0], 1.0), _side([1, 0, 0, 0], 3.0)),
                      SeedResult(1, 0.2, _side([1, 0, 0, 0], 2.0), _side([1, 1, 0, 0], 3.0))])
    assert [r["heldout_accuracy_diff"] for r in s["per_seed"]] == [0.5, -0.25]
    assert [r["speedup_vs_trl"] for r in s["per_seed"]] == [3.0, 1.5]
    pooled = s["heldout_accuracy_diff"]
    assert pooled is not None and pooled["estimate"] == pytest.approx(0.125) and pooled["n_problems"] == 4
    assert pooled["low"] <= 0.125 <= pooled["high"]
    over = s["heldout_accuracy_diff_over_seeds"]
    assert over is not None and over["mean"] == pytest.approx(0.125) and over["seeds"] == 2
    half = 12.706 * (0.75 / math.sqrt(2)) / math.sqrt(2)
    assert over["low"] == pytest.approx(0.125 - half, abs=1e-3) and over["high"] == pytest.approx(0.125 + half, abs=1e-3)
    assert s["speedup_vs_trl"] == pytest.approx(3.0 / 1.5)  # mean TRL step 3.0 over mean posttrain step 1.5
    text = seeds_table(s)
    assert "+12.5 points" in text and "seed 0 for every seed" in text and "2.00x" in text


def test_summary_pairs_problems_not_positions() -> None:
    """The bootstrap pairs the sides by prompt id: the same outcomes listed in another order give the same
    estimate, and swapping which side got p0 right flips its sign (a positional pairing would not care)."""
    a = _side([1, 0, 0], 1.0)
    b = _side([0, 1, 1], 1.0)
    b_shuffled = _side([1, 0, 1], 1.0, ids=["p2", "p0", "p1"])
    s1 = summarize(0, [SeedResult(0, 0.0, a, b)])
    s2 = summarize(0, [SeedResult(0, 0.0, a, b_shuffled)])
    assert s1["heldout_accuracy_diff"] == s2["heldout_accuracy_diff"]
    assert s1["heldout_accuracy_diff"] is not None and s1["heldout_accuracy_diff"]["estimate"] == pytest.approx(-1 / 3)
    assert s1["heldout_accuracy_diff_over_seeds"] is not None
    assert s1["heldout_accuracy_diff_over_seeds"]["low"] is None  # one seed: no interval over seeds


def test_summary_with_one_side_missing_has_no_difference() -> None:
    s = summarize(0, [SeedResult(0, 0.1, _side([1, 0], 1.0), None), SeedResult(1, 0.1, _side([1, 1], 1.0), None)])
    assert s["heldout_accuracy_diff"] is None and math.isnan(s["speedup_vs_trl"])
    assert "pooled" not in seeds_table(s)


def test_seeds_run_each_seed_on_the_same_heldout_problems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Stubbed sides: each seed's run gets ``seed=S`` and the first seed's held-out draw, its own work dir, and
    the JSON holds every run's report and the summary."""
    seen: list[tuple[int, int | None, Path]] = []

    def run_side(cfg: RunConfig, sft_dir: Path, work: Path, steps: int, precision: str = "fp32") -> dict[str, Any]:
        seen.append((cfg.seed, cfg.eval.heldout_seed, work))
        return {"step_s_mean": 1.0 + cfg.seed, "gen_tokens_per_s": 1.0, "generated_tokens": 1.0,
                **_side_json([1, cfg.seed % 2], 1.0 + cfg.seed),
                "time_split_s": {"time/rollout_s": 0.1, "time/reward_s": 0.1, "time/learner_s": 0.1}}

    monkeypatch.setattr(vs_trl, "prepare_sft", lambda cfg, work, fresh=False: (work / "sft", 0.0))
    monkeypatch.setattr(vs_trl, "_load", lambda path: (None, None))
    monkeypatch.setattr(vs_trl, "evaluate_model", lambda model, tok, cfg: {"accuracy": 0.25, "n": cfg.eval.size})
    monkeypatch.setattr(vs_trl, "run_posttrain", lambda cfg, sft, work, steps: run_side(cfg, sft, work, steps))
    monkeypatch.setattr(vs_trl, "run_trl", run_side)
    out = tmp_path / "out.json"
    args = _parser().parse_args(["--quick", "--seeds", "2,5", "--work-dir", str(tmp_path / "w"), "--json", str(out)])
    assert vs_trl.run(args) == 0
    assert [(s, h) for s, h, _ in seen] == [(2, 2), (2, 2), (5, 2), (5, 2)]
    assert {w for _, _, w in seen} == {tmp_path / "w" / "seed_2", tmp_path / "w" / "seed_5"}
    res = json.loads(out.read_text())
    assert res["seeds"] == [2, 5] and [r["seed"] for r in res["runs"]] == [2, 5]
    assert all(r["heldout_seed"] == 2 for r in res["runs"]) and res["summary"]["heldout_seed"] == 2
    assert res["summary"]["speedup_vs_trl"] == pytest.approx(1.0)
    assert "held-out problems drawn with seed 2 for every seed" in capsys.readouterr().out
    with pytest.raises(UserError, match="seed= override"):
        vs_trl.run(_parser().parse_args(["--quick", "--seeds", "0,1", "--work-dir", str(tmp_path / "w"), "seed=3"]))
    seen.clear()  # a recipe that fixes its own held-out draw (smollm2_word_problems: eval.heldout_seed 0) keeps it
    args = _parser().parse_args(["--shape", "realistic", "--steps", "2", "--seeds", "2,5", "--work-dir",
                                 str(tmp_path / "r")])
    assert vs_trl.run(args) == 0
    assert [(s, h) for s, h, _ in seen] == [(2, 0), (2, 0), (5, 0), (5, 0)]


def test_the_bench_draws_heldout_problems_as_a_run_does() -> None:
    """``eval.heldout_seed`` chooses the bench's held-out problems as it chooses a run's (it was ignored: the bench
    drew them with the run's seed whatever the key said)."""
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config("demo", ["seed=1", "eval.heldout_seed=5", "eval.size=12"])
    task, held = vs_trl._heldout(cfg)
    assert [e.prompt_id for e in held] == [e.prompt_id for e in task.examples("heldout", 12, seed=5)]
    assert [e.prompt_id for e in held] != [e.prompt_id for e in task.examples("heldout", 12, seed=1)]


def test_quick_two_seeds_pair_real_outcomes(tmp_path: Path) -> None:
    """A real ``--quick --seeds 0,1`` (one RL step a side): both sides of both seeds are judged on the very same
    held-out problems, and the pooled estimate is the pooled accuracies' difference."""
    out = tmp_path / "out.json"
    args = _parser().parse_args(["--quick", "--steps", "1", "--threads", "1", "--seeds", "0,1", "--work-dir",
                                 str(tmp_path / "w"), "--json", str(out)])
    assert vs_trl.run(args) == 0
    res = json.loads(out.read_text())
    ids = {tuple(r[side]["heldout"]["outcomes"]["prompt_ids"]) for r in res["runs"] for side in ("posttrain", "trl")}
    assert len(ids) == 1 and len(next(iter(ids))) > 0
    pt = [c for r in res["runs"] for c in r["posttrain"]["heldout"]["outcomes"]["correct"]]
    trl = [c for r in res["runs"] for c in r["trl"]["heldout"]["outcomes"]["correct"]]
    n = sum(v for r in res["runs"] for v in r["trl"]["heldout"]["outcomes"]["valid"])
    pooled = res["summary"]["heldout_accuracy_diff"]
    assert pooled["estimate"] == pytest.approx((sum(pt) - sum(trl)) / n)
    assert pooled["low"] <= pooled["estimate"] <= pooled["high"]
