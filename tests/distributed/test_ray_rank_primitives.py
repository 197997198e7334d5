"""The Ray rank actors serve the learner primitives: with :class:`~posttrain.loop.backends.ray_learner.RayRanks`
as the transport of :class:`~posttrain.learner.ranks.LearnerRanks` (2 ddp ranks on the session's local cluster),
the RL program run from the driver over ``minibatch_plan`` / ``forward_backward`` (a ``prepare`` of the batch,
then one message per mini-batch) / ``optim_step`` equals one ``update`` command from the same start
(tests/learner/test_rank_primitives.py does the same over spawned rank processes; the program and its data are
tests/_rank_program.py).

Tolerance (tests/_tolerance.py): the program and the ``update`` command run the same code on the same shards, so
they agree within ``shape_rtol`` of the longest row (measured bitwise equal over spawned ranks).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _rank_program import KEYS, KW, micro_model, rl_advantages, rl_batch, rl_program, weights_of  # noqa: E402
from _tolerance import shape_rtol, update_rel_diff  # noqa: E402

from posttrain.learner.actor import PolicyLearner  # noqa: E402
from posttrain.learner.ranks import LearnerRanks  # noqa: E402


@pytest.mark.timeout(300)
def test_program_on_ray_rank_actors_equals_one_update_command(ray_env: Any) -> None:
    from posttrain.config.ray import RayBackendConfig
    from posttrain.loop.backends.ray_learner import RayRanks, ray_rank_starter

    batch = rl_batch()
    adv = rl_advantages(batch)
    old = PolicyLearner(micro_model(), **KW).compute_logprobs(batch)
    rtol = shape_rtol(int(batch.lengths.max()))
    # the session cluster has 2 CPUs, 1.25 reserved by its rollout and reward workers
    ray_cfg = RayBackendConfig(cpus_per_learner=0.25, startup_timeout_s=90)
    ranks = LearnerRanks(micro_model(), functools.partial(PolicyLearner, **KW), strategy="ddp", world_size=2,
                         temperature=1.0, kl_coef=0.05, rank_timeout_s=120, startup_timeout_s=120,
                         microbatch_tokens=KW["microbatch_tokens"], start_ranks=ray_rank_starter(ray_cfg))
    try:
        assert isinstance(ranks.transport, RayRanks)
        start, state = weights_of(ranks.model), ranks.state_dict()
        update = ranks.update(batch, adv, old_logprob=old).metrics
        update_weights, update_version = weights_of(ranks.model), ranks.version

        ranks.load_weights(start)  # back at the start: the driver copy and the rank actors
        ranks.load_state_dict(state)  # a stateless AdamW, the seeded generator, version 0
        program = rl_program(ranks, PolicyLearner(micro_model(), **KW), batch, adv, old)
    finally:
        ranks.close()

    d = update_rel_diff(program["weights"], update_weights, start)
    assert d <= rtol, d
    assert max(float((update_weights[k] - v).abs().max()) for k, v in start.items()) > 1e-4  # a real update
    for k in KEYS:
        assert program["metrics"][k] == pytest.approx(update[k], rel=rtol, abs=rtol), k
    assert ranks.version == update_version == 1
    assert program["metrics"]["optimizer_steps"] == update["optimizer_steps"] == 4  # 2 epochs x 2 mini-batches
    assert sorted(r for rows in program["plan"] for r in rows) == sorted(2 * list(range(batch.size)))
