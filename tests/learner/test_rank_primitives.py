"""The learner ranks serve the primitives (``minibatch_plan`` / ``forward_backward`` / ``optim_step`` over the
rank transport): the RL program run from the driver over 2 gloo ranks (ddp and fsdp2, CPU) equals one
``update`` command on the same batch and start, and both equal the in-process PolicyLearner's update.

Tolerance (tests/_tolerance.py, as tests/distributed/test_distributed_learner.py): a rank runs its
token-balanced shard, other GEMM shapes than the single process, so results agree within
``shape_rtol(n)`` (``n`` the longest row) and whole AdamW updates within ``100 * shape_rtol(n)``. The
program and the ``update`` command run the same code on the same shards: measured bitwise equal here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _rank_program import KEYS, KW, rl_program  # noqa: E402
from _rank_program import micro_model as _model  # noqa: E402
from _rank_program import rl_advantages as _advantages  # noqa: E402
from _rank_program import rl_batch as _batch  # noqa: E402
from _rank_program import weights_of as _weights  # noqa: E402
from _tolerance import shape_rtol, update_rel_diff  # noqa: E402

from posttrain.algos.registry import CORRECTIONS  # noqa: E402
from posttrain.learner.actor import PolicyLearner  # noqa: E402
from posttrain.learner.primitives import ForwardBackwardOutput, ForwardSpec, LossBatch  # noqa: E402
from posttrain.learner.ranks import LearnerRankError, LearnerRanks  # noqa: E402


class _Unpicklable:
    """A token loss holding a lambda (pickle refuses it)."""

    spec = ForwardSpec()

    def __init__(self) -> None:
        self.fn = lambda x: x


@pytest.fixture(scope="module")
def in_process() -> dict[str, Any]:
    """The in-process learner: its update, and the same program over its primitives, from the same start."""
    batch, adv = _batch(), _advantages(_batch())
    learner = PolicyLearner(_model(), **KW)
    old = learner.compute_logprobs(batch)
    metrics = learner.update(batch, adv, old_logprob=old).metrics
    fresh = PolicyLearner(_model(), **KW)
    return {"batch": batch, "adv": adv, "old": old, "metrics": metrics, "weights": _weights(learner.model),
            "program": rl_program(fresh, fresh, batch, adv, old), "loss_source": PolicyLearner(_model(), **KW)}


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def on_ranks(request: pytest.FixtureRequest, in_process: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """2 gloo ranks: one ``update`` command; then, back at the start (weights and learner state restored),
    the program over the rank primitives; then the refusals and the driver-copy path, on the live ranks."""
    batch, adv, old = in_process["batch"], in_process["adv"], in_process["old"]
    ranks = LearnerRanks(_model(), functools.partial(PolicyLearner, **KW), strategy=request.param, world_size=2,
                         temperature=1.0, kl_coef=0.05, startup_timeout_s=240, rank_timeout_s=120,
                         microbatch_tokens=KW["microbatch_tokens"])
    try:
        start, state = _weights(ranks.model), ranks.state_dict()
        update = ranks.update(batch, adv, old_logprob=old).metrics
        got: dict[str, Any] = {"update": update, "update_weights": _weights(ranks.model),
                               "update_version": ranks.version, "update_checksum": ranks.last_weights_checksum}
        ranks.load_weights(start)  # the driver copy and the ranks
        ranks.load_state_dict(state)  # a stateless AdamW, the seeded generator, version 0
        got["program"] = rl_program(ranks, in_process["loss_source"], batch, adv, old)
        got["program_version"], got["program_steps"] = ranks.version, ranks.optimizer_steps
        got["program_checksum"] = ranks.last_weights_checksum
        # the ranks dropped the update's batch with its last step: the same tensors are sent again, not assumed
        got["after_update"] = [ranks.forward_backward(*got["program"]["last"])]
        ranks.update(batch, adv, old_logprob=old)  # the one-command update drops a parked batch too
        got["after_update"].append(ranks.forward_backward(*got["program"]["last"]))
        with pytest.raises(LearnerRankError) as e:
            ranks.forward_backward(LossBatch({"input_ids": batch.input_ids}, [0], 1.0), _Unpicklable())  # type: ignore[arg-type]
        got["unpicklable"] = str(e.value)
        with pytest.raises(LearnerRankError) as e:
            ranks.forward_backward_custom([0], object())  # type: ignore[arg-type]
        got["custom"] = str(e.value)
        got["alive_after_refusals"] = ranks.minibatch_plan(3)
        got["train_mode"] = _in_train_mode(ranks, got["program"]["last"])
        got["driver_path"] = _driver_copy_path(ranks)
        yield got
    finally:
        ranks.close()


def _in_train_mode(ranks: LearnerRanks, last: tuple[LossBatch, Any]) -> dict[str, Any]:
    """``forward_backward`` with the driver copy in train mode: still on the ranks (no gradient on the driver
    copy; the loss is the ranks' loss of the same batch and weights just before), the mode restored after."""
    ranks.model.train()
    try:
        out = ranks.forward_backward(*last)
    finally:
        ranks.model.eval()
    return {"loss": out.loss, "no_driver_grads": all(p.grad is None for p in ranks.model.parameters())}


def _driver_copy_path(ranks: LearnerRanks) -> dict[str, Any]:
    """The SFT warm-up through the ranks' handle (run_sft runs on ``ranks.driver_context()``, the driver copy:
    its gradients land there and the warm-up's own optimiser steps it) against the same warm-up of an in-process
    learner from the same weights; then the ranks' log-probs show they got the warmed-up weights."""
    from posttrain.learner.sft import run_sft

    def pairs(step: int) -> list[tuple[list[int], list[int]]]:
        return [([5 + step, 6, 7], [8, 9, 2]), ([11, 12], [13, 2])]

    local = PolicyLearner(_model(), **KW)
    local.model.load_state_dict(ranks.model.state_dict())
    got = {"ranks": run_sft(ranks, pairs, steps=3, lr=1e-2, pad_token_id=0),
           "local": run_sft(local, pairs, steps=3, lr=1e-2, pad_token_id=0)}
    got["weights_equal"] = all(torch.equal(v, local.model.state_dict()[k]) for k, v in ranks.model.state_dict().items())
    got["no_driver_grads"] = all(p.grad is None for p in ranks.model.parameters())
    batch = _batch()
    got["logprobs"] = (ranks.compute_logprobs(batch), local.compute_logprobs(batch))
    return got


def _rtol(in_process: dict[str, Any]) -> float:
    return shape_rtol(int(in_process["batch"].lengths.max()))


def test_program_on_ranks_equals_one_update_command(on_ranks: dict[str, Any], in_process: dict[str, Any]) -> None:
    start = _weights(_model())
    d = update_rel_diff(on_ranks["program"]["weights"], on_ranks["update_weights"], start)
    assert d <= _rtol(in_process), d  # the same code on the same shards (measured: 0)
    for k in KEYS:
        assert on_ranks["program"]["metrics"][k] == pytest.approx(on_ranks["update"][k], rel=_rtol(in_process),
                                                                  abs=_rtol(in_process)), k
    assert on_ranks["program_version"] == on_ranks["update_version"] == 1
    assert on_ranks["program_steps"] == on_ranks["update"]["optimizer_steps"] == 4
    assert on_ranks["program_checksum"] is not None


def test_ranks_equal_the_in_process_learner(on_ranks: dict[str, Any], in_process: dict[str, Any]) -> None:
    rtol, start = _rtol(in_process), _weights(_model())
    assert on_ranks["program"]["plan"] == in_process["program"]["plan"]  # the same seeded shuffle
    for got in (on_ranks["update_weights"], on_ranks["program"]["weights"]):
        assert update_rel_diff(got, in_process["weights"], start) <= 100 * rtol
    for k in KEYS:
        ref = in_process["metrics"][k]
        assert on_ranks["update"][k] == pytest.approx(ref, rel=rtol, abs=rtol), k
        assert on_ranks["program"]["metrics"][k] == pytest.approx(ref, rel=rtol, abs=rtol), k


def test_in_process_program_is_its_update(in_process: dict[str, Any]) -> None:
    """The program the ranks ran, on the in-process learner, is PolicyLearner.update exactly."""
    prog = in_process["program"]
    for k, v in in_process["weights"].items():
        assert torch.equal(prog["weights"][k], v), k
    for k in KEYS:
        assert prog["metrics"][k] == in_process["metrics"][k], k


def test_forward_backward_output_gathers_every_ranks_rows(on_ranks: dict[str, Any],
                                                          in_process: dict[str, Any]) -> None:
    rtol = _rtol(in_process)
    for got, ref in zip(on_ranks["program"]["outs"], in_process["program"]["outs"], strict=True):
        assert isinstance(got, ForwardBackwardOutput) and got.logprob is not None and ref.logprob is not None
        # every row of the mini-batch (its ranks' shards gathered); padding columns depend on the micro-batches
        rows = ~torch.isnan(ref.logprob).all(dim=1)
        assert torch.equal(~torch.isnan(got.logprob).all(dim=1), rows)
        seen = rows[:, None] & (in_process["batch"].action_mask > 0)
        assert not torch.isnan(got.logprob[seen]).any()
        assert torch.allclose(got.logprob[seen], ref.logprob[seen], rtol=rtol, atol=rtol)
        assert got.loss == pytest.approx(ref.loss, rel=rtol, abs=rtol)
        assert got.metrics["tokens"] == ref.metrics["tokens"]


def test_a_batch_is_sent_again_after_the_update_that_dropped_it(on_ranks: dict[str, Any]) -> None:
    for out in on_ranks["after_update"]:
        assert out.loss == out.loss and out.metrics["tokens"] == on_ranks["program"]["outs"][-1].metrics["tokens"]


def test_refusals_are_one_line_and_leave_the_ranks_running(on_ranks: dict[str, Any]) -> None:
    for msg in (on_ranks["unpicklable"], on_ranks["custom"]):
        assert "\n" not in msg, msg
    assert "_Unpicklable" in on_ranks["unpicklable"] and "pickle" in on_ranks["unpicklable"]
    assert "object" in on_ranks["custom"] and "in-process learner" in on_ranks["custom"]
    assert sorted(r for mb in on_ranks["alive_after_refusals"] for r in mb) == [0, 0, 1, 1, 2, 2]


def test_forward_backward_runs_on_the_ranks_whatever_the_driver_copys_mode(on_ranks: dict[str, Any]) -> None:
    """The driver copy in train mode no longer diverts ``forward_backward`` to it (the SFT warm-up asks for
    ``driver_context()`` instead): the gradients stay on the ranks, the loss is theirs, bitwise."""
    got = on_ranks["train_mode"]
    assert got["no_driver_grads"]
    assert got["loss"] == on_ranks["after_update"][-1].loss  # the same ranks, weights and batch


def test_sft_warmup_through_the_ranks_trains_the_driver_copy(on_ranks: dict[str, Any],
                                                             in_process: dict[str, Any]) -> None:
    got = on_ranks["driver_path"]
    assert got["ranks"] == got["local"] and got["ranks"][0] > got["ranks"][-1] > 0  # the same curve, falling
    assert got["weights_equal"] and got["no_driver_grads"]
    on_ranks_lp, local_lp = got["logprobs"]  # the ranks forward the warmed-up weights pushed to them
    assert torch.allclose(on_ranks_lp, local_lp, rtol=_rtol(in_process), atol=_rtol(in_process))


def test_policy_token_loss_pickles_for_every_registered_function() -> None:
    """The policy objective's functions pickle by reference (module-level registry functions)."""
    import pickle

    from posttrain.algos.registry import KL_ESTIMATORS, POLICY_LOSSES, REDUCTIONS

    for reg in (POLICY_LOSSES, REDUCTIONS, KL_ESTIMATORS, CORRECTIONS):
        for name, fn in reg.items():
            assert pickle.loads(pickle.dumps(fn)) is fn, (reg.kind, name)
    loss = PolicyLearner(_model(), **KW).policy_loss()
    back = pickle.loads(pickle.dumps(loss))
    assert back.objective == loss.objective and back.spec == loss.spec and back.diag_keys == loss.diag_keys
