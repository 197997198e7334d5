"""Dynamic sampling (DAPO) runs through the one rollout driver (loop/rollout.py): rounds, ids, infra errors.

A scripted engine answers each prompt letter with fixed per-sample responses, so which groups carry
a reward signal (rewards differ within the group) is known in advance.
"""

from __future__ import annotations

import types

import pytest

from posttrain.envs import TASKS
from posttrain.envs.task import TaskExample
from posttrain.loop.producer import SyncProducer
from posttrain.loop.rollout_stage import RolloutStage, build_rollout
from posttrain.loop.validate import load_run_config
from posttrain.models import build_char_tokenizer
from posttrain.rollout.types import Completion
from posttrain.trajectory import Status

pytestmark = pytest.mark.timeout(60)

# prompt letter -> the response of sample 0 and sample 1 (reference answer 0 for every prompt)
ANSWERS = {"a": ["0", "5"], "b": ["5", "5"], "c": ["0", "0"], "d": ["5", "0"], "e": ["0", "5"], "f": ["0", "5"]}


class _Scripted:
    """Engine whose sample k of prompt letter L answers ANSWERS[L][k]; letters in ``failing`` fail as infra."""

    version = 0

    def __init__(self, tok, failing=()):
        self.tok, self.failing, self.calls = tok, set(failing), []

    def generate_detailed(self, requests, *, finish_target=None):
        self.calls.append([r.request_id for r in requests])
        comps, failed = [], []
        for r in requests:
            letter = self.tok.decode(r.prompt_ids)
            if letter in self.failing:
                failed.append(types.SimpleNamespace(request=r, reason="worker died"))
                continue
            for k in range(r.params.n):
                ids = self.tok(ANSWERS[letter][k]).input_ids + [self.tok.eos_token_id]
                comps.append(Completion(request_id=r.request_id, sample_index=k, prompt_ids=list(r.prompt_ids),
                                        token_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
                                        finish_reason="eos", params=r.params, seed=r.params.seed))
        return types.SimpleNamespace(completions=comps, failed=failed)


def _producer(tmp_path, failing=(), rounds=3):
    cfg = load_run_config("grpo", ["model.path=builtin:micro", "task.name=chain_sum", f"run_dir={tmp_path}",
                               "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=4",
                               "sampling.dynamic_sampling=true", f"sampling.max_sampling_rounds={rounds}"])
    tok = build_char_tokenizer()
    letters = iter("abcdef")

    def next_prompts(n):
        return [TaskExample(prompt_id=f"t/{ch}", prompt=ch, reference=0) for ch in (next(letters) for _ in range(n))]

    engine = _Scripted(tok, failing)
    run = types.SimpleNamespace(engine=engine, tokenizer=tok, task=TASKS["chain_sum"](terms=2), verify_batch=None,
                                next_prompts=next_prompts, cfg=cfg, learner=types.SimpleNamespace(version=0),
                                state=types.SimpleNamespace(rollout_calls=0, rollout_dropped=0))
    stage = RolloutStage.from_config(cfg)
    return SyncProducer(cfg, run, build_rollout(cfg, run, stage)), engine


def test_dynamic_sampling_keeps_signal_groups_and_counts_infra_errors(tmp_path):
    # round 0: a (signal), b (all equal: dropped); round 1 tops up 1 prompt: c fails in the backend
    # (infra errors, no signal: dropped); round 2: d (signal) fills the batch.
    prod, eng = _producer(tmp_path, failing={"c"})
    out = prod.next_batch(1)
    assert eng.calls == [["s1r0p0-t/a", "s1r0p1-t/b"], ["s1r1p0-t/c"], ["s1r2p0-t/d"]]
    by = {}
    for t in out.trajectories:
        by.setdefault(t.group_id, []).append(t.status)
    assert sorted(by) == ["s1r0p0-t/a", "s1r1p0-t/c", "s1r2p0-t/d"]
    # the failed group stays in the batch as counted infra errors (never a zero reward), as without DAPO
    assert by["s1r1p0-t/c"] == [Status.INFRA_ERROR] * 2
    assert Status.INFRA_ERROR not in by["s1r0p0-t/a"] + by["s1r2p0-t/d"]
    info = out.info
    assert (info["sampling/rounds"], info["sampling/dropped_groups"], info["sampling/shortfall_groups"]) == (3, 2, 0)
    assert info["rollout/calls"] == 3 and info["rollout/rows"] == 2 * 2 + 2 + 2


def test_dynamic_sampling_reports_its_shortfall(tmp_path):
    prod, eng = _producer(tmp_path, failing={"c"}, rounds=2)
    out = prod.next_batch(1)
    assert len(eng.calls) == 2
    assert [t.group_id for t in out.trajectories] == ["s1r0p0-t/a"] * 2 + ["s1r1p0-t/c"] * 2
    assert out.info["sampling/shortfall_groups"] == 1 and out.info["sampling/dropped_groups"] == 2
