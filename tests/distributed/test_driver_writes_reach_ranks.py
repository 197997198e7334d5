"""Writes of the driver copy outside the rank protocol reach the learner ranks because the writer says so
(posttrain/learner/protocol.py: ``load_weights`` / ``mark_driver_written``), not because the driver
watches its tensors: a rejected revision's restore (:class:`~posttrain.loop.promotion.Promotion` with the
learner) and a resume's ``restore_actor`` (:func:`posttrain.loop.checkpointing.restore`) leave the ranks
holding the restored weights.

On 2 gloo ``ddp`` ranks with the float64 micro model. "The ranks hold ``W``": the ranks' log-probs of a batch
(every rank forwards its shard; their sum is a collective, so both ranks' weights count) equal the in-process
learner's under ``W`` within ``shape_rtol`` (tests/_tolerance.py: other GEMM shapes than one process), while
the weights they held before are ~1e-2 away, far outside it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _distributed_helpers as helpers
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import scaled_maxdiff, shape_rtol  # noqa: E402

from posttrain.learner.actor import PolicyLearner  # noqa: E402
from posttrain.learner.checkpoint import save_checkpoint  # noqa: E402
from posttrain.learner.ranks import LearnerRanks  # noqa: E402
from posttrain.loop.checkpointing import RunState, restore  # noqa: E402
from posttrain.loop.lifecycle import RunClock  # noqa: E402
from posttrain.loop.promotion import Promotion  # noqa: E402
from posttrain.trajectory import TrajectoryBatch  # noqa: E402

KW: dict[str, Any] = dict(lr=1e-2, max_grad_norm=1.0, seed=3, microbatch_tokens=20)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _logprobs_under(weights: dict[str, torch.Tensor], batch: TrajectoryBatch) -> torch.Tensor:
    """The in-process learner's log-probs of ``batch`` under ``weights``."""
    model = helpers.micro_learner_model()
    model.load_state_dict(weights)
    return PolicyLearner(model, **KW).compute_logprobs(batch)


def _ranks_hold(ranks: LearnerRanks, weights: dict[str, torch.Tensor], batch: TrajectoryBatch) -> float:
    """``max|ranks' log-probs - log-probs under weights| / max|.|`` (0 up to rounding when the ranks hold them)."""
    return scaled_maxdiff(ranks.compute_logprobs(batch), _logprobs_under(weights, batch))


@pytest.fixture(scope="module")
def ranks() -> Iterator[LearnerRanks]:
    r = LearnerRanks(helpers.micro_learner_model(), functools.partial(PolicyLearner, **KW), strategy="ddp",
                     world_size=2, temperature=1.0, startup_timeout_s=240, rank_timeout_s=120,
                     microbatch_tokens=KW["microbatch_tokens"])
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def batch() -> TrajectoryBatch:
    return helpers.ragged_batch(11)


def _rtol(batch: TrajectoryBatch) -> float:
    return shape_rtol(int(batch.input_ids.shape[1]))  # float32: the attention softmax of a float64 model


def test_a_rejected_revision_restores_the_ranks_weights(ranks: LearnerRanks, batch: TrajectoryBatch) -> None:
    record = RunState()
    promotion = Promotion(ranks.model, record, reject_drop=0.1, learner=ranks)
    assert promotion.judge(0, 0.5)[0] == "promoted"
    promoted = _weights(ranks.model)
    ranks.update(batch, helpers.advantages(batch))  # the ranks and the driver copy move on
    trained = _weights(ranks.model)
    assert _ranks_hold(ranks, trained, batch) <= _rtol(batch)
    assert _ranks_hold(ranks, promoted, batch) > 100 * _rtol(batch)

    assert promotion.judge(1, 0.2)[0] == "rejected"
    assert all(torch.equal(v, promoted[k]) for k, v in ranks.model.state_dict().items())
    assert _ranks_hold(ranks, promoted, batch) <= _rtol(batch)  # pushed: not the trained weights any more
    assert record.decisions[-1]["decision"] == "rejected"


def test_a_resume_restores_the_ranks_weights(ranks: LearnerRanks, batch: TrajectoryBatch, tmp_path: Path) -> None:
    """:func:`~posttrain.loop.checkpointing.restore` of a checkpoint in the embedded learner's format (no shards):
    ``restore_actor`` writes the driver copy, then the ranks must take it (their optimizer state follows)."""
    saved = _weights(helpers.micro_learner_model(seed=5))
    other = helpers.micro_learner_model()
    other.load_state_dict(saved)
    path = save_checkpoint(tmp_path / "checkpoints" / "step_000003", step=3, actor=other,
                           learner_state={"learner": ranks.state_dict()},
                           extra={"run_state": dataclasses.asdict(RunState(step=3)), "engine_version": 3})
    assert _ranks_hold(ranks, saved, batch) > 100 * _rtol(batch)

    synced: list[int] = []
    engine = SimpleNamespace(update_weights=lambda weights, version: synced.append(version))
    parts = SimpleNamespace(learner=ranks, ref_model=None, critic=None, engine=engine)
    run = SimpleNamespace(teacher_fingerprint=None, state=RunState(), clock=RunClock(),
                          promotion=Promotion(ranks.model, RunState(), reject_drop=0.1, learner=ranks),
                          ledger=SimpleNamespace(discard_after=lambda step: []))
    restore(run, parts, path)  # type: ignore[arg-type]

    assert run.state.step == 3 and synced == [3]
    assert all(torch.equal(v, saved[k]) for k, v in ranks.model.state_dict().items())
    assert _ranks_hold(ranks, saved, batch) <= _rtol(batch)
