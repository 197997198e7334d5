"""``eval.hidden_verifier`` (issue 15, part 3): an evaluation-only verifier re-judges every training
and held-out response; its verdicts sit beside the training verifier's in the ledger and metrics and
never reach the reward. The training verifier here passes every answer (_lenient_task:lenient, a
hackable reward by construction); the hidden one is the real integer check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.diagnostics.build import build_report
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.rewards.hidden import heldout_metrics, judge_trajectories
from posttrain.trajectory import Ledger, Status, make_trajectory

SMALL = ["model.path=builtin:micro", "task.name=_lenient_task:lenient", "task.kwargs={terms: 2}",
         "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=2", "optim.lr=1e-2",
         "eval.size=4", "eval.every=1", "eval.temperature=1.0", "logging.progress=false", "steps=1",
         "checkpoint_every=100", "sft.steps=0"]


def _run(tmp_path: Path, name: str, extra: list[str]) -> Path:
    d = tmp_path / name
    train(load_run_config("grpo", [*SMALL, f"run_dir={d}", *extra]))
    return d


def test_hidden_verdicts_recorded_beside_and_reward_untouched(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # _lenient_task
    with_h = _run(tmp_path, "hidden", ["eval.hidden_verifier=integer"])
    without = _run(tmp_path, "plain", [])
    a, b = (Ledger(d / "ledger").read_trajectories() for d in (with_h, without))
    assert len(a) == len(b) == 2 * 2
    for ta, tb in zip(a, b, strict=True):
        # the same samples, rewards and statuses: the hidden verifier never reached the run
        assert ta.token_ids.tolist() == tb.token_ids.tolist()
        assert ta.reward == tb.reward and ta.status == tb.status and ta.verifier == "pass_everything@1"
        np.testing.assert_array_equal(ta.advantage, tb.advantage)
        assert tb.hidden_status is None and tb.hidden_verifier is None
        assert ta.hidden_verifier == "integer@1" and ta.hidden_status is not None
        # the hidden verdict is the integer check of the recorded response against the reference
        resp, ref = str(ta.meta["response"]), str(ta.meta["reference"])
        try:
            right = int(resp.strip()) == int(ref)
        except ValueError:
            right = False
        assert (ta.hidden_status is Status.CORRECT) == right, (resp, ref, ta.hidden_status)
    metrics = [json.loads(line) for line in (with_h / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "heldout/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1]
    for m in evals:
        assert m["heldout/accuracy"] == 1.0 and m["heldout/hidden/infra_errors"] == 0.0
        # every held-out response passed training's verifier: each hidden failure is a disagreement
        assert m["heldout/hidden/train_pass_hidden_fail"] == pytest.approx(4 * (1 - m["heldout/hidden/accuracy"]))
    assert not any(k.startswith("heldout/hidden/") for m in
                   (json.loads(x) for x in (without / "metrics.jsonl").read_text().splitlines()) for k in m)
    # report lists passed-by-training, failed-by-hidden straight from the ledger (no --verifier)
    doc = build_report(with_h)
    listed = {(i["step"], i["traj_id"]) for i in doc["hidden_verifier"]["items"]}
    expected = {(s, t.traj_id) for s, t in Ledger(with_h / "ledger").iter_trajectories()
                if t.status is Status.CORRECT and t.hidden_status is not Status.CORRECT}
    assert doc["hidden_verifier"]["source"] == "ledger" and listed == expected
    assert len(expected) >= 3  # an untrained micro model rarely writes the right sum


def _t(i: int, response: str | None, reference: str = "5"):
    meta = {} if response is None else {"response": response, "reference": reference}
    return make_trajectory(traj_id=f"t{i}", prompt_id="p", group_id="g", prompt_ids=[1], action_ids=[2],
                           action_logprobs=[-1.0], action_versions=0, finish="terminal", status="correct",
                           verifier="x@1", meta=meta)


class Crashy:
    name, version = "crashy", "2"

    def verify(self, response, reference, **context):
        from posttrain.rewards.basic import IntegerVerifier

        if "7" in response:
            raise RuntimeError("backend down")
        return IntegerVerifier().verify(response, reference)


def test_judge_trajectories_marks_crashes_infra_error_and_skips_rows_without_text():
    out = judge_trajectories([_t(0, "5"), _t(1, "6"), _t(2, "7"), _t(3, None)], Crashy())
    assert [t.hidden_status for t in out] == [Status.CORRECT, Status.WRONG, Status.INFRA_ERROR, None]
    assert [t.hidden_verifier for t in out] == ["crashy@2"] * 3 + [None]
    assert all(t.status is Status.CORRECT and t.verifier == "x@1" for t in out)  # training verdicts untouched
    assert "backend down" in str(out[2].meta["hidden_explanation"])
    assert judge_trajectories([_t(0, "5")], None)[0].hidden_status is None


def test_heldout_metrics_by_hand():
    C, W, X = Status.CORRECT, Status.WRONG, Status.INFRA_ERROR
    m = heldout_metrics([C, C, W, C, W], [C, W, W, X, C])
    # hidden valid: C, W, W, C -> accuracy 2/4; both judged: pairs 0,1,2,4 -> agree on 0 and 2 -> 2/4
    assert m == {"accuracy": 0.5, "train_pass_hidden_fail": 1.0, "agreement": 0.5, "infra_errors": 1.0}
    with pytest.raises(ValueError):
        heldout_metrics([C], [])


@pytest.mark.parametrize("override, match", [
    (["eval.hidden_verifier=nope"], "eval.hidden_verifier: unknown verifier 'nope'"),
    (["eval.hidden_verifier=exact", "eval.hidden_verifier_kwargs={bogus: 1}"],
     r"eval.hidden_verifier_kwargs.bogus: unknown keyword of eval.hidden_verifier='exact' \(valid: "),
    # a wrong type is refused by the constructor's signature, not passed on (text for the int float_rounding)
    (["eval.hidden_verifier=math", "eval.hidden_verifier_kwargs={float_rounding: '6'}"],
     r"eval.hidden_verifier_kwargs.float_rounding: Input should be a valid integer, got '6' \(text"),
    (["eval.hidden_verifier=os:nope"], "eval.hidden_verifier: module 'os' has no attribute"),
    (["eval.hidden_verifier=os.path:sep"], "eval.hidden_verifier"),
    (["eval.hidden_verifier_kwargs={casefold: true}"], "eval.hidden_verifier is not"),
])
def test_bad_hidden_verifier_is_refused_at_config_load(override, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config("grpo", override)
