"""``loss.mask_truncated``: DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, sec. 3.4).

A row that ended truncated gets no loss token. Hand reference: with ``token_mean`` the masked batch's loss
and gradient are those of the batch without its truncated rows; with ``seq_mean_token_mean`` every row
still counts in ``B`` (the reductions' contract), so they are ``(B - k) / B`` times that. The tolerance is
shown to catch the bug this guards against (the switch ignored: truncated rows trained on).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from posttrain.learner.actor import PolicyLearner
from posttrain.trajectory import TrajectoryBatch, collate
from posttrain.trajectory.enums import Finish

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _micro_run import MICRO_RUN  # noqa: E402
from _tolerance import assert_grads_close, shape_rtol  # noqa: E402

CUT = (1, 6, 11)  # rows marked truncated


def _with_cut(batch: TrajectoryBatch, rows=CUT) -> TrajectoryBatch:
    trajs = [dataclasses.replace(t, finish=Finish.TRUNCATED) if i in rows else t
             for i, t in enumerate(batch.trajectories)]
    return collate(trajs, pad_token_id=batch.pad_token_id)


def _grads(model, batch, adv, **kw):
    learner = PolicyLearner(model, lr=1e-3, policy_loss="ppo_clip", microbatch_tokens=40, **kw)
    return learner.compute_gradients(batch, adv)  # pi_old = the current policy (frozen inside)


@pytest.mark.parametrize(("reduction", "scale"), [("token_mean", 1.0), ("seq_mean_token_mean", 13 / 16)])
def test_masked_rows_drop_out_of_the_loss(make_model, make_batch, make_advantages, reduction, scale):
    batch = _with_cut(make_batch(n=16))
    adv = make_advantages(batch)
    kept = [i for i in range(batch.size) if i not in CUT]
    loss_m, g_m = _grads(make_model(), batch, adv, reduction=reduction, mask_truncated=True)
    loss_r, g_r = _grads(make_model(), batch.select_rows(kept), adv[kept], reduction=reduction)
    assert max(float(g.abs().max()) for g in g_r.values()) > 1e-4
    rtol = shape_rtol(int(batch.lengths.max()))
    assert loss_m == pytest.approx(scale * loss_r, rel=rtol, abs=1e-12)
    assert_grads_close(g_m, {k: scale * v for k, v in g_r.items()}, rtol, msg=f"masked vs without ({reduction})")


def test_tolerance_catches_the_switch_ignored(make_model, make_batch, make_advantages):
    batch = _with_cut(make_batch(n=16))
    adv = make_advantages(batch)
    kept = [i for i in range(batch.size) if i not in CUT]
    _, g_off = _grads(make_model(), batch, adv, reduction="token_mean")  # truncated rows trained on
    _, g_r = _grads(make_model(), batch.select_rows(kept), adv[kept], reduction="token_mean")
    with pytest.raises(AssertionError):
        assert_grads_close(g_off, g_r, shape_rtol(int(batch.lengths.max())))


def test_only_truncated_rows_are_masked_and_they_are_counted(make_model, make_batch, make_advantages):
    batch = make_batch(n=16)
    assert all(t.finish is Finish.TERMINAL for t in batch.trajectories)
    adv = make_advantages(batch)
    _, g_on = _grads(make_model(), batch, adv, reduction="token_mean", mask_truncated=True)
    _, g_off = _grads(make_model(), batch, adv, reduction="token_mean")
    assert all(torch.equal(g_on[k], g_off[k]) for k in g_off)  # no truncated row: the same computation

    cut = _with_cut(batch)
    learner = PolicyLearner(make_model(), lr=1e-2, microbatch_tokens=40, mask_truncated=True)
    m = learner.update(cut, make_advantages(cut), fuse_old=True)
    assert m["truncated_rows_masked"] == 3.0
    # the masked rows are still forwarded and recorded (the ledger's pi_theta / pi_old), only not trained on
    assert m.current_logprob is not None and (m.current_logprob[list(CUT)] != 0).any()
    assert "truncated_rows_masked" not in PolicyLearner(make_model(), microbatch_tokens=40).update(
        cut, make_advantages(cut), fuse_old=True)


def test_a_run_masks_exactly_its_truncated_rows(tmp_path):
    """The recipe key reaches the learner: per step, ``truncated_rows_masked`` equals the ledger's count of
    rows that ended truncated (the random micro model rarely stops within 3 tokens)."""
    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory import Ledger

    run_dir = tmp_path / "run"
    train(load_run_config("grpo", [*MICRO_RUN, "sft.steps=0", "steps=2", "eval.size=4", "optim.num_minibatches=1",
                                   "loss.mask_truncated=true", f"run_dir={run_dir}"]))
    led = Ledger(run_dir / "ledger")
    cut_per_step: dict[int, int] = {}
    for step, t in led.iter_trajectories():
        cut_per_step[step] = cut_per_step.get(step, 0) + (t.finish is Finish.TRUNCATED)
    steps = [m for m in led.read_metrics() if "truncated_rows_masked" in m]
    assert len(steps) == 2 and sum(cut_per_step.values()) > 0
    for m in steps:
        assert m["truncated_rows_masked"] == cut_per_step[int(m["step"])], m["step"]
