"""Advantage estimators against hand-computed values, plus invariances (GAE ignores observations)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos import ADVANTAGES
from posttrain.algos.advantages import (
    AdvantageInputs,
    discounted_returns,
    dr_grpo,
    gae,
    gigpo,
    grpo,
    place_at_last_action,
    reinforce,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)

D = torch.float64


def t(x: object, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def test_every_registered_name_is_covered_here() -> None:
    assert sorted(ADVANTAGES) == sorted(
        [
            "gae",
            "grpo",
            "dr_grpo",
            "rloo",
            "reinforce",
            "reinforce_pp",
            "reinforce_pp_baseline",
            "remax",
            "gigpo",
        ]
    )
    assert ADVANTAGES["gae"] is gae and ADVANTAGES["gigpo"] is gigpo


# ------------------------------------------------------------------------------------------ GAE


# 2-step trajectory, gamma=0.9, lam=0.8 (gamma*lam = 0.72), r = [0, 1] (R=1 at the last action),
# V = [0.5, 0.6].
#   terminal:   d1 = 1 + 0.9*0 - 0.6 = 0.4           A1 = 0.4
#               d0 = 0 + 0.9*0.6 - 0.5 = 0.04        A0 = 0.04 + 0.72*0.4 = 0.328
#               returns = A + V = [0.828, 1.0]
#   truncated, V(s_final)=2.0:
#               d1 = 1 + 0.9*2.0 - 0.6 = 2.2         A1 = 2.2
#               A0 = 0.04 + 0.72*2.2 = 1.624         returns = [2.124, 2.8]
def test_gae_two_step_terminal_and_truncated_with_prompt_and_padding() -> None:
    # [prompt, a0, a1, pad]: prompt and padding values/rewards must not matter.
    mask = t([[0, 1, 1, 0], [0, 1, 1, 0]])
    values = t([[9.0, 0.5, 0.6, 9.0], [-3.0, 0.5, 0.6, 7.0]])
    out = gae(
        AdvantageInputs(
            action_mask=mask,
            rewards=t([1.0, 1.0]),
            values=values,
            terminal=torch.tensor([True, False]),
            bootstrap_value=t([99.0, 2.0]),  # row 0 is terminal: its bootstrap must be ignored
        ),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(out.advantages, t([[0, 0.328, 0.4, 0], [0, 1.624, 2.2, 0]]))
    assert out.returns is not None
    torch.testing.assert_close(out.returns, t([[0, 0.828, 1.0, 0], [0, 2.124, 2.8, 0]]))


# 3-step trajectory, r = [1, 0, 2] (token rewards), V = [1.0, 0.5, 0.25], gamma=0.9, lam=0.8:
#   d0 = 1 + 0.9*0.5 - 1.0 = 0.45,  d1 = 0 + 0.9*0.25 - 0.5 = -0.275
#   terminal:  d2 = 2 - 0.25 = 1.75; A2 = 1.75; A1 = -0.275 + 0.72*1.75 = 0.985;
#              A0 = 0.45 + 0.72*0.985 = 1.1592
#   truncated with V(s_final)=1.0: d2 = 2 + 0.9 - 0.25 = 2.65; A2 = 2.65;
#              A1 = -0.275 + 0.72*2.65 = 1.633; A0 = 0.45 + 0.72*1.633 = 1.62576
def test_gae_three_step_terminal_vs_truncated() -> None:
    mask = t([[1, 1, 1], [1, 1, 1]])
    out = gae(
        AdvantageInputs(
            action_mask=mask,
            token_rewards=t([[1, 0, 2], [1, 0, 2]]),
            values=t([[1.0, 0.5, 0.25], [1.0, 0.5, 0.25]]),
            terminal=torch.tensor([True, False]),
            bootstrap_value=t([0.0, 1.0]),
        ),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(out.advantages, t([[1.1592, 0.985, 1.75], [1.62576, 1.633, 2.65]]))
    assert out.returns is not None
    torch.testing.assert_close(out.returns, t([[2.1592, 1.485, 2.0], [2.62576, 2.133, 2.9]]))


# Monte-Carlo return-to-go, gamma=0.9, r = [1, 0, 2]:
#   terminal:            G2 = 2,        G1 = 0.9*2 = 1.8,   G0 = 1 + 0.9*1.8 = 2.62
#   truncated, boot=1.0: G2 = 2 + 0.9 = 2.9, G1 = 2.61,     G0 = 1 + 0.9*2.61 = 3.349
#   2-step r = [0, 1] terminal: G1 = 1, G0 = 0.9
def test_mc_returns_hand_values_and_gae_lambda_one_matches() -> None:
    mask = t([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    rew = t([[1, 0, 2], [1, 0, 2], [0, 1, 0]])
    term = torch.tensor([True, False, True])
    boot = t([0.0, 1.0, 0.0])
    g = discounted_returns(rew, mask, gamma=0.9, terminal=term, bootstrap_value=boot)
    expected = t([[2.62, 1.8, 2.0], [3.349, 2.61, 2.9], [0.9, 1.0, 0.0]])
    torch.testing.assert_close(g, expected)
    # GAE with lam = 1 telescopes to the MC return: returns == G whatever the values are.
    out = gae(
        AdvantageInputs(
            action_mask=mask,
            token_rewards=rew,
            values=t([[0.3, -1, 4], [2, 2, 2], [5, 1, 0]]),
            terminal=term,
            bootstrap_value=boot,
        ),
        gamma=0.9,
        lam=1.0,
    )
    assert out.returns is not None
    torch.testing.assert_close(out.returns, expected)


def test_gae_ignores_observation_tokens_hand_case() -> None:
    # Same 3 actions as above, with two tool-observation tokens between a0 and a1 (and a prompt).
    # Observation positions carry garbage values; they must be skipped as time steps.
    mask = t([[0, 1, 0, 0, 1, 1]])
    out = gae(
        AdvantageInputs(
            action_mask=mask,
            token_rewards=t([[0, 1, 0, 0, 0, 2]]),
            values=t([[5.0, 1.0, 77.0, -8.0, 0.5, 0.25]]),
        ),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(out.advantages, t([[0, 1.1592, 0, 0, 0.985, 1.75]]))


@settings(max_examples=40, deadline=None)
@given(
    n_actions=st.integers(1, 6),
    data=st.data(),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    terminal=st.booleans(),
)
def test_gae_invariant_to_inserted_observation_tokens(
    n_actions: int, data: st.DataObject, gamma: float, lam: float, terminal: bool
) -> None:
    fl = st.floats(-3, 3, allow_nan=False)
    rew = data.draw(st.lists(fl, min_size=n_actions, max_size=n_actions))
    val = data.draw(st.lists(fl, min_size=n_actions, max_size=n_actions))
    inserts = data.draw(st.lists(st.integers(0, 3), min_size=n_actions, max_size=n_actions))
    boot = data.draw(fl)
    inp = AdvantageInputs(
        action_mask=torch.ones(1, n_actions, dtype=D),
        token_rewards=t([rew]),
        values=t([val]),
        terminal=torch.tensor([terminal]),
        bootstrap_value=t([boot]),
    )
    ref = gae(inp, gamma=gamma, lam=lam)
    # Interleave k_i observation tokens (mask 0, zero reward, random value) before each action.
    mask, r2, v2 = [], [], []
    for i in range(n_actions):
        for _ in range(inserts[i]):
            mask.append(0.0)
            r2.append(0.0)
            v2.append(data.draw(fl))
        mask.append(1.0)
        r2.append(rew[i])
        v2.append(val[i])
    out = gae(
        AdvantageInputs(
            action_mask=t([mask]),
            token_rewards=t([r2]),
            values=t([v2]),
            terminal=torch.tensor([terminal]),
            bootstrap_value=t([boot]),
        ),
        gamma=gamma,
        lam=lam,
    )
    on = t([mask]) > 0
    torch.testing.assert_close(out.advantages[on], ref.advantages[0])
    assert out.returns is not None and ref.returns is not None
    torch.testing.assert_close(out.returns[on], ref.returns[0])
    assert bool((out.advantages[~on] == 0).all())


def test_gae_errors_and_invalid_rows() -> None:
    mask = t([[1, 1]])
    with pytest.raises(ValueError, match="bootstrap_value"):
        gae(
            AdvantageInputs(
                action_mask=mask, rewards=t([1.0]), values=t([[0, 0]]), terminal=torch.tensor([False])
            )
        )
    with pytest.raises(ValueError, match="values"):
        gae(AdvantageInputs(action_mask=mask, rewards=t([1.0])))
    with pytest.raises(ValueError, match="off the action mask"):
        gae(AdvantageInputs(action_mask=t([[1, 0]]), token_rewards=t([[0, 1.0]]), values=t([[0, 0]])))
    out = gae(
        AdvantageInputs(
            action_mask=t([[1, 1], [1, 1]]),
            rewards=t([1.0, math.nan]),
            values=t([[0, 0], [0, 0]]),
            valid=torch.tensor([True, False]),
        ),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(out.advantages, t([[1, 1], [0, 0]]))


def test_place_at_last_action() -> None:
    got = place_at_last_action(t([2.0, 3.0, 4.0]), t([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]]))
    torch.testing.assert_close(got, t([[0, 2, 0, 0], [0, 0, 0, 3], [0, 0, 0, 0]]))


# ----------------------------------------------------------------------------------------- GRPO


def test_grpo_hand_values_and_broadcast() -> None:
    # rewards [1, 0, 1, 0]: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.5773503
    # A = +-0.5 / 0.5773503 = +-0.8660254 (eps=1e-6 shifts the 6th decimal only).
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    out = grpo(
        AdvantageInputs(action_mask=mask, rewards=t([1, 0, 1, 0]), group_index=torch.tensor([3, 3, 3, 3]))
    )
    a = 0.8660254
    expected = t([[a, a, 0], [-a, 0, 0], [a, a, a], [0, -a, -a]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)
    assert out.returns is None


def test_grpo_all_equal_rewards_give_exactly_zero() -> None:
    # float32 0.1 * 3: the group mean is not exactly 0.1, so a naive (r - mean) / (std + eps)
    # would return amplified float noise; the min_std rule returns exact zeros.
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float32)
    out = grpo(
        AdvantageInputs(action_mask=torch.ones(5, 2), rewards=r, group_index=torch.tensor([0, 0, 0, 1, 1]))
    )
    assert bool((out.advantages[:3] == 0).all())
    # group 1: mean 0.5, unbiased std = sqrt(0.5) -> A = +-0.5/0.7071068 = +-0.7071068
    torch.testing.assert_close(
        out.advantages[3:, 0], torch.tensor([0.7071068, -0.7071068]), atol=1e-5, rtol=0
    )


def test_grpo_tiny_std_gives_zero_not_nan_or_noise() -> None:
    out = grpo(
        AdvantageInputs(
            action_mask=torch.ones(2, 3, dtype=D), rewards=t([0.0, 1e-9]), group_index=torch.tensor([0, 0])
        )
    )
    assert bool(torch.isfinite(out.advantages).all())
    assert bool((out.advantages == 0).all())


def test_grpo_missing_results_are_zero_and_excluded_from_group_stats() -> None:
    # group 0 valid = {1, 0} (the NaN row is missing): mean 0.5, unbiased std sqrt(0.5) -> +-0.7071068
    # group 1 has one valid member -> 0; invalid rows -> 0.
    r = t([1.0, 0.0, math.nan, 3.0, 7.0])
    valid = torch.tensor([True, True, False, True, False])
    gidx = torch.tensor([0, 0, 0, 1, 1])
    out = grpo(
        AdvantageInputs(action_mask=torch.ones(5, 1, dtype=D), rewards=r, group_index=gidx, valid=valid)
    )
    torch.testing.assert_close(out.advantages[:, 0], t([0.7071068, -0.7071068, 0, 0, 0]), atol=1e-5, rtol=0)
    # Same as the batch without the missing rows.
    alone = grpo(
        AdvantageInputs(
            action_mask=torch.ones(3, 1, dtype=D),
            rewards=t([1.0, 0.0, 3.0]),
            group_index=torch.tensor([0, 0, 1]),
        )
    )
    torch.testing.assert_close(out.advantages[[0, 1, 3]], alone.advantages)


def test_grpo_without_std_and_dr_grpo() -> None:
    # rewards [1, 0, 0]: mean 1/3 -> [2/3, -1/3, -1/3]; other group [2, 4] -> [-1, 1]
    inp = AdvantageInputs(
        action_mask=torch.ones(5, 1, dtype=D),
        rewards=t([1, 0, 0, 2, 4]),
        group_index=torch.tensor([0, 0, 0, 1, 1]),
    )
    expected = t([2 / 3, -1 / 3, -1 / 3, -1, 1])
    torch.testing.assert_close(dr_grpo(inp).advantages[:, 0], expected)
    torch.testing.assert_close(grpo(inp, norm_std=False).advantages[:, 0], expected)


def test_group_estimators_need_group_index() -> None:
    inp = AdvantageInputs(action_mask=torch.ones(2, 1), rewards=torch.tensor([1.0, 0.0]))
    for fn in (grpo, dr_grpo, rloo, reinforce_pp_baseline):
        with pytest.raises(ValueError, match="group_index"):
            fn(inp)


# ----------------------------------------------------------------------------------------- RLOO


def test_rloo_hand_values() -> None:
    # group 0 rewards [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5
    #   -> A = [1-4, 2-3.5, 6-1.5] = [-3, -1.5, 4.5]; group 1 [0, 1] -> [-1, 1]
    inp = AdvantageInputs(
        action_mask=t([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1]]),
        rewards=t([1, 2, 6, 0, 1]),
        group_index=torch.tensor([5, 5, 5, 9, 9]),
    )
    out = rloo(inp)
    torch.testing.assert_close(out.advantages, t([[-3, -3], [-1.5, 0], [0, 4.5], [-1, -1], [1, 1]]))


def test_rloo_invalid_member_excluded() -> None:
    # [1, 2, (6 missing)] -> K = 2: A = [1 - 2, 2 - 1, 0]
    out = rloo(
        AdvantageInputs(
            action_mask=torch.ones(3, 1, dtype=D),
            rewards=t([1, 2, math.nan]),
            group_index=torch.tensor([0, 0, 0]),
            valid=torch.tensor([True, True, False]),
        )
    )
    torch.testing.assert_close(out.advantages[:, 0], t([-1, 1, 0]))


def test_rloo_k_below_two_is_a_clear_error_naming_the_group() -> None:
    inp = AdvantageInputs(
        action_mask=torch.ones(3, 1),
        rewards=torch.tensor([1.0, 0.0, 1.0]),
        group_index=torch.tensor([0, 0, 7]),
    )
    with pytest.raises(ValueError, match=r"7: 1"):
        rloo(inp)
    # K drops to 1 because of a missing result: still an error.
    inp2 = AdvantageInputs(
        action_mask=torch.ones(2, 1),
        rewards=torch.tensor([1.0, 0.0]),
        group_index=torch.tensor([4, 4]),
        valid=torch.tensor([True, False]),
    )
    with pytest.raises(ValueError, match=r"4: 1"):
        rloo(inp2)


# --------------------------------------------------------------------------- REINFORCE / ReMax


def test_reinforce_batch_mean_baseline() -> None:
    # mean of [1, 2, 6] = 3 -> [-2, -1, 3]; with row 2 missing: mean 1.5 -> [-0.5, 0.5, 0]
    mask = torch.ones(3, 2, dtype=D)
    torch.testing.assert_close(
        reinforce(AdvantageInputs(action_mask=mask, rewards=t([1, 2, 6]))).advantages[:, 0], t([-2, -1, 3])
    )
    out = reinforce(
        AdvantageInputs(
            action_mask=mask, rewards=t([1, 2, math.nan]), valid=torch.tensor([True, True, False])
        )
    )
    torch.testing.assert_close(out.advantages, t([[-0.5, -0.5], [0.5, 0.5], [0, 0]]))


def test_remax_greedy_baseline() -> None:
    out = remax(
        AdvantageInputs(action_mask=t([[1, 1], [0, 1]]), rewards=t([1.0, 0.5]), baseline=t([0.5, 0.5]))
    )
    torch.testing.assert_close(out.advantages, t([[0.5, 0.5], [0, 0]]))
    with pytest.raises(ValueError, match="baseline"):
        remax(AdvantageInputs(action_mask=t([[1.0]]), rewards=t([1.0])))


# ---------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_token_returns_with_kl_and_batch_norm() -> None:
    # token_rewards (= -beta*KL) row0 [-0.1, -0.2], row1 [-0.3, pad]; R = [1, 0]; gamma = 1.
    # returns: row0 t1 = -0.2 + 1 = 0.8, t0 = -0.1 + 0.8 = 0.7; row1 t0 = -0.3
    # batch over 3 tokens: mean 0.4, devs [0.3, 0.4, -0.7], pop var = 0.74/3 = 0.2466667,
    # std = 0.4966555 -> A = [0.6040404, 0.8053872, -1.4094277]
    out = reinforce_pp(
        AdvantageInputs(
            action_mask=t([[1, 1], [1, 0]]),
            rewards=t([1.0, 0.0]),
            token_rewards=t([[-0.1, -0.2], [-0.3, 0.0]]),
        )
    )
    torch.testing.assert_close(
        out.advantages, t([[0.6040404, 0.8053872], [-1.4094277, 0]]), atol=1e-6, rtol=0
    )


def test_reinforce_pp_constant_batch_is_zero_not_nan() -> None:
    out = reinforce_pp(AdvantageInputs(action_mask=torch.ones(3, 2), rewards=torch.tensor([0.3, 0.3, 0.3])))
    assert bool((out.advantages == 0).all())


def test_reinforce_pp_baseline_group_mean_then_batch_norm() -> None:
    # R = [1, 0 | 1, 1] in groups [0, 0 | 1, 1]: R' = [0.5, -0.5, 0, 0]; lengths [2, 1, 1, 1].
    # tokens: [0.5, 0.5, -0.5, 0, 0]; mean 0.1; devs [.4, .4, -.6, -.1, -.1]; pop var = 0.70/5 = 0.14;
    # std = 0.3741657 -> A: row0 1.0690450, row1 -1.6035675, rows 2, 3 -0.2672612.
    # A missing 5th row (NaN) in group 1 must change nothing.
    inp = AdvantageInputs(
        action_mask=t([[1, 1], [1, 0], [0, 1], [1, 0], [1, 1]]),
        rewards=t([1, 0, 1, 1, math.nan]),
        group_index=torch.tensor([0, 0, 1, 1, 1]),
        valid=torch.tensor([True, True, True, True, False]),
    )
    out = reinforce_pp_baseline(inp)
    expected = t([[1.0690450, 1.0690450], [-1.6035675, 0], [0, -0.2672612], [-0.2672612, 0], [0, 0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------- GiGPO

A_, B_, C_ = 101, 202, 303  # anchor-state ids (e.g. hashes of the observation)


def _webshop_inputs() -> AdvantageInputs:
    # The seed's WebShop example. tau1 (success): s0 @A "2nd item" -> s1 @B "back" -> s2 @A "1st item", reward 1
    # at step 2. tau2 (fail): s0 @A "next page" -> s1 @C, no reward.
    # row 0 tokens: [prompt, a0, a0, obs, a1, obs, a2, a2];  row 1: [prompt, a0, obs, a1, a1, pad, pad, pad]
    mask = t([[0, 1, 1, 0, 1, 0, 1, 1], [0, 1, 0, 1, 1, 0, 0, 0]])
    step_index = torch.tensor([[-1, 0, 0, -1, 1, -1, 2, 2], [-1, 0, -1, 1, 1, -1, -1, -1]])
    return AdvantageInputs(
        action_mask=mask,
        rewards=t([1.0, 0.0]),
        group_index=torch.tensor([0, 0]),
        step_index=step_index,
        step_anchor=torch.tensor([[A_, B_, A_], [A_, C_, -1]]),
        step_rewards=t([[0, 0, 1], [0, 0, 0]]),
    )


def test_gigpo_webshop_example_without_std() -> None:
    # gamma = 0.5 step returns: tau1 [0.25, 0.5, 1.0]; tau2 [0, 0].
    # Step group A = {0.25 (2nd item), 1.0 (1st item), 0 (next page)}: mean 1.25/3 = 0.4166667
    #   -> A^S = [-0.1666667, 0.5833333, -0.4166667]; groups B = {0.5}, C = {0}: single -> 0.
    # Episode (no std): R = [1, 0] -> A^E = [0.5, -0.5].  omega = 1:
    #   tau1: s0 0.5 - 0.1666667 = 0.3333333, s1 0.5, s2 0.5 + 0.5833333 = 1.0833333
    #   tau2: s0 -0.5 - 0.4166667 = -0.9166667, s1 -0.5
    out = gigpo(_webshop_inputs(), omega=1.0, gamma=0.5, norm_std=False)
    a, b, c, d = 0.3333333, 0.5, 1.0833333, -0.9166667
    expected = t([[0, a, a, 0, b, 0, c, c], [0, d, 0, -0.5, -0.5, 0, 0, 0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)
    # The seed's ordering: A^S(1st item) > A^S(2nd item) > A^S(next page).
    assert c > a and a > d


def test_gigpo_with_std_and_omega() -> None:
    # Episode: [1, 0] mean .5, unbiased std .7071068 -> A^E = +-0.7071068.
    # Step group A returns [0.25, 1.0, 0]: mean .4166667, devs [-.1666667, .5833333, -.4166667],
    #   unbiased var = (.0277778 + .3402778 + .1736111)/2 = .2708333, std = .5204165
    #   -> A^S = [-0.3202563, 1.1208971, -0.8006408].  omega = 0.5:
    #   tau1 s0 .7071068 - .1601282 = .5469786; s1 .7071068; s2 .7071068 + .5604486 = 1.2675554
    #   tau2 s0 -.7071068 - .4003204 = -1.1074272; s1 -.7071068
    out = gigpo(_webshop_inputs(), omega=0.5, gamma=0.5)
    e = 0.7071068
    expected = t(
        [[0, 0.5469786, 0.5469786, 0, e, 0, 1.2675554, 1.2675554], [0, -1.1074272, 0, -e, -e, 0, 0, 0]]
    )
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)


def test_gigpo_anchors_are_not_shared_across_rollout_groups_and_errors() -> None:
    base = _webshop_inputs()
    # Put tau2 in another rollout group: anchor A no longer pools with it, and each episode
    # group has one member -> A^E = 0. Step group (g0, A) = {0.25, 1.0}: mean .625 -> [-.375, .375].
    split = AdvantageInputs(**{**base.__dict__, "group_index": torch.tensor([0, 1])})
    out = gigpo(split, omega=1.0, gamma=0.5, norm_std=False)
    expected = t([[0, -0.375, -0.375, 0, 0, 0, 0.375, 0.375], [0, 0, 0, 0, 0, 0, 0, 0]])
    torch.testing.assert_close(out.advantages, expected)
    bad = AdvantageInputs(
        **{
            **base.__dict__,
            "step_index": torch.tensor([[-1, 0, 0, -1, 1, -1, 2, 2], [-1, 0, -1, 2, 2, -1, -1, -1]]),
        }
    )
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        gigpo(bad)
    with pytest.raises(ValueError, match="step_index"):
        gigpo(
            AdvantageInputs(action_mask=base.action_mask, rewards=base.rewards, group_index=base.group_index)
        )


# ------------------------------------------------------------------------ shared properties


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "reinforce", "remax", "reinforce_pp", "reinforce_pp_baseline"]
)
def test_zero_off_mask_and_on_invalid_rows(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=g) > 0.4).to(D)
    mask[:, 0] = 1
    r = torch.randn(6, generator=g, dtype=D)
    r[5] = math.nan
    inp = AdvantageInputs(
        action_mask=mask,
        rewards=r,
        group_index=torch.tensor([0, 0, 0, 1, 1, 1]),
        valid=torch.tensor([True] * 5 + [False]),
        baseline=torch.zeros(6, dtype=D),
    )
    adv = ADVANTAGES[name](inp).advantages
    assert bool(torch.isfinite(adv).all())
    assert bool((adv[mask == 0] == 0).all())
    assert bool((adv[5] == 0).all())


# ------------------------------------------------- reference (plain loop) vs vectorised batch


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(), b=st.integers(1, 5), t_len=st.integers(1, 7), gamma=st.floats(0, 1), lam=st.floats(0, 1)
)
def test_gae_batched_ragged_rows_equal_each_row_alone(
    data: st.DataObject, b: int, t_len: int, gamma: float, lam: float
) -> None:
    # Rows of different lengths batched together must give exactly what each row gives alone
    # (no leakage across rows through the shared time loop).
    fl = st.floats(-3, 3, allow_nan=False)
    mask = t(
        data.draw(
            st.lists(
                st.lists(st.sampled_from([0.0, 1.0]), min_size=t_len, max_size=t_len), min_size=b, max_size=b
            )
        )
    )
    rew = t(data.draw(st.lists(st.lists(fl, min_size=t_len, max_size=t_len), min_size=b, max_size=b))) * mask
    val = t(data.draw(st.lists(st.lists(fl, min_size=t_len, max_size=t_len), min_size=b, max_size=b)))
    term = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    boot = t(data.draw(st.lists(fl, min_size=b, max_size=b)))
    full = gae(
        AdvantageInputs(action_mask=mask, token_rewards=rew, values=val, terminal=term, bootstrap_value=boot),
        gamma=gamma,
        lam=lam,
    )
    for i in range(b):
        one = gae(
            AdvantageInputs(
                action_mask=mask[i : i + 1],
                token_rewards=rew[i : i + 1],
                values=val[i : i + 1],
                terminal=term[i : i + 1],
                bootstrap_value=boot[i : i + 1],
            ),
            gamma=gamma,
            lam=lam,
        )
        torch.testing.assert_close(full.advantages[i : i + 1], one.advantages)
        # Plain-loop reference for the row: backwards over its action positions.
        pos = [j for j in range(t_len) if mask[i, j] == 1]
        expected = torch.zeros(t_len, dtype=D)
        nxt_v = 0.0 if bool(term[i]) else float(boot[i])
        running = 0.0
        for j in reversed(pos):
            delta = float(rew[i, j]) + gamma * nxt_v - float(val[i, j])
            running = delta + gamma * lam * running
            expected[j] = running
            nxt_v = float(val[i, j])
        torch.testing.assert_close(full.advantages[i], expected)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), b=st.integers(2, 9))
def test_grpo_and_rloo_vectorised_equal_plain_loop(data: st.DataObject, b: int) -> None:
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=b, max_size=b))
    groups = data.draw(st.lists(st.integers(0, 2), min_size=b, max_size=b))
    inp = AdvantageInputs(
        action_mask=torch.ones(b, 1, dtype=D), rewards=t(rewards), group_index=torch.tensor(groups)
    )
    got = grpo(inp).advantages[:, 0]
    for i in range(b):
        members = [rewards[j] for j in range(b) if groups[j] == groups[i]]
        if len(members) < 2:
            exp = 0.0
        else:
            mean = sum(members) / len(members)
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
            exp = 0.0 if std < 1e-6 else (rewards[i] - mean) / (std + 1e-6)
        assert got[i].item() == pytest.approx(exp, abs=1e-9)
    counts = {g: groups.count(g) for g in groups}
    if min(counts.values()) >= 2:
        r_out = rloo(inp).advantages[:, 0]
        for i in range(b):
            others = [rewards[j] for j in range(b) if groups[j] == groups[i] and j != i]
            assert r_out[i].item() == pytest.approx(rewards[i] - sum(others) / len(others), abs=1e-12)
    else:
        with pytest.raises(ValueError, match="K >= 2"):
            rloo(inp)


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("bad", [{"eps": -1.0}, {"min_std": -1e-3}])
def test_negative_normaliser_constants_are_refused(name: str, bad: dict) -> None:
    """(x - mean) / (std + eps) with eps < 0 can divide by ~0 or flip signs: refused (and so refused
    at config load, which probes every estimator's kwargs)."""
    from posttrain.algos import ADVANTAGES

    mask = torch.ones(4, 2, dtype=torch.float64)
    inputs = AdvantageInputs(action_mask=mask, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
                             group_index=torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="eps and min_std must be >= 0"):
        ADVANTAGES[name](inputs, **bad)
