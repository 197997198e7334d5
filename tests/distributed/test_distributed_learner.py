"""Data-parallel learner (2 gloo ranks on 127.0.0.1, a PolicyLearner with the ProcessGroupSync hook):
gradients, log-probs and one update equal the single-process ones on the same batch (float64, tight
tolerance)."""

from __future__ import annotations

import sys
from pathlib import Path

import _distributed_helpers as helpers
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, assert_scaled_close, shape_rtol, update_rel_diff  # noqa: E402

REDUCTIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@pytest.fixture(scope="module")
def rank_outputs(tmp_path_factory):
    """One 2-rank run (spawn + gloo on 127.0.0.1) covering every reduction of REDUCTIONS."""
    out = tmp_path_factory.mktemp("ranks")
    # 11 rows: shards of unequal size (6 + 5) in the whole batch and in each of the 2 mini-batches.
    helpers.run_ranks(helpers.rank_main, 2, REDUCTIONS, 11, str(out), timeout_s=150)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_two_ranks_equal_single_process(rank_outputs, reduction):
    ref = helpers.single_process_reference(reduction, 11)
    outs = [torch.load(rank_outputs / f"{reduction}-rank{r}.pt", weights_only=False) for r in range(2)]
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e-4  # a real gradient
    # Each rank runs its shard (other batch shapes than the single process): equal up to float
    # rounding (tests/_tolerance.py); a missing or wrong all-reduce moves results by >= 1e-3
    # (test_shard_gradients_alone_differ, test_wrong_reduction_is_caught).
    rtol = shape_rtol(int(helpers.ragged_batch(11).lengths.max()))
    start = helpers.micro_learner_model().state_dict()
    for out in outs:
        assert_scaled_close(out["old"], ref["old"], rtol, "old log-probs")
        assert out["loss"] == pytest.approx(ref["loss"], rel=rtol)
        assert_grads_close(out["grads"], ref["grads"], rtol)
        # Adam amplifies rounding on near-eps gradient elements: whole updates, 100x (see test_actor).
        assert update_rel_diff(out["weights"], ref["weights"], start) <= 100 * rtol
        for k in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "ratio_min", "ratio_max", "tokens_trained",
                  "grad_norm", "clip_frac_low", "clip_frac_high"):
            assert out["metrics"][k] == pytest.approx(ref["metrics"][k], rel=rtol, abs=rtol), k
    # the ranks hold bitwise-identical weights after the update
    for name in ref["weights"]:
        assert torch.equal(outs[0]["weights"][name], outs[1]["weights"][name]), name


def test_shard_gradients_alone_differ():
    """The test can fail: one rank's shard alone (no all-reduce) is not the full gradient."""
    from posttrain.learner.actor import PolicyLearner

    batch = helpers.ragged_batch(11)
    adv = helpers.advantages(batch)
    full = PolicyLearner(helpers.micro_learner_model(), lr=1e-2).compute_gradients(batch, adv)[1]
    half = batch.select_rows(list(range(0, 11, 2)))
    part = PolicyLearner(helpers.micro_learner_model(), lr=1e-2).compute_gradients(half, adv[0::2])[1]
    with pytest.raises(AssertionError):
        assert_grads_close(part, full, 100 * shape_rtol(int(batch.lengths.max())))


def test_wrong_reduction_is_caught():
    """The rank tolerance catches a sum where a mean belongs: twice the gradient of 2 equal shards."""
    from posttrain.learner.actor import PolicyLearner

    batch = helpers.ragged_batch(11)
    adv = helpers.advantages(batch)
    full = PolicyLearner(helpers.micro_learner_model(), lr=1e-2).compute_gradients(batch, adv)[1]
    summed = {k: 2 * v for k, v in full.items()}
    with pytest.raises(AssertionError):
        assert_grads_close(summed, full, 100 * shape_rtol(int(batch.lengths.max())))


def test_needs_process_group():
    from posttrain.learner.distributed import ProcessGroupSync, ShardedSync

    for hook in (ProcessGroupSync, ShardedSync):
        with pytest.raises(RuntimeError, match="process group"):
            hook()


def test_gradient_hooks_meet_the_protocol():
    """Data parallelism plugs in through the documented GradientSync hook (no learner subclass)."""
    from posttrain.learner.distributed import DropRankShare, ProcessGroupSync, ShardedSync
    from posttrain.learner.grad_sync import GradientSync, LocalSync

    assert isinstance(LocalSync(), GradientSync)
    for hook in (ProcessGroupSync, ShardedSync, DropRankShare):
        assert all(callable(getattr(hook, m, None)) for m in ("shard", "reduce_gradients", "reduce_sums",
                                                              "reduce_min")), hook
