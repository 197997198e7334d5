"""Credit across turns: GiGPO's step fields from episodes, hand-computed anchor grouping, and
observation tokens that never enter a ratio, a loss or a gradient (multi-turn batches)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_episode_rollout import TOK, ScriptedEngine, call, make_run  # noqa: E402

from posttrain.config import ConfigError  # noqa: E402
from posttrain.loop.targets import build_targets, step_fields  # noqa: E402
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Role, collate  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class ByEpisode(ScriptedEngine):
    """Episode j of the group follows ``plans[j]`` (its request ids end with ``/<j>@t<turn>``)."""

    def __init__(self, plans):
        super().__init__(None)
        self.plans = plans

    def generate(self, requests, finish_target=None):
        out = []
        for r in requests:
            j, turn = map(int, re.search(r"/(\d+)@t(\d+)$", r.request_id).groups())
            text = TOK.decode(r.prompt_ids)
            self.policy = lambda _t, j=j, turn=turn, text=text: self.plans[j](text, turn)
            out += super().generate([r])
        return out


def _ab(text):
    return re.search(r"(\d+)\*(\d+)=\?", text).groups()


def right(text, turn):  # call the tool, answer its result
    a, b = _ab(text)
    return call(f"{a}*{b}") if turn == 0 else f"<answer>{re.findall(r'<[|]tool[|]>(-?[0-9]+)', text)[-1]}</answer>"


def call_then_wrong(text, turn):  # same first step as ``right``, then a wrong answer
    a, b = _ab(text)
    return call(f"{a}*{b}") if turn == 0 else "<answer>7</answer>"


def no_call(text, turn):  # an invalid first step, then a wrong answer
    return "hmm" if turn == 0 else "<answer>7</answer>"


def _episodes():
    eng = ByEpisode([right, call_then_wrong, no_call])
    cfg, run, ro = make_run(eng, "sampling.prompts_per_step=1", "credit.estimator=gigpo")
    (g,), _ = ro.run_call(0)
    return cfg, g


def test_step_fields_follow_the_turns():
    _, g = _episodes()
    batch = collate(g, pad_token_id=0)
    index, anchor, rewards = step_fields(batch)
    assert anchor.shape == (3, 2) and rewards.tolist() == [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    for i, t in enumerate(g):
        turn_of = index[i, : t.length].tolist()
        roles = t.roles
        assert all((s == -1) == (r is not Role.ACTION) for s, r in zip(turn_of, roles, strict=True))
        assert sorted(set(turn_of) - {-1}) == [0, 1]
        assert t.steps.action_tokens == (turn_of.count(0), turn_of.count(1))
    assert (index[:, max(t.length for t in g):] == -1).all()  # padding
    # the first step of every episode is taken in the same start state; the tool result "a*b" is
    # the second state of episodes 0 and 1; episode 2 saw an invalid-action note instead
    assert anchor[0, 0] == anchor[1, 0] == anchor[2, 0]
    assert anchor[0, 1] == anchor[1, 1] != anchor[2, 1]


def test_gigpo_end_to_end_hand_computed():
    cfg, g = _episodes()
    batch = collate(g, pad_token_id=0)
    lp = batch.behavior_logprob.clone()
    tg = build_targets(batch, old_logprob=lp, ref_logprob=None, values=None, estimator="gigpo",
                       estimator_kwargs={"omega": 1.0, "gamma": 0.95, "norm_std": False})
    # episode level: R = [1, 0, 0] -> R - mean = [2/3, -1/3, -1/3]
    # step 0 (one anchor group of all three): returns [0.95 * 1, 0, 0] -> minus mean 0.95/3
    # step 1: episodes 0 and 1 share an anchor: returns [1, 0] -> [+0.5, -0.5]; episode 2 alone -> 0
    want = [[2 / 3 + 0.95 * 2 / 3, 2 / 3 + 0.5], [-1 / 3 - 0.95 / 3, -1 / 3 - 0.5], [-1 / 3 - 0.95 / 3, -1 / 3 + 0.0]]
    index, _, _ = step_fields(batch)
    for i in range(3):
        for s in (0, 1):
            got = tg.advantages[i][index[i] == s]
            assert torch.allclose(got, torch.full_like(got, want[i][s]), atol=1e-12), (i, s)
        assert (tg.advantages[i][index[i] == -1] == 0).all()


def test_gigpo_recipe_needs_episodes():
    with pytest.raises(ConfigError, match="set env.name"):
        load_run_config(None, ["credit.estimator=gigpo"])
    assert load_run_config(None, ["credit.estimator=gigpo", "env.name=calculator_tool"]).credit.estimator == "gigpo"


def _learner(*extra):
    from posttrain.loop.builders import build_learner, build_model

    cfg = load_run_config(None, ["model.path=builtin:micro", "env.name=calculator_tool", *extra])
    _, model = build_model(cfg)
    return build_learner(cfg, model)


@pytest.mark.parametrize("extra", [(), ("loss.policy_loss=decoupled_ppo",), ("correction.name=tis",)])
def test_observation_tokens_never_enter_ratio_loss_or_gradient(extra):
    _, g = _episodes()
    batch = collate(g, pad_token_id=0)
    obs = batch.role_codes == batch.role_codes.new_tensor(
        __import__("posttrain.trajectory.enums", fromlist=["ROLE_CODES"]).ROLE_CODES[Role.OBSERVATION])
    assert obs.any() and not (obs & (batch.action_mask > 0)).any()
    learner = _learner(*extra)
    old = learner.compute_logprobs(batch)
    adv = torch.where(batch.action_mask > 0, torch.linspace(-1, 1, batch.action_mask.numel()).view_as(old),
                      torch.zeros_like(old)).double()
    loss, grads = learner.compute_gradients(batch, adv, old_logprob=old)

    # Perturb everything that concerns observation tokens: their old / behaviour log-probs, their
    # advantages, and (a hook on the output head) the current log-probs the model gives them.
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(old.shape, generator=gen, dtype=old.dtype)
    old2 = torch.where(obs, old - noise.abs() - 0.1, old)
    adv2 = torch.where(obs, adv + 5.0, adv)
    batch2 = dataclasses.replace(batch, behavior_logprob=torch.where(obs, batch.behavior_logprob - 3.0,
                                                                     batch.behavior_logprob))
    loss2, grads2 = _with_head_noise(learner, g, Role.OBSERVATION, gen, batch2, adv2, old2)
    assert loss2 == pytest.approx(loss, abs=1e-9)
    for n in grads:
        assert torch.allclose(grads[n], grads2[n], atol=1e-7), n
    # control: the same noise on the positions that predict *action* tokens does change the loss
    loss3, _ = _with_head_noise(learner, g, Role.ACTION, gen, batch, adv, old)
    assert abs(loss3 - loss) > 1e-4


def _with_head_noise(learner, g, role, gen, batch, adv, old):
    """Loss and grads with random noise added to the final hidden state (a hook on the decoder's last norm,
    what the output head reads, on the full-logits and the chunked-head path alike) at every position whose
    next token has ``role``: the model's log-probs of those tokens change."""
    obs_next = {tuple(t.token_ids.tolist()): [r is role for r in t.roles[1:]] + [False] for t in g}

    def hook(module, inputs, output):
        ids = hook.ids
        bump = torch.zeros_like(output)
        for r in range(ids.shape[0]):
            row = ids[r].tolist()
            for key, m in obs_next.items():
                if tuple(row[: len(key)]) == key:
                    sel = torch.tensor(m + [False] * (len(row) - len(m)))
                    sel = sel[len(row) - output.shape[1]:]  # (the norm runs on every position: no-op)
                    bump[r, sel] = 7.0 * torch.randn(int(sel.sum()), output.shape[-1], generator=gen)
        return output + bump

    def pre(module, args, kwargs):
        hook.ids = kwargs.get("input_ids", args[0] if args else None)

    h1 = learner.model.get_decoder().register_forward_pre_hook(pre, with_kwargs=True)
    h2 = learner.model.get_decoder().norm.register_forward_hook(hook)
    try:
        return learner.compute_gradients(batch, adv, old_logprob=old)
    finally:
        h1.remove()
        h2.remove()


def test_critic_values_at_observation_tokens_never_reach_gae():
    """GAE over a multi-turn batch: whatever the critic outputs at observation / prompt positions,
    the advantages and value targets at action tokens are the same (observations are state)."""
    _, g = _episodes()
    batch = collate(g, pad_token_id=0)
    act = batch.action_mask > 0
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(batch.action_mask.shape, generator=gen, dtype=torch.float64)
    junk = torch.where(act, values, 1e3 * torch.randn(values.shape, generator=gen, dtype=torch.float64))
    final = torch.zeros(batch.size, dtype=torch.float64)
    a = build_targets(batch, values=values * act, final_values=final, estimator="gae")
    b = build_targets(batch, values=junk, final_values=final, estimator="gae")
    # bit-exact is sound here: both calls run the very same ops on the same shapes (GAE compacts the
    # action tokens first), only the values at observation positions differ
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
    obs = torch.stack([torch.tensor([r is Role.OBSERVATION for r in t.roles] + [False] * (batch.action_mask.shape[1] - t.length))
                       for t in g])
    assert obs.any() and (a.advantages[obs] == 0).all()


def test_episodes_train_with_a_critic_from_a_recipe(tmp_path):
    from posttrain.loop.training_loop import train

    cfg = load_run_config(None, ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none",
                             "env.max_turns=2", "env.max_tokens=120", "env.stop_strings=['e', 'o']",
                             "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=12",
                             "critic.enabled=true", "credit.estimator=gae", "eval.size=2", "eval.every=2", "steps=2",
                             "logging.progress=false", "guards.max_truncation_rate=1.0", f"run_dir={tmp_path}"])
    st = train(cfg)
    assert st.step == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    critic = [r for r in rows if any(k.startswith("critic/") for k in r)]
    assert critic and all(torch.isfinite(torch.tensor(v)) for r in critic for k, v in r.items()
                          if k.startswith("critic/") and isinstance(v, float))


def test_pass_at_k_over_held_out_episodes_hand_computed():
    """3 episodes per start, exactly one correct (``right``; the others answer 7 or never call):
    per start n = 3, c = 1, so pass@1 = 1/3 and pass@2 = 1 - C(2,2)/C(3,2) = 2/3."""
    from posttrain.loop.heldout import evaluate_episodes

    eng = ByEpisode([right, call_then_wrong, no_call])
    cfg, run, ro = make_run(eng)
    examples = run.task.examples("heldout", 4, seed=0)
    res = evaluate_episodes(ro.player, examples, temperature=1.0, samples=3, k=2)
    assert res.per_prompt == ((3, 1),) * 4
    m = res.passk_metrics()
    assert m["heldout/pass@1"] == pytest.approx(1 / 3) and m["heldout/pass@2"] == pytest.approx(2 / 3)
    assert res.accuracy == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="k <= samples"):
        evaluate_episodes(ro.player, examples, samples=2, k=3)


def test_episode_recipe_reports_pass_at_k(tmp_path):
    from posttrain.loop.training_loop import train

    cfg = load_run_config(None, ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none",
                             "env.max_turns=2", "env.max_tokens=120", "env.stop_strings=['e', 'o']",
                             "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=12",
                             "eval.size=3", "eval.every=1", "eval.samples=2", "eval.k=2",
                             "eval.sampled_temperature=1.0", "steps=1", "logging.progress=false",
                             "guards.max_truncation_rate=1.0", f"run_dir={tmp_path}"])
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "heldout/pass@2" in r]
    assert ev and all(r["heldout/pass@2_samples"] == 2.0 for r in ev)
