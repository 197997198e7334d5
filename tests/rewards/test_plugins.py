"""Contract of reward functions by dotted path (``reward.functions``): signature checked at config
load, raw values recorded and weighted once in the total, failures are infra errors (never 0)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from posttrain.config import ConfigError
from posttrain.envs.task import TaskExample
from posttrain.loop.validate import load_run_config
from posttrain.rewards import Verdict, VerifierPool
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.plugins import (
    RewardFunctionError,
    RewardFunctionVerifier,
    call_reward_function,
    check_reward_function,
    with_reward_functions,
)
from posttrain.rewards.scoring import ScoringSpec, score
from posttrain.rollout.types import Completion
from posttrain.trajectory import Status

M = "_reward_fns_for_tests"  # tests/rewards is on sys.path (conftest.py)


def test_signature_and_path_are_checked_with_the_key() -> None:
    assert check_reward_function(f"{M}:brevity", "k").__name__ == "brevity"
    for path, why in [("no_colon", "must look like"), ("no_such_mod_xyz:f", "cannot import module"),
                      (f"{M}:missing", "has no attribute"), (f"{M}:NOT_A_FUNCTION", "not a function"),
                      (f"{M}:wrong_signature", "does not fit fn\\(response, reference, \\*, prompt, meta\\)")]:
        with pytest.raises(ValueError, match=f"^k: .*{why}"):
            check_reward_function(path, "k")


def test_config_load_resolves_functions_and_merges_weights() -> None:
    cfg = load_run_config(None, [f"reward.functions=[{{path: '{M}:brevity', weight: 0.5}}, "
                             f"{{path: '{M}:echoes_prompt', name: echo}}]"])
    assert [f.name for f in cfg.reward.functions] == ["brevity", "echo"]
    assert cfg.reward.weights == {"task": 1.0, "brevity": 0.5, "echo": 1.0}
    with pytest.raises(ConfigError, match=r"reward.functions 'no_mod_q:f': cannot import module 'no_mod_q'"):
        load_run_config(None, ["reward.functions=[{path: 'no_mod_q:f'}]"])
    with pytest.raises(ConfigError, match=r"used twice"):
        load_run_config(None, [f"reward.functions=[{{path: '{M}:brevity'}}, {{path: '{M}:nan', name: brevity}}]"])
    with pytest.raises(ConfigError, match=r"conflicts with reward.weights.brevity=2.0"):
        load_run_config(None, ["reward.weights={task: 1.0, brevity: 2.0}", f"reward.functions=[{{path: '{M}:brevity'}}]"])


def test_call_contract_sync_async_verdict_and_failures() -> None:
    import _reward_fns_for_tests as fns

    ctx: dict[str, Any] = {"prompt": "12", "meta": {"bonus": 0.25}}
    assert call_reward_function(fns.brevity, "b", "abc", None, **ctx) == 0.25  # 1 / (1 + 3)
    assert call_reward_function(fns.echoes_prompt, "e", "x12y", None, **ctx) == 1.25  # async, with meta
    assert call_reward_function(fns.verdict_fn, "v", "7", 7, **ctx) == 2.0
    assert call_reward_function(fns.infra_verdict, "i", "7", 7, **ctx) is None
    for fn, why in [(fns.boom, "raised RuntimeError: reward service down"), (fns.nan, "not finite"),
                    (fns.text, "returned str, not a float")]:
        with pytest.raises(RewardFunctionError, match=why):
            call_reward_function(fn, "f", "7", 7, **ctx)


def _verify(verifier: Any, response: str, reference: Any, workers: int = 0) -> Verdict:
    with VerifierPool(workers=workers, timeout_s=30, retries=0) as pool:
        return pool.verify_batch([(verifier, response, reference, {"prompt": "3+4=", "meta": {}})])[0]


def test_verifier_adds_raw_components_and_failures_are_infra_errors() -> None:
    v = RewardFunctionVerifier(IntegerVerifier(), (("brevity", f"{M}:brevity"), ("echo", f"{M}:echoes_prompt")))
    out = _verify(v, "7", 7)
    assert out.status is Status.CORRECT  # the task's verifier decides the status
    assert out.components == {"task": 1.0, "format": 1.0, "brevity": 0.5, "echo": 0.0}
    wrong = _verify(v, "8", 7)
    assert wrong.status is Status.WRONG and wrong.components["brevity"] == 0.5
    for bad in ("boom", "nan", "text", "infra_verdict"):
        res = _verify(RewardFunctionVerifier(IntegerVerifier(), ((bad, f"{M}:{bad}"),)), "7", 7)
        assert res.status is Status.INFRA_ERROR and res.components == {}, bad


def test_verifier_travels_to_a_worker_process() -> None:
    v = RewardFunctionVerifier(IntegerVerifier(), (("brevity", f"{M}:brevity"),))
    _ = v._resolved()  # resolved here: the pickled copy must not carry the functions
    assert _verify(v, "7", 7, workers=1).components["brevity"] == 0.5
    assert _verify(RewardFunctionVerifier(IntegerVerifier(), (("b", f"{M}:boom"),)), "7", 7,
                   workers=1).status is Status.INFRA_ERROR


@dataclasses.dataclass(frozen=True)
class _Task:
    verifier: Any = dataclasses.field(default_factory=IntegerVerifier)


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_score_weights_functions_once_in_the_total_and_never_zero_rewards_a_failure() -> None:
    task = with_reward_functions(_Task(), [("brevity", f"{M}:brevity"), ("echo", f"{M}:echoes_prompt")])
    exs = [TaskExample("p0", "3+4=", 7, {"bonus": 0.5}), TaskExample("p1", "1+1=", 2, {})]
    comps = [Completion(request_id=f"r{i}", sample_index=0, prompt_ids=[1], token_ids=[ord(ch) for ch in t],
                        logprobs=[0.0] * len(t), versions=[0] * len(t), finish_reason="eos")
             for i, t in enumerate(["7", "3"])]
    spec = ScoringSpec({"task": 1.0, "brevity": 0.5, "echo": 2.0})
    trajs, _ = score(comps, exs, task=task, tokenizer=_Tok(), spec=spec, group_ids=["g0", "g1"], step=0)
    # p0 "7": task 1, brevity 1/2, echo 0 + bonus 0.5 -> 1*1 + 0.5*0.5 + 2*0.5 = 2.25
    assert {k: trajs[0].reward.components[k] for k in ("task", "brevity", "echo")} == {"task": 1.0, "brevity": 0.5, "echo": 0.5}
    assert trajs[0].reward.total == pytest.approx(2.25)
    # p1 "3" wrong: 0 + 0.25 + 0 = 0.25
    assert trajs[1].status is Status.WRONG and trajs[1].reward.total == pytest.approx(0.25)
    broken = with_reward_functions(_Task(), [("b", f"{M}:boom")])
    trajs, _ = score(comps, exs, task=broken, tokenizer=_Tok(), spec=ScoringSpec({"task": 1.0, "b": 1.0}),
                     group_ids=["g0", "g1"], step=0)
    assert all(t.status is Status.INFRA_ERROR and t.reward.total is None for t in trajs)


def test_recipe_key_reaches_the_ledger(tmp_path) -> None:
    from posttrain.loop.training_loop import train
    from posttrain.trajectory import Ledger

    cfg = load_run_config("grpo", ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}",
                               "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=2",
                               "eval.size=4", "eval.every=100", "steps=1", "logging.progress=false",
                               f"reward.functions=[{{path: '{M}:brevity', weight: 0.5}}]", f"run_dir={tmp_path}"])
    train(cfg)
    trajs = [t for t in Ledger(tmp_path / "ledger").read_trajectories() if t.status is not Status.INFRA_ERROR]
    assert trajs
    for t in trajs:
        b = 1.0 / (1.0 + len(t.meta["response"]))
        assert t.reward.components["brevity"] == pytest.approx(b)
        assert t.reward.total == pytest.approx(t.reward.components["task"] + 0.5 * b)


def test_the_docs_example_runs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/tasks_and_verifiers.md's reward-function example: module and recipe keys, as written."""
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).parents[2] / "docs" / "tasks_and_verifiers.md").read_text()
    sec = doc.split("## Reward functions by dotted path", 1)[1].split("\n## ", 1)[0]
    code, recipe = re.findall(r"```python\n(.*?)```", sec, re.S)[0], re.findall(r"```yaml\n(.*?)```", sec, re.S)[0]
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = yaml.safe_load(recipe)["reward"]
    fns = ", ".join("{" + ", ".join(f"{k}: {v!r}" for k, v in f.items()) + "}" for f in reward["functions"])
    cfg = load_run_config(None, [f"reward.functions=[{fns}]"])
    assert cfg.reward.weights == {"task": 1.0, "brevity": 0.1, "mention": 0.5}
    task = with_reward_functions(_Task(), [(f.name, f.path) for f in cfg.reward.functions])
    v = _verify(task.verifier, "7", 7)
    assert {k: v.components[k] for k in ("task", "brevity", "mention")} == {"task": 1.0, "brevity": 0.5, "mention": 1.0}
