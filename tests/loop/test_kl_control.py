"""Issue 22, deliverable 1: the adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593) in both
places the KL can live -- the loss and, with ``credit.kl_in_reward``, the token rewards -- with a bounded
update (beta never <= 0), the applied beta logged as ``kl_coef`` and its state resumed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from posttrain.algos.kl import AdaptiveKLController
from posttrain.learner.actor import PolicyLearner
from posttrain.loop import targets as targets_module
from posttrain.loop.builders import build_learner, build_model
from posttrain.loop.kl_control import kl_coef_of, observe_kl
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

# 4 prompts x 2 samples = n = 8 samples per step; a learning rate of 0 keeps pi_theta = pi_old = pi_ref, so
# every observed KL is ~0 (< 0.8 * target): e = clip(0 / target - 1, -0.2, 0.2) = -0.2 at every step.
TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=4",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100",
        "logging.progress=false", "optim.lr=0.0", "loss.kl_estimator=k3"]
# The cases are built on the defaults (no shipped recipe), so a recipe's change cannot move these numbers.
# KL in the loss (grpo): beta0 0.05, target 0.01, horizon 1 sample. n / horizon = 8: the uncapped update
# multiplied by 1 - 0.2 * 8 = -0.6 (beta 0.05 -> -0.03 -> 0.018: the sign flips every step). Capped,
# K = min(8, 1) = 1 and the factor is 1 - 0.2 = 0.8: 0.05 -> 0.04 -> 0.032 (-> 0.0256 after step 3).
LOSS = ("loss", ["credit.estimator=grpo", "loss.kl_coef=0.05", "loss.kl_target=0.01", "loss.kl_horizon=1"],
        [0.05, 0.04, 0.032], 0.0256)
# KL in the reward (reinforce_pp): beta0 0.01, target 0.001, horizon 10 samples. K = 8 / 10 = 0.8, the
# factor is 1 - 0.8 * 0.2 = 0.84: 0.01 -> 0.0084 -> 0.007056 (-> 0.00592704 after step 3).
REWARD = ("reward", ["credit.estimator=reinforce_pp", "credit.kl_in_reward=true", "loss.kl_coef=0.01",
                    "loss.kl_target=0.001", "loss.kl_horizon=10"], [0.01, 0.0084, 0.007056], 0.00592704)


def _cfg(run_dir: Path, *extra: str) -> Any:
    return load_run_config(None, [*TINY, f"run_dir={run_dir}", *extra])


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) >= 1 and "kl_coef" in r]


def _record_applied(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The beta each step applied: the ``kl_coef`` handed to build_targets (KL in the reward) or the
    learner's coefficient when its update starts (KL in the loss; the update reads it per micro-batch)."""
    applied: list[float] = []
    real_targets, real_update = targets_module.build_targets, PolicyLearner.update

    def targets(batch: Any, **kw: Any) -> Any:
        if kw.get("kl_in_reward"):
            applied.append(float(kw["kl_coef"]))
        return real_targets(batch, **kw)

    def update(self: PolicyLearner, *a: Any, **kw: Any) -> Any:
        if self.kl_estimator_name is not None:
            applied.append(self.current_kl_coef())
        return real_update(self, *a, **kw)

    monkeypatch.setattr(targets_module, "build_targets", targets)
    monkeypatch.setattr(PolicyLearner, "update", update)
    return applied


@pytest.mark.parametrize("case", [LOSS, REWARD], ids=["loss", "reward"])
def test_adaptive_kl_run_hand_trajectory_logged_as_applied_and_resumed(tmp_path, monkeypatch, case) -> None:
    placement, keys, expected, after_last = case
    applied = _record_applied(monkeypatch)
    train(_cfg(tmp_path / "full", "steps=3", *keys))
    rows = _metrics(tmp_path / "full")
    assert [r["step"] for r in rows] == [1, 2, 3]
    kl_key = "kl/ref_mean" if placement == "reward" else "kl"
    assert all(abs(r[kl_key]) < 1e-6 for r in rows)  # lr = 0: the observed KL is ~0 (premise of the numbers)
    assert applied == pytest.approx(expected, rel=1e-12)  # the coefficient applied in loss / reward
    assert [r["kl_coef"] for r in rows] == pytest.approx(expected, rel=1e-12)  # logged = applied
    assert [r["kl_coef_next"] for r in rows] == pytest.approx([*expected[1:], after_last], rel=1e-12)
    assert all(r["kl_coef"] > 0 for r in rows)

    # Resume: 2 steps, then a resume to 3 restores the controller (step 3 applies 0.032 / 0.007056).
    applied.clear()
    train(_cfg(tmp_path / "resumed", "steps=2", *keys))
    train(_cfg(tmp_path / "resumed", "steps=3", "resume=true", *keys))
    assert applied == pytest.approx(expected, rel=1e-12)
    assert [r["kl_coef"] for r in _metrics(tmp_path / "resumed")] == pytest.approx(expected, rel=1e-12)


def test_kl_in_reward_learner_holds_the_controller_and_applies_no_kl_in_its_loss() -> None:
    cfg = load_run_config(None, [*TINY, *REWARD[1]])
    learner = build_learner(cfg, build_model(cfg)[1])
    assert isinstance(learner.kl_coef, AdaptiveKLController) and learner.kl_coef.value == 0.01
    assert learner.kl_estimator_name is None  # the KL is in the reward only, never twice
    assert learner.state_dict()["kl_controller"] == {"value": 0.01, "target_kl": 0.001, "horizon": 10.0}
    fixed_cfg = load_run_config(None, [*TINY, *REWARD[1][:3]])  # loss.kl_coef=0.01, no kl_target
    fixed = build_learner(fixed_cfg, build_model(fixed_cfg)[1])
    assert fixed.kl_coef == 0.01 and fixed.kl_estimator_name is None  # logged as kl_coef 0.01, not 0.0


def _run(kl_in_reward: bool, ctl: Any, n: int) -> Any:
    """A stand-in for what ``kl_coef_of`` / ``observe_kl`` are given: the learner's ``kl_coef``, the cfg."""
    cfg = SimpleNamespace(credit=SimpleNamespace(kl_in_reward=kl_in_reward),
                          loss=SimpleNamespace(kl_estimator="k3", kl_coef=0.05),
                          sampling=SimpleNamespace(prompts_per_step=n // 8, group_size=8))
    return SimpleNamespace(cfg=cfg, learner=SimpleNamespace(kl_coef=ctl))


@pytest.mark.parametrize("kl_in_reward", [False, True], ids=["loss", "reward"])
def test_observe_kl_hand_trajectory_above_and_below_target(kl_in_reward: bool) -> None:
    """The repro's settings (beta0 0.05, target 0.01, horizon 10, n = 32 x 8 = 256 samples, K = 1); the
    controller reads the KL its placement applies: ``kl`` (loss) or ``kl/ref_mean`` (reward)."""
    run = _run(kl_in_reward, AdaptiveKLController(0.05, 0.01, 10), 256)
    used, other = ("kl/ref_mean", "kl") if kl_in_reward else ("kl", "kl/ref_mean")
    # (observed KL in the used key, applied beta, next beta):
    #   0.5   : e = 49 -> 0.2,    0.05   * 1.2  = 0.06
    #   0.011 : e = 0.1,          0.06   * 1.1  = 0.066
    #   0.0   : e = -1 -> -0.2,   0.066  * 0.8  = 0.0528
    #   0.009 : e = -0.1,         0.0528 * 0.9  = 0.04752
    # The other key holds 7.0 (e would be +0.2): reading it would give 0.06 * 1.2 = 0.072 at step 2.
    steps = [(0.5, 0.05, 0.06), (0.011, 0.06, 0.066), (0.0, 0.066, 0.0528), (0.009, 0.0528, 0.04752)]
    for kl, beta, nxt in steps:
        assert kl_coef_of(run.learner.kl_coef) == pytest.approx(beta, rel=1e-12)  # the beta applied
        metrics = {used: kl, other: 7.0, "kl_coef": beta}
        observe_kl(run.learner.kl_coef, run.cfg, metrics)
        assert metrics["kl_coef"] == pytest.approx(beta, rel=1e-12)  # logged: the beta applied this step
        assert metrics["kl_coef_next"] == pytest.approx(nxt, rel=1e-12)
