"""Atomic checkpoints: round trip, from_pretrained, RNG, and crashes mid-save."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.learner import checkpoint as ckpt
from posttrain.learner.actor import PolicyLearner
from posttrain.learner.critic import CriticLearner, ValueModel
from posttrain.models import build_char_tokenizer


def _trained(make_model, make_batch, make_advantages):
    batch = make_batch(n=4)
    learner = PolicyLearner(make_model(dtype=torch.float32), lr=1e-2, num_minibatches=2, seed=4)
    critic = CriticLearner(ValueModel.from_actor(learner.model), lr=1e-2)
    adv = make_advantages(batch)
    learner.update(batch, adv)
    critic.update(batch, adv.to(torch.float64))
    return batch, learner, critic


def _save(path, learner, critic, step, extra=None):
    return ckpt.save_checkpoint(
        path,
        step=step,
        actor=learner.model,
        tokenizer=build_char_tokenizer(),
        critic=critic,  # a CriticLearner saves its value model
        learner_state={"policy": learner.state_dict(), "critic": critic.state_dict()},
        extra=extra or {"data_cursor": 12, "policy_version": learner.version, "kl": {"value": 0.05}},
    )


def test_round_trip(make_model, make_batch, make_advantages, tmp_path):
    batch, learner, critic = _trained(make_model, make_batch, make_advantages)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = _save(ckpt.checkpoint_path(tmp_path, 7), learner, critic, 7)
    assert path == tmp_path / "checkpoints" / "step_000007"
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    state = ckpt.load_checkpoint(path)
    assert state.step == 7 and state.extra == {"data_cursor": 12, "policy_version": 1, "kl": {"value": 0.05}}
    # A fresh learner gets identical weights and optimizer / scheduler / shuffle state.
    fresh = PolicyLearner(make_model(dtype=torch.float32, seed=99), lr=1e-2, num_minibatches=2, seed=0)
    ckpt.restore_actor(fresh.model, state)
    fresh.load_state_dict(state.learner_state["policy"])
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, fresh.model.state_dict()[k]), k
    assert fresh.version == learner.version and torch.equal(
        fresh.generator.get_state(), learner.generator.get_state()
    )
    opt_a, opt_b = learner.optimizer.state_dict(), fresh.optimizer.state_dict()
    for i, s in opt_a["state"].items():
        assert torch.equal(s["exp_avg_sq"], opt_b["state"][i]["exp_avg_sq"])
    # The critic comes back too.
    vm = ValueModel.from_actor(fresh.model, seed=8)
    vm.load(state.critic_dir)
    with torch.no_grad():
        assert torch.equal(
            vm(batch.input_ids, batch.attention_mask)[0],
            critic.model(batch.input_ids, batch.attention_mask)[0],
        )
    # The same weights through a strict load_state_dict (tied lm_head included).
    strict = make_model(dtype=torch.float32, seed=98)
    strict.load_state_dict(state.actor_state_dict())
    assert torch.equal(strict.lm_head.weight, learner.model.lm_head.weight)
    # RNG: restoring reproduces the draws taken right after the save.
    ckpt.restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    # The actor dir is an ordinary from_pretrained folder with its tokenizer.
    hf = AutoModelForCausalLM.from_pretrained(state.actor_dir)
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, hf.state_dict()[k]), k
    tok = AutoTokenizer.from_pretrained(state.actor_dir)
    assert tok.encode("12+3") == build_char_tokenizer().encode("12+3")
    assert ckpt.latest_checkpoint(tmp_path) == path == ckpt.latest_checkpoint(tmp_path / "checkpoints")


def test_crash_mid_save_keeps_previous(make_model, make_batch, make_advantages, tmp_path, monkeypatch):
    _, learner, critic = _trained(make_model, make_batch, make_advantages)
    first = _save(ckpt.checkpoint_path(tmp_path, 1), learner, critic, 1)
    before = sorted(p.relative_to(first) for p in first.rglob("*"))

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "_write_learner_state", boom)
    for step in (2, 1):  # a new step, and overwriting the existing one
        with pytest.raises(OSError, match="simulated"):
            _save(ckpt.checkpoint_path(tmp_path, step), learner, critic, step)
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert sorted(p.relative_to(first) for p in first.rglob("*")) == before
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert ckpt.load_checkpoint(first).step == 1


def test_sigkill_mid_save_leaves_only_a_hidden_temp(make_model, tmp_path):
    model_dir = tmp_path / "m"
    make_model(dtype=torch.float32).save_pretrained(model_dir)
    ok = ckpt.save_checkpoint(
        ckpt.checkpoint_path(tmp_path, 1),
        step=1,
        actor=AutoModelForCausalLM.from_pretrained(model_dir),
        learner_state={},
    )
    # A writer killed (SIGKILL) after the weights but before the learner state.
    code = textwrap.dedent(f"""
        import os, signal
        from transformers import AutoModelForCausalLM
        from posttrain.learner import checkpoint as ckpt
        ckpt._write_learner_state = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r})
        ckpt.save_checkpoint(ckpt.checkpoint_path({str(tmp_path)!r}, 2), step=2, actor=m, learner_state={{}})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names[1] == "step_000001" and names[0].startswith(".step_000002.tmp-"), names
    assert ckpt.latest_checkpoint(tmp_path) == ok
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_000002")
    # The next save sweeps the dead writer's temp dir.
    ckpt.save_checkpoint(
        ckpt.checkpoint_path(tmp_path, 3),
        step=3,
        actor=AutoModelForCausalLM.from_pretrained(model_dir),
        learner_state={},
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000003"]


def test_latest_and_prune(make_model, tmp_path):
    m = make_model(dtype=torch.float32)
    assert ckpt.latest_checkpoint(tmp_path) is None
    for s in (3, 10, 2):
        ckpt.save_checkpoint(ckpt.checkpoint_path(tmp_path, s), step=s, actor=m, learner_state={})
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000010"  # by step, not by write order
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["step_000002"]
    meta = json.loads((ckpt.checkpoint_path(tmp_path, 3) / "meta.json").read_text())
    assert meta == {"format": 1, "step": 3, "extra": {}}
    with pytest.raises(ValueError, match="step_000012"):
        ckpt.save_checkpoint(tmp_path / "latest", step=1, actor=m, learner_state={})
    assert not os.path.exists(tmp_path / "latest")


def test_lora_checkpoint_saves_merged_actor_and_resumable_adapter(
    make_model, make_batch, make_advantages, tmp_path
):
    batch = make_batch(n=4)

    def build():
        return PolicyLearner(
            make_model(dtype=torch.float32), lr=5e-2, lora_rank=2, lora_target_modules=["q_proj"]
        )

    a = build()
    a.update(batch, make_advantages(batch))
    path = ckpt.save_checkpoint(
        ckpt.checkpoint_path(tmp_path, 1), step=1, actor=a.model, learner_state={"policy": a.state_dict()}
    )
    state = ckpt.load_checkpoint(path)
    assert state.adapter_dir is not None
    # actor/ is the merged plain model, the same weights the rollout engine gets.
    hf = AutoModelForCausalLM.from_pretrained(state.actor_dir)
    for k, v in a.weights_for_rollout().items():
        torch.testing.assert_close(hf.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
    # A fresh LoRA learner restores the adapter and optimizer: same log-probs, same next update.
    b = build()
    ckpt.restore_actor(b.model, state)
    b.load_state_dict(state.learner_state["policy"])
    assert torch.equal(a.compute_logprobs(batch), b.compute_logprobs(batch))
    with pytest.raises(ValueError, match="actor_adapter"):
        plain_state = ckpt.load_checkpoint(
            ckpt.save_checkpoint(
                ckpt.checkpoint_path(tmp_path, 2), step=2, actor=make_model(), learner_state={}
            )
        )
        ckpt.restore_actor(b.model, plain_state)
