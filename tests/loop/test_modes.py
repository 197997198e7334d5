"""System modes, staleness controls and partial rollout (posttrain/loop/producer.py).

Hand-computed cases run on a scripted engine (every sample's length is fixed in advance); the
end-to-end cases run the real loop on the micro model for a few steps.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.config import ConfigError
from posttrain.envs.task import TaskExample
from posttrain.loop.producer import SampleQueue, tag_and_filter
from posttrain.loop.rollout_stage import RolloutStage, build_rollout
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.rollout.types import Completion
from posttrain.trajectory import Finish, Ledger, Status, make_trajectory

pytestmark = pytest.mark.timeout(120)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _micro_run import MICRO_RUN  # noqa: E402

SMALL = [
    *MICRO_RUN,
    "eval.size=16",
    "eval.every=2",
    "guards.max_truncation_rate=1.0",
    "sft.steps=0",  # from the random micro model, one optimizer step per update (not the shipped recipes')
    "optim.num_minibatches=1",
]


HERE = Path(__file__).parent
LEARNABLE = ["task.name=flaky_task:digit_first", "sampling.max_new_tokens=2"]  # reward signal from a random init


@pytest.fixture(autouse=True)
def _plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # flaky_task.py (user-style plug-in tasks)


def _cfg(tmp_path, *extra, recipe="grpo"):
    return load_run_config(recipe, [*SMALL, f"run_dir={tmp_path}", *extra])


@pytest.fixture(scope="module")
def varied_model(tmp_path_factory):
    """The micro model with its eos embedding pushed towards the mean embedding: sampled response
    lengths spread over 1..12 tokens instead of nearly all hitting the limit."""
    from posttrain.loop.builders import build_model

    d = tmp_path_factory.mktemp("varied")
    tok, model = build_model(load_run_config("grpo", ["model.path=builtin:micro"]))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[tok.eos_token_id] += 4.0 * emb.mean(0) / emb.mean(0).norm()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return [f"model.path={d}", "sampling.max_new_tokens=12", "eval.every=100"]


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ck = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return load_file(str(ck / "actor" / "model.safetensors"))


# ------------------------------------------------------------------------------ config


def test_system_config_validates_and_defaults():
    assert load_run_config("grpo", ["system.mode=async"]).system.max_staleness == 1  # explicit default bound
    c = load_run_config("grpo", ["system.mode=async", "system.max_queue=64"])
    assert c.system.max_staleness is None and c.system.max_queue == 64
    assert load_run_config("grpo", ["system.mode=async", "system.partial_fraction=0.5"]).system.partial_fraction == 0.5
    with pytest.raises(ConfigError, match="max_queue"):
        load_run_config("grpo", ["system.mode=async", "system.max_queue=3"])  # < group_size 8
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_run_config("dapo", ["system.mode=one_step_off"])
    with pytest.raises(ConfigError, match="system.mode"):
        load_run_config("grpo", ["system.mode=warp"])
    with pytest.raises(ConfigError, match="partial_fraction"):
        load_run_config("grpo", ["system.partial_fraction=0"])


# ------------------------------------------------------------------------------ units


def _traj(tid, versions, gid="g"):
    return make_trajectory(traj_id=tid, prompt_id="p", group_id=gid, prompt_ids=[5, 6], action_ids=[7] * len(versions),
                           action_logprobs=[-1.0] * len(versions), action_versions=versions, finish="terminal")


def test_staleness_tags_and_drop_by_oldest_token():
    ts = [_traj("a", [3, 3]), _traj("b", [2, 3]), _traj("c", [1, 1]), _traj("d", [3])]
    kept, stale = tag_and_filter(ts, learner_version=3, max_staleness=1)
    # lag = 3 - oldest version: a 0, b 1 (resumed: judged by its oldest token), c 2, d 0
    assert [t.traj_id for t in kept] == ["a", "b", "d"] and [t.policy_lag for t in kept] == [0, 1, 0]
    assert [(t.traj_id, t.policy_lag) for t in stale] == [("c", 2)]
    kept, stale = tag_and_filter(ts, learner_version=3, max_staleness=None)  # switched off: keep all, still tag
    assert len(kept) == 4 and not stale and kept[2].policy_lag == 2


def test_queue_blocks_at_depth_bound_and_loses_nothing():
    q = SampleQueue(max_samples=4)
    stop = threading.Event()
    g = [[_traj(f"{i}-{j}", [0], gid=str(i)) for j in range(2)] for i in range(3)]
    assert q.put(g[0], stop) and q.put(g[1], stop)  # 4 samples: full
    done = threading.Event()

    def producer():
        q.put(g[2], stop)  # must block until the learner takes a group
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.3)
    assert not done.is_set() and q.samples == 4
    assert q.get(1.0) is g[0]
    th.join(5)
    assert done.is_set() and q.blocked_puts == 1 and q.blocked_s > 0.2
    assert [q.get(1.0), q.get(1.0)] == [g[1], g[2]] and q.get(0.05) is None  # FIFO, nothing lost
    assert q.max_depth == 4
    # a stopped producer gives up instead of hanging
    q.put(g[0], stop), q.put(g[1], stop)
    stop.set()
    assert q.put(g[2], stop) is False


class ScriptedEngine:
    """Engine stand-in: sample ``(prompt, k)`` is exactly ``LENGTHS[prompt][k]`` tokens (last = eos);
    all rows advance one token per decode step; ``finish_target`` as in BuiltinEngine."""

    def __init__(self, lengths, tok_id, eos_id):
        self.lengths, self.tok, self.eos, self.version = lengths, tok_id, eos_id, 0
        self.calls: list[list[str]] = []

    def pause(self):
        pass

    def generate(self, requests, *, finish_target=None):
        rows = []
        for r in requests:
            if r.resume is not None:
                c = r.resume
                rows.append([r, c.sample_index, list(c.token_ids), list(c.versions), None])
            else:
                rows.extend([r, k, [], [], None] for k in range(r.params.n))
        self.calls.append([f"{r.request_id}" for r in requests])
        done = 0
        while any(x[4] is None for x in rows) and not (finish_target and done >= finish_target):
            for x in rows:
                if x[4] is not None:
                    continue
                want = self.lengths[x[0].prompt_ids[0]][x[1]]
                x[2].append(self.eos if len(x[2]) + 1 == want else self.tok)
                x[3].append(self.version)
                if len(x[2]) == want:
                    x[4], done = "eos", done + 1
        return [Completion(request_id=r.request_id, sample_index=k, prompt_ids=list(r.prompt_ids), token_ids=t,
                           logprobs=[-1.0] * len(t), versions=v, finish_reason=f or "paused", params=r.params,
                           seed=r.params.seed) for r, k, t, v, f in rows]


def _scripted(tmp_path, lengths, *extra):
    """The single-turn rollout driver over a scripted engine; prompt i is the 1-character prompt chr(ord('a') + i)."""
    from posttrain.models import build_char_tokenizer

    cfg = _cfg(tmp_path, "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=10", *extra)
    tok = build_char_tokenizer()
    letters = iter("abcdefgh")
    ids = {}

    def next_prompts(n):
        out = []
        for _ in range(n):
            ch = next(letters)
            ids[tok(ch).input_ids[0]] = ch
            out.append(TaskExample(prompt_id=f"t/{ch}", prompt=ch, reference=0))
        return out

    from posttrain.envs import TASKS

    engine = ScriptedEngine({}, tok("5").input_ids[0], tok.eos_token_id)
    run = types.SimpleNamespace(engine=engine, tokenizer=tok, task=TASKS["chain_sum"](terms=2), verify_batch=None,
                                next_prompts=next_prompts, cfg=cfg)
    for ch, ls in lengths.items():
        engine.lengths[tok(ch).input_ids[0]] = ls
    return build_rollout(cfg, run, RolloutStage.from_config(cfg)), engine


def test_partial_rollout_by_hand(tmp_path):
    """N=2 prompts, K=2 samples, lambda=0.5 -> each call stops once ceil(0.5*2*2)=2 samples finished."""
    lengths = {"a": [1, 5], "b": [2, 2], "c": [3, 3], "d": [1, 1], "e": [1, 1], "f": [1, 1]}
    ro, eng = _scripted(tmp_path, lengths, "system.partial_fraction=0.5", "system.max_version_span=2")
    # call 0 @v0: decode step 1 finishes a0; step 2 finishes b0, b1 (3 >= 2: stop). a1 paused after 2 tokens.
    groups, info = ro.run_call(0)
    assert [[t.traj_id for t in g] for g in groups] == [["s1r0p1-t/b/0", "s1r0p1-t/b/1"]]  # group a waits for a1
    assert (info["partial/finished"], info["partial/paused"], info["partial/resumed"]) == (3, 1, 0)
    assert info["partial/fresh_prompts"] == 2 and info["rollout/new_tokens"] == 7
    assert info["rollout/group_idle_frac"] == pytest.approx(1 - 7 / (4 * 2))
    assert info["partial/paused_len_mean"] == 2 and info["partial/finished_len_mean"] == pytest.approx(5 / 3)
    # call 1 @v1: 1 carried sample (< K, so 2 fresh prompts c, d). Step 1 finishes d0, d1: stop.
    eng.version = 1
    groups, info = ro.run_call(1)
    assert eng.calls[1] == ["s2r0p0-t/c", "s2r0p1-t/d", "s1r0p0-t/a#1"]
    assert [g[0].group_id for g in groups] == ["s2r0p1-t/d"] and info["partial/resumed"] == 1
    assert info["partial/paused"] == 3  # a1 (3 tokens now), c0, c1
    # call 2 @v2: 3 carried -> 2 - 3 // 2 = 1 fresh prompt (e). Step 1 finishes e0, e1.
    eng.version = 2
    groups, info = ro.run_call(2)
    assert [g[0].group_id for g in groups] == ["s3r0p0-t/e"] and info["partial/fresh_prompts"] == 1
    # call 3 @v3: a1 would span 3 - 0 = 3 > max_version_span=2: dropped (counted), so group a completes with a0.
    # c0, c1 (versions 1, 2) resume: step 1 finishes f0, f1 and c0, c1 (3rd token): 4 finished.
    eng.version = 3
    groups, info = ro.run_call(3)
    assert info["partial/dropped_span"] == 1
    by = {g[0].group_id: g for g in groups}
    assert set(by) == {"s1r0p0-t/a", "s2r0p0-t/c", "s4r0p0-t/f"}
    assert [t.traj_id for t in by["s1r0p0-t/a"]] == ["s1r0p0-t/a/0"]
    c0 = by["s2r0p0-t/c"][0]
    # paused is not truncated: all 3 tokens, terminal, versions per token span 1..3, paused twice
    assert c0.finish is Finish.TERMINAL and c0.num_actions == 3
    assert c0.behavior_version[c0.action_mask.astype(bool)].tolist() == [1, 2, 3]
    assert (c0.meta["pauses"], c0.meta["pause_age"], c0.meta["version_span"]) == (2, 2, 2)
    assert info["partial/pause_age_max"] == 2 and ro.inflight() == 0


def test_group_waits_only_for_its_own_group(tmp_path):
    """Group b (one straggler of 4 tokens) is emitted when its own straggler finishes; the groups
    started after it (c..h) are emitted as soon as they complete, never held for b."""
    lengths = {ch: [1, 1] for ch in "acdefgh"} | {"b": [1, 4]}
    ro, eng = _scripted(tmp_path, lengths, "system.partial_fraction=0.25")  # target ceil(0.25 * 4) = 1
    emitted = [[g[0].group_id for g in ro.run_call(c)[0]] for c in range(4)]
    assert emitted == [["s1r0p0-t/a"], ["s2r0p0-t/c", "s2r0p1-t/d"], ["s3r0p0-t/e", "s3r0p1-t/f"],
                       ["s1r0p1-t/b", "s4r0p0-t/g", "s4r0p1-t/h"]]  # b1 is resumed three times
    assert ro.inflight() == 0


def test_async_partial_resumes_paused_samples_while_the_bound_holds_new_prompts(tmp_path):
    """async + lambda=0.5, staleness bound 1, 2 groups per step. Calls 0 and 1 (the only ones the bound
    admits at version 0) complete just one group (c): a1 and b1 are long and stay paused. The learner needs
    2 groups and the bound waits for the learner, so without a resume-only call this would wait forever;
    the producer finishes the paused samples instead, starting no new slot."""
    from posttrain.loop.producer import ThreadedProducer

    lengths = {"a": [1, 30], "b": [2, 30], "c": [1, 3], "d": [1, 1], "e": [1, 1]}
    ro, eng = _scripted(tmp_path, lengths, "sampling.max_new_tokens=40", "system.mode=async",
                        "system.partial_fraction=0.5", "system.max_staleness=1", "system.queue_timeout_s=30")
    ro.run.state = types.SimpleNamespace(rollout_calls=0, rollout_dropped=0)
    ro.run.learner = types.SimpleNamespace(version=0)
    prod = ThreadedProducer(ro.cfg, ro.run, ro)
    try:
        got = prod.next_batch(1)
    finally:
        prod.close()
    groups = {t.group_id for t in got.trajectories}
    assert groups == {"s2r0p0-t/c", "s1r0p0-t/a"}  # c (call 1), then a from the resume-only call
    assert all(t.finish is not Finish.PAUSED and len(t.token_ids) > 0 for t in got.trajectories)
    assert prod._call == 2  # the resume-only call started no new slot: no prompt d was drawn
    resumed_only = [c for c in eng.calls if all("#" in rid for rid in c)]
    assert resumed_only, eng.calls


# ------------------------------------------------------------------------------ end to end


def test_async_max_staleness_0_reproduces_sync_exactly(tmp_path):
    common = [*LEARNABLE, "steps=3", "seed=11", "optim.lr=1e-2"]
    st_s = train(_cfg(tmp_path / "sync", *common))
    st_a = train(_cfg(tmp_path / "async", *common, "system.mode=async", "system.max_staleness=0", "system.max_queue=64"))
    a, b = Ledger(tmp_path / "sync" / "ledger"), Ledger(tmp_path / "async" / "ledger")
    ta, tb = a.read_trajectories(), b.read_trajectories()
    assert len(ta) == len(tb) == 3 * 16
    for x, y in zip(ta, tb, strict=True):
        assert (x.traj_id, x.prompt_id, x.group_id) == (y.traj_id, y.prompt_id, y.group_id)
        assert x.token_ids.tolist() == y.token_ids.tolist()
        assert x.behavior_version.tolist() == y.behavior_version.tolist()
        assert np.array_equal(x.behavior_logprob, y.behavior_logprob) and np.array_equal(x.old_logprob, y.old_logprob)
        assert x.policy_lag == y.policy_lag == 0 and x.reward.total == y.reward.total
    wa, wb = _final_weights(tmp_path / "sync"), _final_weights(tmp_path / "async")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["loss"] for m in a.read_metrics()] == [m["loss"] for m in b.read_metrics()]
    assert st_s.heldout_curve == st_a.heldout_curve
    # the learner drew exactly the sync batches; the worker's one admitted slot after the last step is counted
    assert st_s.unconsumed_samples == 0 and st_a.unconsumed_samples == 16
    assert any(m["grad_norm"] > 0 for m in a.read_metrics())  # the weights really moved: not a vacuous match


def test_one_step_off_has_lag_one_and_is_deterministic(tmp_path):
    extra = [*LEARNABLE, "steps=3", "seed=2", "optim.lr=1e-2", "system.mode=one_step_off", "loss.policy_loss=decoupled_ppo",
             "correction.name=tis"]
    train(_cfg(tmp_path / "a", *extra))
    train(_cfg(tmp_path / "b", *extra))
    led = Ledger(tmp_path / "a" / "ledger")
    for step, t in led.iter_trajectories():
        acts = t.behavior_version[t.action_mask.astype(bool)]
        # step 1 samples under v0 (lag 0); step k >= 2 samples under v(k-2) and trains at v(k-1): lag 1
        assert set(acts.tolist()) == {max(step - 2, 0)} and t.policy_lag == (0 if step == 1 else 1)
        assert t.old_version == step - 1
    ms = led.read_metrics()
    assert [m["lag/count_1"] for m in ms] == [0, 16, 16]
    # off-policy data reaches the learner and the importance correction is wired: pi_old != mu from step 2
    # engine mismatch (same-version tokens) and lag (older tokens) are reported apart: step 2 has only lag
    assert ms[0]["logkappa_abs_max"] < 1e-4 and ms[0]["lag/tokens"] == 0
    assert ms[1].get("logkappa_abs_max") is None and ms[1]["logkappa/tokens"] == 0
    assert ms[1]["lag/logratio_abs_max"] > 1e-4 and ms[1]["lag/tokens"] > 0
    assert "pg/behavior_weight" in ms[1] and "correction/kept_token_frac" in ms[1]
    wa, wb = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_one_step_off_lag_is_exactly_one_when_the_worker_thread_is_starved(tmp_path, monkeypatch):
    """The call of step k+1 must sample under the weights before step k's sync whatever the threads'
    timing. A worker that starts that call late (here: 1.5 s, as a starved thread on a loaded machine
    does) used to start it after the sync, so its samples had lag 0 and the run depended on timing;
    the sync now waits for that call to return."""
    from posttrain.loop.rollout import Rollout

    real = Rollout.run_call

    def late(self, call, **kw):
        if call == 1:
            time.sleep(1.5)
        return real(self, call, **kw)

    monkeypatch.setattr(Rollout, "run_call", late)
    train(_cfg(tmp_path, *LEARNABLE, "steps=3", "seed=2", "optim.lr=1e-2", "system.mode=one_step_off",
               "loss.policy_loss=decoupled_ppo", "correction.name=tis"))
    led = Ledger(tmp_path / "ledger")
    for step, t in led.iter_trajectories():
        acts = t.behavior_version[t.action_mask.astype(bool)]
        assert set(acts.tolist()) == {max(step - 2, 0)} and t.policy_lag == (0 if step == 1 else 1), step
    # the learner's wait for that call is its own figure: call 1 returns >= 1.5 s after call 0, whose batch step 1
    # trained on, so step 1's update plus its wait in the quiesce cover those 1.5 s (less consumption and judging)
    ms = led.read_metrics()
    assert all(m["time/quiesce_wait_s"] >= 0.0 for m in ms)
    assert ms[0]["time/quiesce_wait_s"] + ms[0]["time/learner_s"] >= 1.2


def test_one_step_off_reports_each_steps_own_call_whatever_the_timing(tmp_path, monkeypatch):
    """A step's rollout metrics are those of the call it trains on. A learner that asks late (here 1.5 s,
    while the worker finishes the next call meanwhile) used to get the metrics of two calls merged
    (``rollout/calls`` 2 at step 1, and a step without any later)."""
    from posttrain.loop.producer import ThreadedProducer

    real = ThreadedProducer.next_batch

    def late(self, step):
        if step == 1:
            time.sleep(1.5)
        return real(self, step)

    monkeypatch.setattr(ThreadedProducer, "next_batch", late)
    train(_cfg(tmp_path, *LEARNABLE, "steps=3", "seed=2", "optim.lr=1e-2", "system.mode=one_step_off"))
    ms = Ledger(tmp_path / "ledger").read_metrics()
    assert [m["rollout/calls"] for m in ms] == [1.0, 1.0, 1.0]
    assert [m["rollout/rows"] for m in ms] == [16.0, 16.0, 16.0]


def test_async_bounded_staleness_and_accounting(tmp_path):
    st = train(_cfg(tmp_path, "steps=4", "system.mode=async", "system.max_staleness=1", "system.max_queue=8",
                    "optim.lr=1e-2"))
    led = Ledger(tmp_path / "ledger")
    trajs = led.read_trajectories()
    ms = led.read_metrics()
    assert all(t.policy_lag is not None and t.policy_lag <= 1 for t in trajs)
    assert all(m["queue/max_depth_samples"] <= 8 for m in ms)
    # groups are whole: every group id of a step has its G=4 samples
    for step in led.steps():
        ids = [t.group_id for _, t in led.iter_trajectories([step])]
        assert all(ids.count(g) == 4 for g in ids) and len(set(ids)) == 4
    # nothing lost or double-counted: samples started = consumed + dropped (stale) + discarded at the end
    started = st.rollout_calls * 4 * 4
    dropped = sum(m["staleness/dropped_samples"] for m in ms) + st.rollout_dropped
    assert started == len(trajs) + dropped + st.unconsumed_samples
    assert len({t.traj_id for t in trajs}) == len(trajs)


def test_ppo_gae_single_rollout_async(tmp_path):
    st = train(_cfg(tmp_path, "steps=2", "sampling.group_size=1", "system.mode=async", recipe="ppo"))
    ms = Ledger(tmp_path / "ledger").read_metrics()
    assert st.step == 2 and all(math.isfinite(m["loss"]) and "critic/value_loss" in m for m in ms)
    assert all(m["lag/max"] <= 1 for m in ms)


def test_partial_rollout_end_to_end(tmp_path, varied_model):
    """lambda=0.5 pauses samples and resumes them under newer versions; no paused trajectory is
    ever trained; spans are counted; paused is not truncated."""
    extra = [*varied_model, "steps=4", "seed=1", "system.partial_fraction=0.5",
             "optim.lr=0"]  # lr=0: weights never change, so a resumed sample must equal an uninterrupted one
    train(_cfg(tmp_path, *extra))
    led = Ledger(tmp_path / "ledger")
    ms = led.read_metrics()
    trajs = led.read_trajectories()
    assert sum(m["partial/paused"] for m in ms) > 0 and sum(m["partial/resumed"] for m in ms) > 0
    assert all(m["partial/lambda"] == 0.5 for m in ms)
    assert all(t.finish is not Finish.PAUSED for t in trajs)
    resumed = [t for t in trajs if t.meta["pauses"] > 0]
    assert resumed and max(t.meta["version_span"] for t in resumed) >= 1
    assert max(m["version_span/max"] for m in ms) >= 1
    for t in resumed:
        v = t.behavior_version[t.action_mask.astype(bool)]
        assert (np.diff(v) >= 0).all() and int(v.max() - v.min()) == t.meta["version_span"]
    # paused is not truncated: regenerate each resumed sample in one uninterrupted call
    from posttrain.loop.builders import build_engine, build_model

    actor = sorted((tmp_path / "checkpoints").glob("step_*"))[-1] / "actor"
    tok, model = build_model(_cfg(tmp_path, *extra, f"model.path={actor}"))
    eng = build_engine(model, tok)
    for t in resumed[:6]:
        c = Completion.from_trajectory(t)
        from posttrain.rollout.types import GenerationRequest

        full = eng.generate([GenerationRequest(request_id="x", prompt_ids=c.prompt_ids, params=c.params)])
        ref = full[c.sample_index]
        assert ref.token_ids == c.token_ids and ref.finish_reason == c.finish_reason
        np.testing.assert_allclose(ref.logprobs, c.logprobs, atol=1e-5)


def test_max_version_span_drops_are_counted(tmp_path, varied_model):
    train(_cfg(tmp_path, *varied_model, "steps=3", "seed=1", "system.partial_fraction=0.5", "system.max_version_span=0"))
    led = Ledger(tmp_path / "ledger")
    ms = led.read_metrics()
    assert sum(m["partial/dropped_span"] for m in ms) > 0
    assert all(t.meta["version_span"] == 0 for t in led.read_trajectories())


@pytest.mark.timeout(300)  # ~25 s on a quiet 2-core machine; a loaded one runs the producer thread slowly
def test_async_partial_rollout_pauses_resumes_and_accounts(tmp_path, varied_model):
    """async + lambda < 1: each streamed call returns once ceil(lambda*N*K) samples finished; the rest
    resume in the next call, under newer weights when an update came in between; nothing is lost."""
    st = train(_cfg(tmp_path, *varied_model, "steps=4", "seed=1", "system.mode=async", "system.partial_fraction=0.5",
                    "system.max_staleness=2", "optim.lr=1e-2"))
    led = Ledger(tmp_path / "ledger")
    ms = led.read_metrics()
    trajs = led.read_trajectories()
    # a step reports the calls that ended since the last one: none, on a loaded machine, for some step
    assert len(ms) == 4 and all(m.get("partial/lambda", 0.5) == 0.5 for m in ms)
    assert any("partial/lambda" in m for m in ms)
    assert sum(m["partial/paused"] for m in ms) > 0 and sum(m["partial/resumed"] for m in ms) > 0
    assert all(t.finish is not Finish.PAUSED for t in trajs)
    assert all(t.policy_lag is not None and t.policy_lag <= 2 for t in trajs)
    for t in (t for t in trajs if t.meta["pauses"] > 0):
        v = t.behavior_version[t.action_mask.astype(bool)]
        assert (np.diff(v) >= 0).all() and int(v.max() - v.min()) == t.meta["version_span"]
    for step in led.steps():  # groups stay whole: G=4 samples of each group id in a step
        ids = [t.group_id for _, t in led.iter_trajectories([step])]
        assert all(ids.count(g) == 4 for g in ids)
    # samples started (training prompts drawn x G) = consumed + dropped (stale / span) + discarded at the
    # end (queued + carried); the metrics of calls that ran after the last step are not in the ledger
    started = st.cursor * 4
    dropped = sum(m["staleness/dropped_samples"] for m in ms) + st.rollout_dropped
    assert started == len(trajs) + dropped + st.unconsumed_samples


def test_cli_sets_async_mode(tmp_path):
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "grpo", "system.mode=async", "steps=2", *SMALL,
           f"run_dir={tmp_path}", "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "done: 2 steps" in p.stdout
    assert "mode: async" in (tmp_path / "config.yaml").read_text()


def test_worker_failure_fails_loudly(tmp_path, monkeypatch):
    from posttrain.loop import producer as P

    def boom(self, call):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(P.Rollout, "run_call", boom)
    with pytest.raises(RuntimeError, match="rollout worker failed: RuntimeError: engine exploded"):
        train(_cfg(tmp_path, "steps=2", "system.mode=async"))


def test_infra_failed_requests_become_infra_error_never_zero(tmp_path):
    """A backend's failed request (generate_detailed) ends as counted infra_error samples."""
    ro, eng = _scripted(tmp_path, {"a": [1, 1], "b": [2, 2]})

    class Failing:
        version = 0

        def generate_detailed(self, requests, *, finish_target=None):
            comps = eng.generate([r for r in requests if "t/b" not in r.request_id], finish_target=finish_target)
            failed = [types.SimpleNamespace(request=r, reason="worker died") for r in requests if "t/b" in r.request_id]
            return types.SimpleNamespace(completions=comps, failed=failed)

    ro.run.engine = Failing()
    groups, _ = ro.run_call(0)
    by = {g[0].group_id: g for g in groups}
    assert [t.status for t in by["s1r0p1-t/b"]] == [Status.INFRA_ERROR] * 2
    assert all(t.reward.total is None for t in by["s1r0p1-t/b"])
    assert all(t.status is not Status.INFRA_ERROR for t in by["s1r0p0-t/a"])


