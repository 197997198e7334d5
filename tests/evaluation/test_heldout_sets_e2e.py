"""A run whose task has two held-out sets, end to end on a micro model: each set is evaluated greedy and
sampled at every evaluation (``heldout/*``, ``heldout_unseen/*``, ``..._sampled/*``), ``posttrain eval`` of a
checkpoint reproduces both sets' records, and the per-problem outcomes give the report's and the rise lines'
bootstrap intervals.

The task (``two_sets_task.py``) is ``chain_sum`` with its held-out sums also written with spaces
(``"3 + 5="``), which training never shows. A short SFT warm-up teaches the sums; at step 0 the policy
answers some in-distribution problems (accuracy > 0) and does worse on the unseen spacing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.commands.train import print_rise
from posttrain.diagnostics.heldout_outcomes import read_outcomes
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

pytestmark = pytest.mark.timeout(600)

SETS = ("heldout", "heldout_sampled", "heldout_unseen", "heldout_unseen_sampled")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(Path(__file__).parent))
    run_dir = tmp_path_factory.mktemp("two_sets") / "run"
    overrides = ["model.path=builtin:micro", "task.name=two_sets_task:two_sets", "task.kwargs={terms: 2}",
                 "sft.steps=100", "sft.lr=1e-2", "sft.batch_size=32", "sampling.prompts_per_step=2",
                 "sampling.group_size=4", "sampling.max_new_tokens=4", "optim.lr=1e-3", "eval.size=16",
                 "eval.every=1", "eval.reject_drop=1.0", "eval.sampled_temperature=1.0", "logging.progress=false",
                 "steps=2", "checkpoint_every=2", f"run_dir={run_dir}"]
    train(load_run_config(None, overrides))
    yield run_dir, overrides
    mp.undo()


def _evaluations(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "heldout/accuracy" in r}


def test_every_held_out_set_is_evaluated_and_reproduced_by_eval(run, capsys):
    run_dir, _ = run
    rec = _evaluations(run_dir)
    assert sorted(rec) == [0, 1, 2]
    for row in rec.values():
        for s in SETS:
            assert sum(v for k, v in row.items() if k.startswith(f"{s}/status/")) == 16, (s, row)
            assert 0.0 <= row[f"{s}/accuracy"] <= 1.0
    # The warm-up taught the sums as training writes them: some right in-distribution, at step 0.
    assert rec[0]["heldout/accuracy"] > 0
    assert main(["eval", str(run_dir / "checkpoints" / "step_000002")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k for k in out if k.startswith("heldout")} == {k for k in rec[2] if k.startswith("heldout")}
    for k in (k for k in rec[2] if k.startswith("heldout")):
        if k.endswith("reward_mean"):
            assert out[k] == pytest.approx(rec[2][k], rel=1e-9), k
        else:  # counts over the same problems, the same engine and weights: equal
            assert out[k] == rec[2][k], k
    assert set(out["intervals_95"]) == set(SETS)
    lo, hi = out["intervals_95"]["heldout_unseen"]
    assert lo <= out["heldout_unseen/accuracy"] <= hi


def test_per_problem_outcomes_give_the_report_and_the_rise_their_intervals(run, capsys):
    run_dir, overrides = run
    rec = _evaluations(run_dir)
    outcomes = read_outcomes(run_dir)
    assert set(outcomes) == set(SETS)
    for s in SETS:
        assert sorted(outcomes[s]) == [0, 1, 2]
        for step, o in outcomes[s].items():
            assert len(o.prompt_ids) == 16 and o.accuracy == rec[step][f"{s}/accuracy"], (s, step)
    assert outcomes["heldout_unseen"][0].prompt_ids[0].endswith("/spaced")
    print_rise(load_run_config(None, overrides))
    lines = capsys.readouterr().out.splitlines()
    assert any(x.strip().startswith("in-distribution held-out accuracy (greedy): step 0") and "95% CI" in x
               for x in lines), lines
    assert any(x.strip().startswith("unseen held-out accuracy (sampled at T=1): step 0") and "95% CI" in x
               for x in lines), lines
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy, bootstrap 95% intervals over problems" in out and "unseen held-out accuracy" in out
    summary = json.loads((run_dir / "diagnostics" / "heldout_intervals.json").read_text())
    assert [a["key"] for a in summary] == [f"{s}/accuracy" for s in SETS]
    for a in summary:
        lo, hi = a["last"]["interval"]
        assert lo <= a["last"]["accuracy"] <= hi and a["rise_interval"] is not None and a["note"] == ""
