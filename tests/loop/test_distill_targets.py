"""On-policy distillation's pieces (``loss.distill``): the per-token signal in the targets, the teacher's
log-probs frozen on the batch and recorded in the ledger, the teacher built and checked against the
student's tokenizer, and the preflight's refusals. (The run end to end: test_distill_run.py.)"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol  # noqa: E402

from posttrain.config import ConfigError  # noqa: E402
from posttrain.config.algorithm import DistillConfig
from posttrain.loop.builders import build_teacher, check_same_tokenizer
from posttrain.loop.preflight import check_distill, preflight
from posttrain.loop.targets import build_targets, distill_metrics
from posttrain.loop.validate import load_run_config
from posttrain.models import build_char_tokenizer, build_tiny_model
from posttrain.trajectory import Finish, Ledger, Reward, Status, collate
from posttrain.trajectory.collate import with_update_record
from posttrain.trajectory.record import make_trajectory

D = torch.float64


def _batch(rewards: tuple[float, ...] = (1.0, 0.0)):
    """One group: 2 prompt tokens + 3 action tokens per row."""
    trajs = [make_trajectory(traj_id=f"t{i}", prompt_id="p", group_id="g", prompt_ids=[1, 2], action_ids=[3, 4, 5],
                             action_logprobs=[-0.5] * 3, action_versions=0, finish=Finish.TERMINAL,
                             status=Status.CORRECT if r else Status.WRONG,
                             reward=Reward(components={"task": r}, weights={"task": 1.0}, total=r))
             for i, r in enumerate(rewards)]
    return collate(trajs)


# pi_old and the teacher on the 3 action tokens of each row (positions 2..4; 0 on the prompt)
OLD = torch.tensor([[0, 0, -1.0, -3.0, -0.25], [0, 0, -0.5, -0.5, -2.0]], dtype=D)
TEACHER = torch.tensor([[0, 0, -2.0, -0.5, -0.25], [0, 0, -0.5, -1.5, -0.1]], dtype=D)
# -coef * (old - teacher), coef 2, by hand:
#   row 0: -2 * (-1 + 2) = -2; -2 * (-3 + 0.5) = 5; -2 * 0 = 0
#   row 1: 0; -2 * (-0.5 + 1.5) = -2; -2 * (-2 + 0.1) = 3.8
DISTILL = torch.tensor([[0, 0, -2.0, 5.0, 0.0], [0, 0, 0.0, -2.0, 3.8]], dtype=D)


def test_distill_only_advantage_is_the_hand_computed_reverse_kl_signal() -> None:
    batch = _batch().freeze("old", OLD, 0).freeze("teacher", TEACHER)
    tg = build_targets(batch, distill_coef=2.0, distill_only=True)
    assert torch.allclose(tg.advantages, DISTILL, rtol=0, atol=1e-15)
    assert tg.returns is None
    assert torch.allclose(tg.teacher_kl, -DISTILL / 2.0, rtol=0, atol=1e-15)
    m = distill_metrics(tg, batch)
    # per-token k1 estimate over the 6 action tokens: (1 - 2.5 + 0 + 0 + 1 - 1.9) / 6 = -0.2333...
    assert m["distill/reverse_kl_mean"] == pytest.approx((1 - 2.5 + 0 + 0 + 1 - 1.9) / 6, abs=1e-12)
    # per sequence: row 0 sums to -1.5, row 1 to -0.9 -> mean -1.2
    assert m["distill/reverse_kl_seq_mean"] == pytest.approx(-1.2, abs=1e-12)


def test_distill_is_added_to_the_verifiable_reward_advantage() -> None:
    batch = _batch().freeze("old", OLD, 0).freeze("teacher", TEACHER)
    # GRPO without std division on rewards (1, 0): +0.5 / -0.5 on every action token
    tg = build_targets(batch, estimator="grpo", estimator_kwargs={"norm_std": False}, distill_coef=2.0)
    mask = batch.action_mask.to(D)
    expected = torch.tensor([[0.5], [-0.5]], dtype=D) * mask + DISTILL
    assert torch.allclose(tg.advantages.to(D), expected, rtol=0, atol=1e-12)
    # without loss.distill the targets are the estimator's alone, and no distill metric is logged
    plain = build_targets(batch, estimator="grpo", estimator_kwargs={"norm_std": False})
    assert plain.teacher_kl is None and distill_metrics(plain, batch) == {}


def test_teacher_equal_to_student_gives_zero_signal() -> None:
    batch = _batch((1.0, 1.0)).freeze("old", OLD, 0).freeze("teacher", OLD.clone())
    tg = build_targets(batch, distill_coef=1.0, distill_only=True)
    assert float(tg.advantages.abs().max()) <= shape_rtol(1, D)
    assert distill_metrics(tg, batch)["distill/reverse_kl_mean"] == 0.0


def test_distill_needs_pi_old_and_the_teacher() -> None:
    with pytest.raises(ValueError, match="loss.distill needs pi_old and the teacher"):
        build_targets(_batch().freeze("old", OLD, 0), distill_coef=1.0)
    with pytest.raises(ValueError, match="loss.distill needs pi_old and the teacher"):
        build_targets(_batch().freeze("teacher", TEACHER), distill_coef=1.0)
    with pytest.raises(ValueError, match="teacher's log-probs have no version"):
        _batch().freeze("teacher", TEACHER, 3)
    with pytest.raises(ValueError, match="needs the version"):
        _batch().freeze("old", OLD)


def test_teacher_logprobs_reach_the_ledger(tmp_path: Path) -> None:
    batch = _batch().freeze("old", OLD, 0).freeze("teacher", TEACHER)
    tg = build_targets(batch, distill_coef=2.0, distill_only=True)
    trajs = with_update_record(batch, None, tg.advantages)
    led = Ledger(tmp_path / "ledger")
    led.write_trajectories(1, trajs)
    back = led.read_trajectories()
    for t, row in zip(back, TEACHER, strict=True):
        assert t.teacher_logprob is not None and t.teacher_logprob.tolist() == row.tolist()
        assert t.old_version == 0 and t.ref_logprob is None
    # collated again from the records, the batch carries the teacher (every row has it)
    assert torch.equal(collate(back).teacher_logprob, TEACHER)  # stored and read back, no arithmetic
    # a record whose teacher log-prob is positive on an action token is refused like any log-prob
    with pytest.raises(ValueError, match="teacher_logprob"):
        back[0].replace(teacher_logprob=np.array([0, 0, 0.5, -1, -1]))


def _saved_char_tokenizer(path: Path, swap: tuple[str, str] | None = None) -> Path:
    """The char tokenizer saved to ``path`` (as a checkpoint's actor/ holds it), optionally with the
    ids of two tokens swapped in its vocabulary."""
    build_char_tokenizer().save_pretrained(str(path))
    if swap is not None:
        f = path / "tokenizer.json"
        doc = json.loads(f.read_text())
        vocab = doc["model"]["vocab"]
        vocab[swap[0]], vocab[swap[1]] = vocab[swap[1]], vocab[swap[0]]
        f.write_text(json.dumps(doc))
    return path


def test_tokenizer_mismatch_is_refused_before_the_run_naming_both(tmp_path: Path) -> None:
    teacher = _saved_char_tokenizer(tmp_path / "teacher", swap=("a", "b"))
    cfg = load_run_config("distill", ["model.path=builtin:micro", f"loss.distill.teacher={teacher}",
                                      f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert f"loss.distill.teacher={teacher}" in msg and "model.path=builtin:micro" in msg
    assert "token 'a'" in msg
    assert not (tmp_path / "run").exists()  # refused before anything is written
    # the same tokenizer, saved as a checkpoint saves it, passes
    same = _saved_char_tokenizer(tmp_path / "same")
    check_distill(cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"distill": DistillConfig(
        teacher=str(same))})}))


def test_check_same_tokenizer_compares_size_and_eos() -> None:
    a, b = build_char_tokenizer(), build_char_tokenizer()
    b.add_tokens(["<extra>"])
    with pytest.raises(ConfigError, match=r"loss.distill.teacher=T: .*\(model.path=S\): vocabulary size 107 vs 106"):
        check_same_tokenizer(a, b, student_path="S", teacher_path="T")


@pytest.mark.parametrize(("override", "key"), [
    ("critic.enabled=true", "critic.enabled"),
    ("credit.estimator=rloo", "credit.estimator"),
    ("credit.kwargs={norm_std: false}", "credit.kwargs"),
    ("sampling.dynamic_sampling=true", "sampling.dynamic_sampling"),
])
def test_distill_only_refuses_keys_it_leaves_without_effect(tmp_path: Path, override: str, key: str) -> None:
    # refused at load (config/dead_settings.py RULES, issue 38), before the preflight builds anything
    with pytest.raises(ConfigError, match=rf": {key}=.* cannot take effect: loss.distill.only=true"):
        load_run_config("distill", ["model.path=builtin:micro", "loss.distill.teacher=builtin:micro", override,
                                    f"run_dir={tmp_path}"])
    assert not tmp_path.joinpath("config.yaml").exists()


def test_missing_teacher_directory_and_empty_teacher_are_refused(tmp_path: Path) -> None:
    cfg = load_run_config("distill", ["model.path=builtin:micro", f"loss.distill.teacher={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="nope: no such directory"):
        check_distill(cfg)
    with pytest.raises(ValueError, match="loss.distill.teacher is empty"):
        load_run_config("distill", ["loss.distill.teacher='  '"])
    with pytest.raises(ValueError, match="coef"):
        load_run_config("distill", ["loss.distill.coef=0"])


def test_distill_recipe_dry_builds_its_targets() -> None:
    # the shipped recipe's step (distill only) builds finite [B, T] advantages on the preflight's fake batch
    from posttrain.loop.preflight import check_targets

    check_targets(load_run_config("distill", ["loss.distill.teacher=builtin:micro"]))
    check_targets(load_run_config("distill", ["loss.distill={teacher: builtin:micro, only: false}"]))


def test_build_teacher_is_frozen_and_equals_the_student_for_the_same_builtin() -> None:
    cfg = load_run_config("distill", ["model.path=builtin:micro", "loss.distill.teacher=builtin:micro",
                                      "model.init_seed=3"])
    teacher = build_teacher(cfg, build_char_tokenizer())
    assert teacher is not None and not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    student = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=3)
    for (k, a), b in zip(teacher.state_dict().items(), student.state_dict().values(), strict=True):
        assert torch.equal(a, b), k  # the same seeded init by the same code: equal bit for bit by construction
    assert build_teacher(load_run_config("grpo", []), build_char_tokenizer()) is None


def test_distill_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="temperature"):
        load_run_config("distill", ["loss.distill.temperature=2"])
    assert math.isclose(load_run_config("distill", ["loss.distill.coef=0.5"]).loss.distill.coef, 0.5)
