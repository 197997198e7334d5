"""The policy learner: split invariance, ratio = 1 at lr = 0, learning, state, rollout weights."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos.kl import AdaptiveKLController
from posttrain.algos.registry import REDUCTIONS
from posttrain.learner.actor import PolicyLearner
from posttrain.trajectory import collate, make_trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, shape_rtol, update_rel_diff  # noqa: E402

MAX_LEN = 12  # generation budget for seq_mean_token_sum_norm (>= every row's action count)


def _red_kwargs(name):
    return {"max_len": MAX_LEN} if name == "seq_mean_token_sum_norm" else {}


def _perturbed_old(learner, batch, seed=5, scale=0.3):
    """pi_old != pi_theta so clipping and ratios are exercised (fixed noise on action tokens)."""
    g = torch.Generator().manual_seed(seed)
    old = learner.compute_logprobs(batch)
    noise = scale * torch.randn(old.shape, generator=g, dtype=torch.float64)
    return (old + noise).clamp(max=-1e-3) * batch.action_mask.to(torch.float64)


# Budgets for 16 rows of length <= 14: 1 -> one row per micro-batch; 4*14 and 16*14 -> at most
# 4 and 16 rows (16 = the whole batch in one pass); 23 -> an irregular split (1-3 rows each).
BUDGETS = [1, 4 * 14, 16 * 14, 23]


@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
def test_gradients_invariant_to_microbatch_split(make_model, make_batch, make_advantages, reduction):
    batch = make_batch(n=16)
    assert int(batch.lengths.max()) <= 14
    adv = make_advantages(batch)
    # KL, entropy and a behavior correction switched on too: every term must be split-invariant.
    kw = dict(
        policy_loss="ppo_clip",
        policy_loss_kwargs={"eps_low": 0.1, "eps_high": 0.2},
        reduction=reduction,
        reduction_kwargs=_red_kwargs(reduction),
        kl_estimator="k3",
        kl_coef=0.05,
        entropy_coef=0.01,
        correction="tis",
        correction_kwargs={"cap": 1.5},
    )
    ref_model = make_model(seed=7)
    ref = PolicyLearner(ref_model, lr=0.0, **{k: v for k, v in kw.items() if k.startswith("red")})
    ref_lp = ref.compute_logprobs(batch)
    batch = batch.freeze("ref", ref_lp, 0)
    results = []
    for budget in BUDGETS:
        learner = PolicyLearner(make_model(), lr=1e-3, microbatch_tokens=budget, **kw)
        old = _perturbed_old(learner, batch)
        results.append(learner.compute_gradients(batch, adv, old_logprob=old))
    loss0, g0 = results[0]
    assert math.isfinite(loss0) and loss0 != 0.0
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-4  # the gradient is not trivially 0
    # Different micro-batch shapes: equal up to float rounding (tests/_tolerance.py), not bitwise.
    rtol = shape_rtol(int(batch.lengths.max()))
    for budget, (loss, g) in zip(BUDGETS[1:], results[1:], strict=True):
        assert loss == pytest.approx(loss0, rel=rtol), budget
        assert_grads_close(g, g0, rtol, msg=f"budget={budget}")


def _local_normaliser(learner):
    """Inject the classic bug: each micro-batch normalises by its OWN sequence and token counts."""
    orig = learner._reduction

    def local(mask, *, num_sequences, num_tokens, **kw):
        return orig(mask, num_sequences=int((mask.sum(dim=1) > 0).sum()), num_tokens=float(mask.sum()), **kw)

    learner._reduction = local
    return learner


@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
def test_split_tolerance_catches_local_normaliser(make_model, make_batch, make_advantages, reduction):
    """The shape tolerance is loose enough for any CPU BLAS and still tight enough to catch the bug
    the split tests are about: a per-micro-batch denominator moves the gradient far outside it."""
    batch = make_batch(n=16)
    adv = make_advantages(batch)
    kw = dict(reduction=reduction, reduction_kwargs=_red_kwargs(reduction))
    whole = PolicyLearner(make_model(), lr=1e-3, **kw)
    old = _perturbed_old(whole, batch)
    loss0, g0 = whole.compute_gradients(batch, adv, old_logprob=old)
    buggy = _local_normaliser(PolicyLearner(make_model(), lr=1e-3, microbatch_tokens=23, **kw))
    loss, g = buggy.compute_gradients(batch, adv, old_logprob=old)
    rtol = shape_rtol(int(batch.lengths.max()))
    assert abs(loss - loss0) > 100 * rtol * abs(loss0)
    with pytest.raises(AssertionError, match="max\\|g-g_ref\\|"):
        assert_grads_close(g, g0, 100 * rtol)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "cispo", "gspo", "reinforce"])
def test_update_invariant_to_split_across_losses(make_model, make_batch, make_advantages, policy_loss):
    """A whole update (AdamW step, 2 mini-batches) lands on the same weights for any split."""
    batch = make_batch(n=8)
    adv = make_advantages(batch)
    start = {k: v.detach().clone() for k, v in make_model().state_dict().items()}
    finals = []
    for budget in (1, 30, None, "bug"):
        learner = PolicyLearner(
            make_model(),
            lr=1e-3,
            microbatch_tokens=30 if budget == "bug" else budget,
            policy_loss=policy_loss,
            num_minibatches=2,
            seed=3,
        )
        if budget == "bug":
            _local_normaliser(learner)
        old = _perturbed_old(learner, batch, scale=0.01)
        learner.update(batch, adv, old_logprob=old)
        finals.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
    # Whole updates compared as ||dw - dw_ref|| / ||dw_ref|| (see update_rel_diff for why not per
    # element). Adam's per-element normalisation amplifies the gradient's rounding error on elements
    # whose gradient is near its eps, hence 100x the gradient tolerance (measured: ~1e-6 relative);
    # the injected local-normaliser bug moves the update by >= 3e-2 relative (gspo), 0.9 (others).
    rtol = 100 * shape_rtol(int(batch.lengths.max()))
    *splits, bug = finals
    for other in splits[1:]:
        assert update_rel_diff(other, splits[0], start) <= rtol
    assert update_rel_diff(bug, splits[0], start) > 10 * rtol


def test_ratio_is_one_at_lr_zero(make_model, make_batch, make_advantages):
    # float32 (the CPU default): old log-probs are recomputed by the same micro-batched forward,
    # so pi_theta / pi_old is exactly 1 on every action token and nothing is clipped.
    batch = make_batch(n=8)
    learner = PolicyLearner(make_model(dtype=torch.float32), lr=0.0, microbatch_tokens=40)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    m = learner.update(batch, make_advantages(batch))
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["ratio_mean"] == 1.0
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    assert m["tokens_trained"] == float(batch.action_mask.sum())
    assert m["grad_norm"] > 0 and m["optimizer_steps"] == 1.0 and m["lr"] == 0.0
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_learning_raises_logprob_of_rewarded_rows(make_model, make_batch):
    batch = make_batch(n=6)
    mask = batch.action_mask.to(torch.float64)
    # Rows 0-2 advantage +1, rows 3-5 advantage -1 (sequence-level, broadcast by the learner).
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    learner = PolicyLearner(make_model(dtype=torch.float32), lr=3e-3, reduction="seq_mean_token_mean")

    def seq_lp():
        return (learner.compute_logprobs(batch) * mask).sum(dim=1)

    start = seq_lp()
    for _ in range(8):
        learner.update(batch, adv)  # on-policy: old log-probs recomputed each call
    end = seq_lp()
    assert (end[:3] > start[:3] + 0.5).all(), (start, end)
    assert (end[3:] < start[3:] - 0.5).all(), (start, end)
    assert learner.version == 8


def test_clipping_is_reported(make_model, make_batch):
    batch = make_batch(n=8)
    learner = PolicyLearner(make_model(), lr=0.0, policy_loss_kwargs={"eps_low": 0.05, "eps_high": 0.05})
    old = learner.compute_logprobs(batch)
    # pi_old 0.5 nats below pi_theta: ratio e^0.5 > 1.05 everywhere -> clipped_high on A > 0 tokens.
    adv = torch.ones(batch.size, dtype=torch.float64)
    m = learner.update(batch, adv, old_logprob=(old - 0.5) * batch.action_mask)
    assert m["clip_frac_high"] == pytest.approx(1.0)
    assert m["ratio_min"] == pytest.approx(math.exp(0.5), rel=1e-9)


def test_zero_advantages_and_empty_minibatch_are_safe(make_model, make_batch):
    batch = make_batch(n=4)
    learner = PolicyLearner(make_model(), lr=1e-2)
    # A first step with signal gives AdamW momentum; an all-zero-advantage batch after it must not move
    # the weights (no optimizer step on a zero gradient), and says so.
    learner.update(batch, torch.linspace(-1, 1, batch.size, dtype=torch.float64))
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    m = learner.update(batch, torch.zeros(batch.size, dtype=torch.float64))
    assert m["grad_norm"] == 0.0 and m["loss"] == 0.0 and all(math.isfinite(v) for v in m.values())
    assert m["zero_grad_steps"] == 1.0 and m["optimizer_steps"] == 0.0
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # A prompt-only row (no action token) alone in a mini-batch: skipped, counted, no NaN.
    t = make_trajectory(
        traj_id="x",
        prompt_id="x",
        group_id="x",
        prompt_ids=[5, 6, 7],
        action_ids=[],
        action_logprobs=[],
        action_versions=0,
        finish="truncated",
    )
    b1 = collate([t])
    m = PolicyLearner(make_model(), lr=1e-2).update(b1, torch.ones(1, dtype=torch.float64))
    assert m["empty_minibatches"] == 1.0 and m["optimizer_steps"] == 0.0


def test_adaptive_kl_controller_and_state_round_trip(make_model, make_batch, make_advantages):
    batch = make_batch(n=8)
    ref = PolicyLearner(make_model(seed=9), lr=0.0)
    batch = batch.freeze("ref", ref.compute_logprobs(batch), 0)
    adv = make_advantages(batch)

    def build():
        ctrl = AdaptiveKLController(init_coef=0.1, target_kl=0.01, horizon=100)
        return PolicyLearner(
            make_model(),
            lr=1e-3,
            kl_estimator="k3",
            kl_coef=ctrl,
            num_minibatches=2,
            ppo_epochs=2,
            lr_schedule="cosine",
            warmup_steps=1,
            total_steps=10,
            seed=11,
        ), ctrl

    a, ctrl_a = build()
    m = a.update(batch, adv)
    assert m["kl"] > 0 and m["kl_coef"] == 0.1 and m["optimizer_steps"] == 4.0
    ctrl_a.update(m["kl"], n_steps=batch.size)
    state = copy.deepcopy(a.state_dict())  # state_dict holds live optimizer tensors
    weights = {k: v.clone() for k, v in a.model.state_dict().items()}
    # Resume: fresh learner, weights + state loaded -> the next update is identical.
    b, ctrl_b = build()
    b.model.load_state_dict(weights)
    b.load_state_dict(state)
    assert ctrl_b.value == ctrl_a.value != 0.1 and b.version == 1 and b.current_lr() == a.current_lr()
    ma, mb = a.update(batch, adv), b.update(batch, adv)
    assert ma == mb
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])


def test_weights_for_rollout_is_the_live_state_dict(make_model, make_batch, make_advantages):
    batch = make_batch(n=4)
    learner = PolicyLearner(make_model(), lr=1e-2)
    w = learner.weights_for_rollout()
    p = dict(learner.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert w["model.layers.0.mlp.up_proj.weight"].data_ptr() == p.data_ptr()  # no copy
    assert learner.version == 0
    learner.update(batch, make_advantages(batch))
    assert learner.version == 1


def test_bad_input_errors(make_model, make_batch):
    batch = make_batch(n=3)
    with pytest.raises(KeyError, match="valid"):
        PolicyLearner(make_model(), policy_loss="nope")
    with pytest.raises(ValueError, match="max_len"):
        PolicyLearner(make_model(), reduction="seq_mean_token_sum_norm")
    learner = PolicyLearner(make_model(), kl_estimator="k3", kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprob"):
        learner.update(batch, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="advantages have shape"):
        PolicyLearner(make_model()).update(batch, torch.zeros(2, dtype=torch.float64))


def test_lora_trains_only_adapters_and_exports_merged_weights(make_model, make_batch, make_advantages):
    batch = make_batch(n=4)
    base = make_model(dtype=torch.float32)
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    learner = PolicyLearner(base, lr=5e-2, lora_rank=2, lora_target_modules=["q_proj", "v_proj"])
    assert all("lora_" in n for n, p in learner.model.named_parameters() if p.requires_grad)
    for _ in range(2):
        learner.update(batch, make_advantages(batch))
    merged = learner.weights_for_rollout()
    assert set(merged) == set(frozen)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], frozen["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        merged["model.layers.0.mlp.up_proj.weight"], frozen["model.layers.0.mlp.up_proj.weight"]
    )
    # A plain model loaded with the merged weights reproduces the adapted policy's log-probs.
    plain = make_model(dtype=torch.float32)
    plain.load_state_dict(merged)
    lp_plain = PolicyLearner(plain, lr=0.0).compute_logprobs(batch)
    torch.testing.assert_close(lp_plain, learner.compute_logprobs(batch), rtol=0, atol=1e-5)


def test_bf16_autocast_runs_and_stays_close(make_model, make_batch, make_advantages):
    # CPU supports bfloat16 autocast; log-probs come back in float32 and near the fp32 ones.
    batch = make_batch(n=4)
    fp32 = PolicyLearner(make_model(dtype=torch.float32), lr=0.0)
    bf16 = PolicyLearner(make_model(dtype=torch.float32), lr=0.0, autocast_dtype="bfloat16")
    lp32, lp16 = fp32.compute_logprobs(batch), bf16.compute_logprobs(batch)
    assert not torch.equal(lp32, lp16)  # autocast really changed the arithmetic
    torch.testing.assert_close(lp16, lp32, rtol=0, atol=0.1)
    m = bf16.update(batch, make_advantages(batch))
    assert m["ratio_min"] == 1.0 == m["ratio_max"] and math.isfinite(m["loss"])
    with pytest.raises(ValueError, match="autocast_dtype"):
        PolicyLearner(make_model(), autocast_dtype="int8")


@settings(max_examples=12, deadline=None)
@given(
    budget=st.integers(1, 120),
    reduction=st.sampled_from(sorted(REDUCTIONS)),
    perm_seed=st.integers(0, 10_000),
)
def test_property_split_and_row_order_invariance(
    make_model, make_batch, make_advantages, budget, reduction, perm_seed
):
    """Any token budget and any row order give the whole-batch loss and gradient."""
    batch = make_batch(n=10, seed=6)
    adv = make_advantages(batch, seed=7)
    kw = dict(
        reduction=reduction, reduction_kwargs=_red_kwargs(reduction), policy_loss_kwargs={"eps_high": 0.28}
    )
    ref = PolicyLearner(make_model(), **kw)
    old = _perturbed_old(ref, batch)
    loss0, g0 = ref.compute_gradients(batch, adv, old_logprob=old)
    perm = torch.randperm(batch.size, generator=torch.Generator().manual_seed(perm_seed))
    shuffled = collate([batch.trajectories[i] for i in perm.tolist()])
    other = PolicyLearner(make_model(), microbatch_tokens=budget, **kw)
    loss, g = other.compute_gradients(shuffled, adv[perm], old_logprob=old[perm])
    rtol = shape_rtol(int(batch.lengths.max()))
    assert loss == pytest.approx(loss0, rel=rtol)
    assert_grads_close(g, g0, rtol)


def test_staleness_correction_drops_old_rows(make_model):
    # Rows sampled by versions 0 and 1; the learner is at version 1 (after one update) and
    # max_staleness = 0: only the version-1 rows train.
    trajs = [
        make_trajectory(
            traj_id=f"t{i}",
            prompt_id="p",
            group_id="g",
            prompt_ids=[5, 6],
            action_ids=[7, 8, 9][: 1 + i],
            action_logprobs=[-1.0] * (1 + i),
            action_versions=i % 2,
            finish="terminal",
        )
        for i in range(3)
    ]  # versions 0, 1, 0 with 1, 2, 3 action tokens
    batch = collate(trajs)
    learner = PolicyLearner(
        make_model(), lr=1e-3, correction="staleness", correction_kwargs={"max_staleness": 0}
    )
    learner.version = 1
    m = learner.update(batch, torch.ones(3, dtype=torch.float64))
    assert m["tokens_trained"] == 2.0  # row 1 only
    assert m["correction/kept_token_frac"] == pytest.approx(2 / 6)


def test_gradient_checkpointing_gives_the_same_gradients(
    make_model, make_batch, make_advantages, monkeypatch
):
    batch = make_batch(n=6)
    adv = make_advantages(batch)
    plain = PolicyLearner(make_model(), microbatch_tokens=30)
    old = _perturbed_old(plain, batch)
    mlp_cls = type(plain.model.model.layers[0].mlp)
    calls = [0]
    forward = mlp_cls.forward

    def counting(self, x):
        calls[0] += 1
        return forward(self, x)

    monkeypatch.setattr(mlp_cls, "forward", counting)
    loss0, g0 = plain.compute_gradients(batch, adv, old_logprob=old)
    plain_calls, calls[0] = calls[0], 0
    ckpt_learner = PolicyLearner(make_model(), microbatch_tokens=30, gradient_checkpointing=True)
    loss, g = ckpt_learner.compute_gradients(batch, adv, old_logprob=old)
    assert calls[0] == 2 * plain_calls  # each layer's forward is recomputed in the backward pass
    assert not ckpt_learner.model.training  # back in eval mode after the gradient forward
    assert loss == pytest.approx(loss0, abs=1e-12)
    for name in g0:
        torch.testing.assert_close(g[name], g0[name], rtol=0, atol=1e-10, msg=name)
    dropout_model = make_model()
    dropout_model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        PolicyLearner(dropout_model, gradient_checkpointing=True)


def test_lora_update_raises_rewarded_rows(make_model, make_batch):
    """LoRA adapters learn in the right direction: +1 rows up, -1 rows down (as full fine-tuning)."""
    batch = make_batch(n=6)
    mask = batch.action_mask.to(torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    learner = PolicyLearner(make_model(dtype=torch.float32), lr=3e-3, reduction="seq_mean_token_mean", lora_rank=8,
                            lora_target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def seq_lp():
        return (learner.compute_logprobs(batch) * mask).sum(dim=1)

    start = seq_lp()
    for _ in range(8):
        learner.update(batch, adv)
    delta = seq_lp() - start
    assert (delta[:3] > 0.3).all() and (delta[3:] < -0.3).all(), delta


@pytest.mark.parametrize("kl", [False, True])
def test_fused_old_logprob_equals_the_two_forward_update(make_model, make_batch, make_advantages, kl):
    """One optimizer step per update: pi_old from the update's own forward (detached) gives the same
    recorded pi_old and the same weights as a separate no-grad forward first (issue 12, part 2)."""
    batch = make_batch(n=12)
    adv = make_advantages(batch)
    kw = dict(lr=1e-2, microbatch_tokens=40, entropy_coef=0.01)
    if kl:
        ref = PolicyLearner(make_model(seed=7), lr=0.0).compute_logprobs(batch)
        batch = batch.freeze("ref", ref, 0)
        kw.update(kl_estimator="k3", kl_coef=0.1)
    two = PolicyLearner(make_model(), **kw)
    old = two.compute_logprobs(batch)
    m_two = two.update(batch, adv, old_logprob=old)
    fused = PolicyLearner(make_model(), **kw)
    assert fused.can_fuse_old_logprob()
    calls = []
    fused.compute_logprobs = lambda b: calls.append(b)  # the fused update must not run this forward
    m_fused = fused.update(batch, adv, fuse_old=True)
    # Same weights, same micro-batches: the grad forward and the no-grad forward agree to rounding.
    rtol = shape_rtol(int(batch.lengths.max()))
    assert m_fused.old_logprob is not None
    assert (m_fused.old_logprob[batch.action_mask == 0] == 0).all()
    torch.testing.assert_close(m_fused.old_logprob, old, rtol=0, atol=rtol * float(old.abs().max()))
    start = make_model().state_dict()
    assert update_rel_diff(fused.model.state_dict(), two.model.state_dict(), start) <= 100 * rtol
    for k in ("loss", "grad_norm", "kl", "entropy", "logkappa_abs_max", "tokens_trained"):
        assert m_fused[k] == pytest.approx(m_two[k], rel=1e-6, abs=1e-9), k
    assert m_fused["ratio_min"] == m_fused["ratio_max"] == 1.0
    assert calls == []


def test_fused_old_logprob_is_refused_where_it_would_be_wrong(make_model, make_batch, make_advantages):
    batch = make_batch(n=6)
    adv = make_advantages(batch)
    for kw in ({"ppo_epochs": 2}, {"num_minibatches": 2}, {"correction": "tis"}):
        learner = PolicyLearner(make_model(), **kw)
        assert not learner.can_fuse_old_logprob()
        with pytest.raises(ValueError, match="fuse_old"):
            learner.update(batch, adv, fuse_old=True)
