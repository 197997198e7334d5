"""Registry entries declare what they need; config load refuses a run that cannot fill it, and
ReMax's greedy baseline is filled by the loop (runnable from a recipe)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import posttrain.algos as A
from posttrain.algos.registry import Registry
from posttrain.config import ConfigError
from posttrain.envs.task import TaskExample
from posttrain.loop.targets import build_targets, greedy_baseline
from posttrain.loop.validate import load_run_config
from posttrain.rewards import Verdict
from posttrain.rewards.scoring import ScoringSpec
from posttrain.rollout.types import Completion
from posttrain.trajectory import Reward, Status
from tests.loop._heldout_stubs import CodePointTokenizer

SMALL = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
         "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100",
         "logging.progress=false", "sft.steps=0"]


def test_estimators_declare_their_needs() -> None:
    needs = {n: set(A.ADVANTAGES.needs(n)) for n in A.ADVANTAGES}
    assert needs["gae"] == {"critic"}
    assert needs["remax"] == {"baseline"}
    assert needs["gigpo"] == {"groups>=2", "step_ids"}
    assert all(needs[n] == {"groups>=2"} for n in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"))
    assert needs["reinforce"] == needs["reinforce_pp"] == set()
    with pytest.raises(ValueError, match="unknown need"):
        Registry("x").register("f", needs=("gpu",))
    with pytest.raises(KeyError, match="valid"):
        A.ADVANTAGES.needs("nope")


@pytest.mark.parametrize(("overrides", "msg"), [
    (["credit.estimator=gae"], "credit.estimator=gae needs critic.enabled=true"),
    (["sampling.group_size=1"], "credit.estimator=grpo needs sampling.group_size >= 2 \\(got 1\\)"),
    (["credit.estimator=rloo", "sampling.group_size=1"], "credit.estimator=rloo needs sampling.group_size >= 2"),
    (["credit.estimator=gigpo"], "credit.estimator=gigpo needs per-step ids of multi-turn episodes"),
    (["credit.estimator=remax", "system.mode=one_step_off"], "credit.estimator=remax needs system.mode=sync"),
    (["credit.estimator=remax", "system.partial_fraction=0.5"], "system.partial_fraction=1"),
])
def test_bad_combinations_fail_at_config_load_in_one_line(overrides: list[str], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as e:
        load_run_config(None, overrides)
    assert "\n" not in str(e.value)


def test_good_combinations_load() -> None:
    load_run_config(None, ["credit.estimator=gae", "critic.enabled=true", "sampling.group_size=1"])
    load_run_config(None, ["credit.estimator=remax", "sampling.group_size=1"])  # ReMax needs no group
    load_run_config(None, ["credit.estimator=reinforce", "sampling.group_size=1"])


class _Engine:
    """Greedy answer: the prompt's last character; records the temperatures it was asked for."""

    def __init__(self) -> None:
        self.temperatures: list[float] = []

    def generate(self, reqs: list[Any]) -> list[Completion]:
        self.temperatures += [r.params.temperature for r in reqs]
        return [Completion(request_id=r.request_id, sample_index=0, prompt_ids=r.prompt_ids,
                           token_ids=[r.prompt_ids[-1]], logprobs=[0.0], versions=[0], finish_reason="eos")
                for r in reversed(reqs)]


@dataclasses.dataclass(frozen=True)
class _Verifier:
    name: str = "stub"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        if response == "x":
            raise RuntimeError("down")
        ok = response == str(reference)
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)})


@dataclasses.dataclass(frozen=True)
class _Task:
    verifier: Any = dataclasses.field(default_factory=_Verifier)


@dataclasses.dataclass
class _T:  # the fields of a Trajectory that greedy_baseline / build_targets read
    prompt_id: str
    group_id: str
    reward: Reward
    finish: Any = None
    status: Status = Status.CORRECT


@dataclasses.dataclass
class _Batch:
    trajectories: list[_T]
    action_mask: torch.Tensor


def _batch(rows: list[tuple[str, float]]) -> _Batch:
    return _Batch([_T(p, p, Reward({"task": r}, {"task": 1.0}, r)) for p, r in rows], torch.ones(len(rows), 2))


def test_greedy_baseline_and_remax_advantages_hand_computed() -> None:
    # greedy answers: p "1+2=3" -> "3" correct (1.0); q "2+2=5" -> "5" wrong (0.0); z "...x" -> infra error
    exs = {"p": TaskExample("p", "1+2=3", 3), "q": TaskExample("q", "2+2=5", 4), "z": TaskExample("z", "x", 1)}
    batch = _batch([("p", 1.0), ("p", 0.0), ("q", 1.0), ("z", 1.0)])
    eng = _Engine()
    base, m = greedy_baseline(batch, exs, engine=eng, tokenizer=CodePointTokenizer(), task=_Task(), spec=ScoringSpec({"task": 1.0}),
                              max_new_tokens=1, step=3)
    assert eng.temperatures == [0.0, 0.0, 0.0]  # one greedy request per distinct prompt
    assert base.tolist() == [1.0, 1.0, 0.0, 1.0]  # z: no baseline -> its own reward (advantage 0)
    assert m["remax/baseline_infra_errors"] == 1.0 and m["remax/baseline_reward_mean"] == 0.5
    tg = build_targets(batch, old_logprob=torch.zeros(4, 2), ref_logprob=None, values=None,  # type: ignore[arg-type]
                       estimator="remax", baseline=base)
    # A_i = R_i - b_i on every action token: [0, -1, 1, 0]
    assert tg.advantages[:, 0].tolist() == [0.0, -1.0, 1.0, 0.0]
    assert torch.equal(tg.advantages[:, 0], tg.advantages[:, 1])


def test_remax_runs_from_a_recipe(tmp_path) -> None:
    from posttrain.loop.training_loop import train

    st = train(load_run_config("grpo", [*SMALL, "credit.estimator=remax", "credit.kwargs={}", "steps=2", f"run_dir={tmp_path}"]))
    assert st.step == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    assert all("remax/baseline_reward_mean" in r for r in steps)


@pytest.fixture
def user_algos(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    yield "_algos_for_tests"
    for reg in (A.ADVANTAGES, A.POLICY_LOSSES):  # registration is process-wide: leave the registries as found
        for name in [n for n in reg if n.startswith("_algos_for_tests:")]:
            reg.unregister(name)


def test_estimator_and_loss_by_dotted_path_checked_at_config_load(user_algos: str) -> None:
    m = user_algos
    cfg = load_run_config(None, [f"credit.estimator={m}:scaled_grpo", "credit.kwargs={scale: 2.0}",
                             f"loss.policy_loss={m}:clip_loss", "loss.kwargs={eps: 0.1}"])
    assert A.ADVANTAGES.needs(cfg.credit.estimator) == {"groups>=2"}  # declared by the function
    for overrides, msg in [
        ([f"credit.estimator={m}:scaled_grpo", "credit.kwargs={scael: 2.0}"], "credit.kwargs.scael: unknown keyword"),
        ([f"credit.estimator={m}:scaled_grpo", "sampling.group_size=1"], "needs sampling.group_size >= 2"),
        ([f"loss.policy_loss={m}:clip_loss", "loss.kwargs={eps_low: 0.1}"], "loss.kwargs.eps_low: unknown keyword"),
        (["credit.estimator=no_mod_zz:f"], "credit.estimator: cannot import module 'no_mod_zz'"),
        ([f"credit.estimator={m}:nope"], "has no attribute 'nope'"),
        ([f"credit.estimator={m}:no_inputs"], "first positional argument"),
        ([f"loss.policy_loss={m}:bad_needs"], "needs=\\('a_gpu',\\) must be a list of"),
        (["credit.estimator=grpoo"], "unknown advantage estimator 'grpoo'; valid: .*package.module:function"),
    ]:
        with pytest.raises(ConfigError, match=msg) as e:
            load_run_config(None, overrides)
        assert "\n" not in str(e.value)


def test_user_estimator_and_loss_run_from_a_recipe(user_algos: str, tmp_path) -> None:
    from posttrain.loop.training_loop import train

    st = train(load_run_config("grpo", [*SMALL, f"credit.estimator={user_algos}:scaled_grpo", "credit.kwargs={scale: 2}",
                                    f"loss.policy_loss={user_algos}:clip_loss", "loss.kwargs={}", "steps=1",
                                    f"run_dir={tmp_path}"]))
    assert st.step == 1
