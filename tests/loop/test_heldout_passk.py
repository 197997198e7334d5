"""pass@k in held-out evaluation: the unbiased estimator against hand-computed cases, and end to
end through ``evaluate`` with a stub engine and verifier (infra errors leave n)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from posttrain.config import ConfigError
from posttrain.loop.heldout import evaluate, pass_at_k
from posttrain.loop.validate import load_run_config
from posttrain.rewards import Verdict
from posttrain.rollout.types import Completion
from posttrain.trajectory import Status
from tests.loop._heldout_stubs import CodePointTokenizer, Example, StubTask


def test_pass_at_k_hand_computed() -> None:
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2) = 0.5
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(3, 0, 2) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c = 1 < k: every pair holds a correct one
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 = c / n
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


class _Tok(CodePointTokenizer):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return f"s{ids[0]}"


class _Engine:
    """Sample j of every request is the single token j (returned in reverse order, like a shuffled engine)."""

    def generate(self, reqs: list[Any]) -> list[Completion]:
        out = [Completion(request_id=r.request_id, sample_index=j, prompt_ids=r.prompt_ids, token_ids=[j],
                          logprobs=[0.0], versions=[0], finish_reason="eos")
               for r in reqs for j in range(r.params.n)]
        return out[::-1]


@dataclasses.dataclass(frozen=True)
class _Verifier:
    """Reference ``(c, broken)``: sample j is correct iff j < c; sample ``broken`` raises (infra error)."""

    name: str = "stub"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        c, broken = reference
        j = int(response[1:])
        if j == broken:
            raise RuntimeError("verifier down")
        ok = j < c
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)})


TASK = StubTask(_Verifier())


def test_evaluate_reports_pass_at_k_excluding_infra_errors() -> None:
    examples = [Example("a", "a", (1, -1)), Example("b", "b", (0, -1)), Example("c", "c", (2, 3))]
    res = evaluate(_Engine(), _Tok(), TASK, examples, max_new_tokens=1, temperature=1.0, samples=4, k=2)
    assert res.per_prompt == ((4, 1), (4, 0), (3, 2))  # prompt c: sample 3 is an infra error, n = 3
    m = res.passk_metrics()
    # a: 1 - C(3,2)/C(4,2) = 0.5; b: 0; c: n - c = 1 < 2 -> 1.  Mean 0.5.
    assert m["heldout/pass@2"] == pytest.approx(0.5)
    # pass@1 = mean of c/n: (1/4 + 0 + 2/3) / 3
    assert m["heldout/pass@1"] == pytest.approx((0.25 + 0 + 2 / 3) / 3)
    assert m["heldout/pass@2_prompts_skipped"] == 0.0
    assert res.infra_errors == 1
    assert res.accuracy == pytest.approx(3 / 11)  # correct / non-infra responses
    assert res.as_metrics()["heldout/infra_errors"] == 1.0


def test_prompt_with_fewer_valid_samples_than_k_is_skipped_and_counted() -> None:
    examples = [Example("a", "a", (1, 0)), Example("b", "b", (2, -1))]  # a: sample 0 raises -> n=1 < k=2
    m = evaluate(_Engine(), _Tok(), TASK, examples, max_new_tokens=1, temperature=1.0, samples=2, k=2).passk_metrics()
    assert m["heldout/pass@2_prompts_skipped"] == 1.0
    assert m["heldout/pass@2"] == 1.0  # b: both correct
    assert m["heldout/pass@1"] == pytest.approx((0.0 + 1.0) / 2)  # a: 0 of 1 valid; b: 2 of 2


def test_config_pass_at_k_keys() -> None:
    cfg = load_run_config(None, ["eval.k=4", "eval.sampled_temperature=1.0"])
    assert cfg.eval.samples == 4  # default n = k
    assert load_run_config(None, ["eval.k=2", "eval.samples=8", "eval.temperature=0.7"]).eval.samples == 8
    with pytest.raises(ConfigError, match=r"eval.samples=1 must be >= eval.k=2"):
        load_run_config(None, ["eval.k=2", "eval.samples=1", "eval.sampled_temperature=1.0"])
    with pytest.raises(ConfigError, match=r"eval.samples=4 needs sampled responses"):
        load_run_config(None, ["eval.k=4"])
    assert math.isclose(load_run_config(None, []).eval.samples, 1)


def test_run_logs_heldout_pass_at_k(tmp_path) -> None:
    """From the recipe keys: a micro run logs heldout/pass@k from the sampled held-out evaluation."""
    import json

    from posttrain.loop.training_loop import train

    cfg = load_run_config("grpo", ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}",
                               "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=2",
                               "eval.size=4", "eval.every=1", "eval.k=2", "eval.samples=3",
                               "eval.sampled_temperature=1.0", "steps=1", "logging.progress=false",
                               f"run_dir={tmp_path}"])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "heldout/accuracy" in r]
    assert ev and all("heldout/pass@2" in r and "heldout/pass@1" in r for r in ev)
    assert all(r["heldout/pass@2_samples"] == 3.0 for r in ev)
    assert all(0.0 <= r["heldout/pass@2"] <= 1.0 and r["heldout/pass@1"] <= r["heldout/pass@2"] + 1e-12 for r in ev)
