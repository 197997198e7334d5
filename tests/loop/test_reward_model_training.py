"""``trainer: reward_model`` (Bradley-Terry on the toy sum_pairs file, builtin:tiny) learns to rank the chosen
response first; its ``reward_model/`` directory then scores RL responses as component ``rm`` beside the verifier's,
recorded in the ledger, and a scoring failure makes its trajectory ``infra_error`` (never a zero reward)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.loop.reward_model_training import (
    REWARD_MODEL_DIR,
    bradley_terry_loss,
    train_reward_model,
)
from posttrain.loop.validate import load_run_config
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.trajectory import Ledger, Role, Status


def test_bradley_terry_loss_by_hand() -> None:
    c, r = torch.tensor([0.0, 2.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    expect = [math.log(2.0), math.log1p(math.exp(-2.0)), math.log1p(math.exp(2.0))]
    assert bradley_terry_loss(c, r).tolist() == pytest.approx(expect, rel=1e-6)
    with pytest.raises(ValueError, match=r"\[B\]"):
        bradley_terry_loss(c[None], r[None])


def test_a_pair_longer_than_max_length_is_refused_naming_its_row() -> None:
    from posttrain.envs.preference_data import PreferencePair
    from posttrain.errors import UserError
    from posttrain.loop.reward_model_training import render_pairs
    from posttrain.models import build_char_tokenizer

    tok = build_char_tokenizer()
    ok = PreferencePair("f/0", "1+2=", "3", "x", {"source": "f.jsonl: row 0"})
    (tp,) = render_pairs([ok], tok, use_chat_template=False, max_length=8)
    assert (tp.chosen, tp.rejected) == ("1+2=3", "1+2=x")
    long = PreferencePair("f/1", "1+2=", "3" * 20, "x", {"source": "f.jsonl: row 1"})
    with pytest.raises(UserError, match=r"f.jsonl: row 1: prompt \+ response is \d+ tokens, over preference.max_length=8"):
        render_pairs([ok, long], tok, use_chat_template=False, max_length=8)


def test_rl_keys_are_refused_with_trainer_reward_model() -> None:
    from posttrain.config import ConfigError

    for key in ("sampling.group_size=3", "reward.model.path=x", "optim.ppo_epochs=2", "eval.size=5"):
        with pytest.raises(ConfigError, match=rf"{key.split('=')[0]}=.* cannot take effect: trainer=reward_model"):
            load_run_config("reward_model", [key])
    cfg = load_run_config("reward_model", ["task.chat_template=false", "eval.every=5", "optim.lr=1e-4"])
    assert cfg.trainer == "reward_model"


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rm") / "run"
    cfg = load_run_config("reward_model", [f"run_dir={d}", "steps=30", "logging.progress=false"])
    result = train_reward_model(cfg)
    assert result.step == 30
    return d


def test_heldout_pair_accuracy_rises_and_the_model_is_saved(rm_run: Path) -> None:
    evals = [m for m in map(json.loads, (rm_run / "metrics.jsonl").read_text().splitlines())
             if "heldout/pair_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 10, 20, 30]
    first, last = evals[0]["heldout/pair_accuracy"], evals[-1]["heldout/pair_accuracy"]
    assert first < 0.7 and last > 0.9, (first, last)  # random head ~0.35 -> ranks the sum above the junk
    assert evals[-1]["heldout/loss"] < evals[0]["heldout/loss"]
    scorer = RewardModelScorer.from_pretrained(rm_run / REWARD_MODEL_DIR)
    assert scorer.use_chat_template is False and scorer.max_length == 32  # the rendering it was trained with
    # prompts not in the file: the feature (digits only) carries over
    good, bad = scorer.score(["12+30=", "5+5="], ["42", "10"]), scorer.score(["12+30=", "5+5="], ["4x2", "ten"])
    assert all(g > b for g, b in zip(good, bad, strict=True)), (good, bad)


def _rl_overrides(run_dir: Path, rm_dir: Path, weight: float) -> list[str]:
    return ["model.path=builtin:tiny", "task.name=arithmetic", "task.kwargs={}", "sampling.prompts_per_step=4", "sampling.group_size=2",
            "sampling.max_new_tokens=3", "eval.size=4", "eval.every=2", "logging.progress=false", "steps=2",
            "checkpoint_every=0", "sft.steps=0", f"run_dir={run_dir}", f"reward.model.path={rm_dir}",
            "reward.model.batch_size=1", f"reward.model.weight={weight}"]


def _train(cfg) -> None:
    """RL through posttrain's own loop (loop/parts.py puts the learned rewards on the verification path)."""
    from posttrain.loop.training_loop import train

    train(cfg)


def test_rl_records_the_reward_model_score_beside_the_verifier(rm_run: Path, tmp_path: Path) -> None:
    d = tmp_path / "rl"
    cfg = load_run_config("grpo", _rl_overrides(d, rm_run / REWARD_MODEL_DIR, 0.5))
    assert cfg.reward.weights == {"task": 1.0, "rm": 0.5}
    _train(cfg)
    trajs = Ledger(d / "ledger").read_trajectories()
    assert len(trajs) == 2 * 4 * 2
    scorer = RewardModelScorer.from_pretrained(rm_run / REWARD_MODEL_DIR)
    for t in trajs:
        assert t.status is not Status.INFRA_ERROR
        comps = t.reward.components
        assert set(comps) >= {"task", "rm"}
        assert t.reward.total == pytest.approx(comps["task"] + 0.5 * comps["rm"], abs=1e-9)
        # the recorded score is the reward model's on (prompt, response): the prompt decoded from the record
        prompt = scorer.tokenizer.decode([int(i) for i, r in zip(t.token_ids, t.roles, strict=True) if r is Role.PROMPT],
                                         skip_special_tokens=True)
        assert "+" in prompt or "*" in prompt or "-" in prompt, prompt
        expect = scorer.score([prompt], [str(t.meta["response"])])[0]
        assert comps["rm"] == pytest.approx(expect, abs=1e-4), (prompt, t.meta["response"])


def test_a_failed_scoring_is_infra_error_never_zero(rm_run: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real_score = RewardModelScorer.score

    def flaky(self, prompts, responses):  # rows of prompts with a '+' and an even first operand fail
        if any(p.split("+")[0].isdigit() and int(p.split("+")[0]) % 2 == 0 for p in prompts if "+" in p):
            raise RuntimeError("reward model server fell over")
        return real_score(self, prompts, responses)

    monkeypatch.setattr(RewardModelScorer, "score", flaky)
    d = tmp_path / "rl_fail"
    _train(load_run_config("grpo", _rl_overrides(d, rm_run / REWARD_MODEL_DIR, 1.0)))
    trajs = Ledger(d / "ledger").read_trajectories()
    failed = [t for t in trajs if t.status is Status.INFRA_ERROR]
    ok = [t for t in trajs if t.status is not Status.INFRA_ERROR]
    assert failed and ok
    for t in failed:
        assert t.reward.total is None and not t.reward.components
        assert "reward model server fell over" in str(t.meta["explanation"])
    for t in ok:
        assert "rm" in t.reward.components


def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    """10 steps, then resume=true to 20: the same held-out curve as 20 steps at once (same pairs, same
    optimizer state; float tolerance: the two runs' forwards are the same shapes, on the same threads)."""
    base = ["logging.progress=false", "checkpoint_every=5", "eval.every=5"]
    whole = train_reward_model(load_run_config("reward_model", [*base, f"run_dir={tmp_path / 'a'}", "steps=20"]))
    train_reward_model(load_run_config("reward_model", [*base, f"run_dir={tmp_path / 'b'}", "steps=10"]))
    resumed = train_reward_model(load_run_config("reward_model", [*base, f"run_dir={tmp_path / 'b'}", "steps=20",
                                                                  "resume=true", "resume_force=true"]))
    assert resumed.step == 20 and [s for s, _ in resumed.curve] == [0, 5, 10, 15, 20]
    assert [v for _, v in resumed.curve] == pytest.approx([v for _, v in whole.curve], abs=1e-9)
    a = RewardModelScorer.from_pretrained(tmp_path / "a" / REWARD_MODEL_DIR).score(["1+2="], ["3"])
    b = RewardModelScorer.from_pretrained(tmp_path / "b" / REWARD_MODEL_DIR).score(["1+2="], ["3"])
    assert a == pytest.approx(b, abs=1e-5)


def test_rl_on_the_reward_model_alone_raises_its_score(rm_run: Path, tmp_path: Path) -> None:
    """GRPO with reward.weights={rm: 1} (no verifier weight) for 12 steps: the mean rm score of the sampled
    responses rises (measured: about -2.9 over steps 1-3 -> above 0 over steps 10-12). How it rises is the
    classic over-optimisation of a learned reward: docs/tasks_and_verifiers.md, "Learned rewards"."""
    import re

    d = tmp_path / "rl_rm_only"
    ov = [o for o in _rl_overrides(d, rm_run / REWARD_MODEL_DIR, 1.0) if not o.startswith(("steps=", "sampling."))]
    ov += ["steps=12", "sampling.prompts_per_step=8", "sampling.group_size=4", "sampling.max_new_tokens=3",
           "reward.weights={rm: 1.0}", "reward.model.batch_size=32", "eval.every=100", "optim.lr=1e-3"]
    _train(load_run_config("grpo", ov))
    by_step: dict[int, list[float]] = {}
    for t in Ledger(d / "ledger").read_trajectories():
        m = re.match(r"s(\d+)", t.traj_id)
        if m is not None and t.reward.total is not None:
            by_step.setdefault(int(m.group(1)), []).append(t.reward.components["rm"])
    mean = {s: sum(v) / len(v) for s, v in by_step.items()}
    first, last = sum(mean[s] for s in (1, 2, 3)) / 3, sum(mean[s] for s in (10, 11, 12)) / 3
    assert last > first + 1.5, (first, last, mean)
