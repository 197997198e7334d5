"""``learner.precision=bf16`` on CPU: bf16 autocast compute over float32 master weights, where the CPU multiplies
bf16 natively (issue 41). The weights and optimizer state stay float32; the learner's log-probs move by the
bf16 rounding (~1e-2), which the run's |log kappa| against an fp32 engine shows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from posttrain.learner.actor import PolicyLearner
from posttrain.loop.builders import build_learner, build_model
from posttrain.loop.validate import load_run_config
from posttrain.rollout import precision as P
from posttrain.trajectory import TrajectoryBatch


def test_cpu_bf16_learner_autocasts_and_keeps_float32_weights(monkeypatch: pytest.MonkeyPatch,
                                                                make_batch: Callable[..., TrajectoryBatch]) -> None:
    monkeypatch.setattr(P, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))  # the config check, not the numerics
    batch = make_batch(n=8)
    lp = {}
    for prec in ("fp32", "bf16"):
        cfg = load_run_config("grpo", ["model.path=builtin:tiny", f"learner.precision={prec}"])
        _, model = build_model(cfg)
        learner = build_learner(cfg, model)
        assert isinstance(learner, PolicyLearner)
        assert learner.autocast_dtype == (torch.bfloat16 if prec == "bf16" else None)
        lp[prec] = learner.compute_logprobs(batch)
        assert next(model.parameters()).dtype == torch.float32  # master weights stay float32
    mask = batch.action_mask.bool()
    d = (lp["bf16"] - lp["fp32"]).abs()[mask]
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 per product): log-probs move by ~1e-3..1e-2;
    # without autocast the two agree to float32 rounding (~1e-6), so 1e-4 separates the two.
    assert float(d.mean()) > 1e-4, float(d.mean())
    assert float(d.max()) < 0.5


def test_cpu_bf16_learner_trains_and_the_ledger_shows_the_mismatch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One grpo step, fp32 engine against a bf16 learner: |log kappa| is far above the fp32 pair's (< 1e-4,
    tests/rollout/test_engine_precision.py)."""
    from posttrain.cli import main

    monkeypatch.setattr(P, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))  # the config check, not the numerics
    run = tmp_path / "bf16"
    assert main(["train", "grpo", "model.path=builtin:tiny", "steps=1", "sft.steps=0", "eval.every=100", "eval.size=8",
                 "learner.precision=bf16", f"run_dir={run}", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kappa = [r["logkappa_abs_mean"] for r in rows if "logkappa_abs_mean" in r]
    # bf16 learner vs fp32 engine: ~1e-3 on the untrained tiny model; an fp32 pair gives ~3e-7 (float32 rounding)
    assert kappa and min(kappa) > 2e-4, kappa
