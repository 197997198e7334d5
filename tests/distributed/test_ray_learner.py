"""Learner ranks as Ray actors (``RayRanks`` behind ``LearnerRanks``) on the session's local cluster:
one fsdp2 x 2 update equals the embedded learner's, a killed rank actor is named with its node, and
the placement metrics (hand-computed). The multi-node run is test_ray_learner_cluster.py.

Tolerance: each rank runs a token-balanced share of the batch (other GEMM shapes than the single
process), so results agree up to ``shape_rtol`` of the longest row (tests/_tolerance.py); one AdamW
update as a whole within 100x that (the bound of test_distributed_learner.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import _distributed_helpers as helpers
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_scaled_close, shape_rtol, update_rel_diff  # noqa: E402

from posttrain.learner.ranks import LearnerRankError, LearnerRanks, placement_metrics  # noqa: E402

CFG = ["model.path=builtin:micro", "model.dtype=float64", "task.name=chain_sum", "task.kwargs={terms: 2}",
       "loss.kl_estimator=null", "loss.kl_coef=0.0", "loss.kl_target=null", "sft.steps=0",
       "optim.num_minibatches=1", "optim.microbatch_tokens=20", "learner.strategy=fsdp2", "learner.world_size=2"]


def test_placement_metrics_hand_computed() -> None:
    # places sorted: "node a (1.2.3.4)" -> 0, "node b (1.2.3.5)" -> 1
    got = placement_metrics({0: "node b (1.2.3.5)", 1: "node a (1.2.3.4)", 2: "node b (1.2.3.5)"})
    assert got == {"learner/nodes": 2.0, "learner/rank0_node": 1.0, "learner/rank1_node": 0.0,
                   "learner/rank2_node": 1.0}
    assert placement_metrics({0: "this machine", 1: "this machine"})["learner/nodes"] == 1.0


def _ray_ranks(cfg: Any, model: torch.nn.Module) -> LearnerRanks:
    from posttrain.config.ray import RayBackendConfig
    from posttrain.loop.backends.ray_learner import ray_rank_starter
    from posttrain.loop.builders import RankLearnerFactory

    # the session cluster has 2 CPUs, 1.25 reserved by its rollout and reward workers
    ray_cfg = RayBackendConfig(cpus_per_learner=0.25, startup_timeout_s=90)
    return LearnerRanks(model, RankLearnerFactory(cfg), strategy="fsdp2", world_size=2, temperature=1.0,
                        rank_timeout_s=120, startup_timeout_s=120, start_ranks=ray_rank_starter(ray_cfg))


@pytest.mark.timeout(300)
def test_ray_rank_actors_update_equals_the_embedded_learner(ray_env: Any) -> None:
    from posttrain.loop.builders import build_policy_learner
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config("grpo", CFG)
    batch, adv = helpers.ragged_batch(11), helpers.advantages(helpers.ragged_batch(11))
    rtol = shape_rtol(int(batch.lengths.max()))
    single = build_policy_learner(cfg, helpers.micro_learner_model())
    start = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    old_ref = single.compute_logprobs(batch)
    m_ref = single.update(batch, adv, old_logprob=old_ref)

    ranks = _ray_ranks(cfg, helpers.micro_learner_model())
    try:
        assert set(ranks.placement) == {0, 1} and all(w.startswith("node ") for w in ranks.placement.values())
        old = ranks.compute_logprobs(batch)
        assert_scaled_close(old, old_ref, rtol, "old log-probs")
        m = ranks.update(batch, adv, old_logprob=old)
        assert m_ref["grad_norm"] > 1e-4  # a real gradient
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=rtol)
        assert m["learner/nodes"] == 1.0 and m["learner/rank0_node"] == m["learner/rank1_node"] == 0.0
        d = update_rel_diff(ranks.model.state_dict(), single.model.state_dict(), start)
        assert d <= 100 * rtol, d
        assert "learner/nodes" not in ranks.update(batch, adv, old_logprob=ranks.compute_logprobs(batch))  # once

        # a rank actor that dies: the next call fails in one line naming the rank and its node
        import ray

        from posttrain.loop.backends.ray_learner import RayRanks

        assert isinstance(ranks.transport, RayRanks)
        ray.kill(ranks.transport.actors[1])
        with pytest.raises(LearnerRankError) as e:
            ranks.compute_logprobs(batch)
        msg = str(e.value)
        assert "\n" not in msg and "learner rank 1" in msg and ranks.placement[1] in msg, msg
        assert ranks.transport is None  # every rank killed, placement released
    finally:
        ranks.close()


def test_role_placement_metrics_hand_computed() -> None:
    from posttrain.loop.backends.ray_cluster import role_placement_metrics

    # node ids sorted: "a" -> 0, "b" -> 1
    got = role_placement_metrics({"rollout": ["b", "a"], "reward": ["b"]})
    assert got == {"placement/nodes": 2.0, "placement/reward/nodes": 1.0, "placement/reward/0": 1.0,
                   "placement/rollout/nodes": 2.0, "placement/rollout/0": 1.0, "placement/rollout/1": 0.0}


@pytest.mark.timeout(120)
def test_placement_reports_the_node_of_every_bundle(ray_env: Any) -> None:
    import ray

    from posttrain.config.ray import RayBackendConfig
    from posttrain.loop.backends.ray_cluster import Placement, bundle_node, learner_group

    cfg = RayBackendConfig(num_rollout_workers=2, num_reward_workers=1, cpus_per_rollout_worker=0.05,
                           cpus_per_reward_worker=0.05, cpus_per_learner=0.05, startup_timeout_s=60)
    here = ray.get_runtime_context().get_node_id()  # the session cluster has one node
    p = Placement(cfg)
    pg = learner_group(cfg, 2)
    try:
        assert p.where() == {"rollout": [here, here], "reward": [here]}
        assert [bundle_node(pg, i) for i in range(2)] == [here, here]
    finally:
        p.remove()
        ray.util.remove_placement_group(pg)
