"""``posttrain report`` and ``posttrain compare`` through their argparse registration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from posttrain.commands import compare, report
from tests.diagnostics.synthetic import CONFIG, write_run


def parse(module: Any, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.register(p.add_subparsers(dest="command"))
    return p.parse_args(argv)


def test_report_writes_json_html_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run")
    args = parse(report, ["report", str(run)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "loss often zero" in out and "by policy lag" in out
    doc = json.loads((run / "diagnostics" / "diagnostics.json").read_text())
    assert doc["trajectories"] == 4 and doc["steps"] == [1]
    flagged = {s["name"]: s["flagged"] for s in doc["symptoms"]}
    assert flagged["loss often zero"] is True  # loss exactly 0 in the one step
    html = (run / "diagnostics" / "report.html").read_text()
    assert "FLAGGED" in html and "no current-policy log-probs" in html
    pytest.importorskip("matplotlib")
    assert (run / "diagnostics" / "strata.png").stat().st_size > 0
    assert (run / "diagnostics" / "trends.png").stat().st_size > 0


def test_report_missing_dir_is_user_error(tmp_path: Path) -> None:
    args = parse(report, ["report", str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="nope"):
        args.func(args)


def _metrics(final_acc: float, tokens_per_step: float) -> list[dict[str, Any]]:
    return [{"step": 0, "heldout/accuracy": 0.1},
            {"step": 1, "tokens/generated": tokens_per_step, "time/step_s": 1.0, "heldout/accuracy": final_acc}]


def _seed_runs(root: Path, accs: list[float], tokens: float, **cfg_changes: Any) -> Path:
    for seed, acc in enumerate(accs):
        cfg = {**CONFIG, "seed": seed, **cfg_changes}
        write_run(root / f"seed{seed}", metrics=_metrics(acc, tokens), config=cfg)
    return root


def test_compare_reads_finished_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _seed_runs(tmp_path / "A", [0.4, 0.5], 100.0)
    b = _seed_runs(tmp_path / "B", [0.6, 0.5], 100.0, optim={"lr": 0.01})
    args = parse(compare, ["compare", str(a), str(b), "--budget-tokens", "100", "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "optim.lr: A=0.001, B=0.01" in out
    res = json.loads((tmp_path / "out" / "compare.json").read_text())
    d = res["diff_vs_baseline"]["B"]
    # paired differences 0.2 and 0.0: mean 0.1, sd sqrt(0.02), se 0.1, t(1) 12.706
    assert d["mean"] == pytest.approx(0.1) and d["high"] == pytest.approx(0.1 + 1.2706)
    assert res["accuracy"] == {"A": {"0": 0.4, "1": 0.5}, "B": {"0": 0.6, "1": 0.5}}


def test_compare_refuses_other_heldout_set_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _seed_runs(tmp_path / "A", [0.4], 100.0)
    b = _seed_runs(tmp_path / "B", [0.6], 50.0, eval={**CONFIG["eval"], "size": 99})
    args = parse(compare, ["compare", str(a), str(b), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="not comparable"):
        args.func(args)
    assert "REFUSED: held-out set differs" in capsys.readouterr().out
    args = parse(compare, ["compare", str(a), str(b), "--out", str(tmp_path / "out"), "--force"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy at 50 generated tokens" in out  # default budget: the smallest total
    # A evaluated at 0 and 100 tokens: at 50 it still holds its step-0 accuracy 0.1.
    assert "A: mean 0.100" in out and "B: mean 0.600" in out


def test_compare_needs_two(tmp_path: Path) -> None:
    args = parse(compare, ["compare", str(_seed_runs(tmp_path / "A", [0.4], 1.0))])
    with pytest.raises(ValueError, match="at least two"):
        args.func(args)


def test_compare_trains_missing_seeds_once_and_rejects_stale_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from posttrain.config import dump_config
    from posttrain.loop.validate import load_run_config

    calls: list[tuple[str, int, list[str]]] = []

    def fake_train(recipe: str, run_dir: Path, seed: int, overrides: list[str]) -> None:
        # Stands in for the `posttrain train` subprocess: the config it would resolve, a finished ledger.
        calls.append((recipe, seed, overrides))
        cfg = yaml.safe_load(dump_config(load_run_config(recipe, [*overrides, f"run_dir={run_dir}", f"seed={seed}"])))
        write_run(run_dir, metrics=_metrics(0.5, 10.0), config=cfg)

    monkeypatch.setattr(compare, "train_seed", fake_train)
    out = tmp_path / "out"
    got = compare.resolve(["grpo"], 2, out, ["steps=1"])
    assert got == {"grpo": [out / "grpo" / "seed0", out / "grpo" / "seed1"]}
    assert calls == [("grpo", 0, ["steps=1"]), ("grpo", 1, ["steps=1"])]
    assert compare.resolve(["grpo"], 2, out, ["steps=1"]) == got and len(calls) == 2  # finished: reused
    with pytest.raises(ValueError, match=r"seed0: finished run of grpo with other settings \(optim.lr\)"):
        compare.resolve(["grpo"], 2, out, ["steps=1", "optim.lr=0.5"])
