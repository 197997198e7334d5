"""``reward_accuracy`` of the paired preference losses: a margin within rounding of 0 is a tie, not a win.

Hand-computed: a reference that differs from the policy by ~1e-7 relative (another batch shape's rounding)
gives margins of ~1e-6, far inside ``margin_rtol * (|pi_c| + |ref_c| + |pi_r| + |ref_r|)`` = 1e-6 x ~44; a real
margin of 2 is far outside it.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algos import PREFERENCE_LOSSES
from posttrain.algos.preference import margin_tie

D = torch.float64
E = 1e-7  # relative noise of the reference: the policy equals it up to rounding
RTOL = 1e-6


def _v(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=D)


# noise: rc = pc (1 + E), rr = pr (1 - E): h = -E pc - E pr = E (10 + 12) = 2.2e-6 > 0, a "win" without the tie band
PC, PR = -10.0, -12.0
NOISE_RC, NOISE_RR = PC * (1 + E), PR * (1 - E)
# real: rc = rr = -11: h = 1 - (-1) = 2
REAL_RC, REAL_RR = -11.0, -11.0


def test_margin_tie_is_rtol_times_the_summed_magnitudes() -> None:
    tie = margin_tie(RTOL, _v(PC), _v(NOISE_RC), _v(PR), _v(NOISE_RR))
    assert float(tie) == pytest.approx(RTOL * (10 + 10.000001 + 12 + 11.9999988), rel=1e-12)  # 4.4e-5
    assert float(margin_tie(torch.tensor([0.5], dtype=D), _v(-2.0), _v(3.0))) == 2.5


@pytest.mark.parametrize("loss, kwargs", [("dpo", {"beta": 0.1}), ("ipo", {"tau": 0.1}),
                                          ("odpo", {"beta": 0.1, "score_diff": _v(0.0)})])
def test_a_noise_margin_is_a_tie_and_a_real_one_a_win(loss: str, kwargs: dict[str, object]) -> None:
    fn = PREFERENCE_LOSSES[loss]
    # two pairs: [noise, real]
    pc, pr = _v(PC, PC), _v(PR, PR)
    rc, rr = _v(NOISE_RC, REAL_RC), _v(NOISE_RR, REAL_RR)
    if loss == "odpo":
        kwargs = {**kwargs, "score_diff": _v(0.0, 0.0)}
    _, exact = fn(pc, pr, rc, rr, **kwargs)
    assert exact["reward_accuracy"].tolist() == [1.0, 1.0]  # margin_rtol = 0: the noise counts as a win
    _, diag = fn(pc, pr, rc, rr, margin_rtol=RTOL, **kwargs)
    assert diag["reward_accuracy"].tolist() == [0.0, 1.0]
    assert float(diag["reward_margin"][0]) > 0  # the margin itself is reported as computed


def test_a_per_pair_rtol_and_a_losing_pair() -> None:
    pc, pr = _v(PC, PC, -13.0), _v(PR, PR, -12.0)
    rc, rr = _v(NOISE_RC, NOISE_RC, -11.0), _v(NOISE_RR, NOISE_RR, -11.0)  # third: h = -2 - (-1) = -1
    # the first pair's rtol 1e-8: tie band 4.4e-7 < h = 2.2e-6, a win; the second's 1e-6: a tie
    _, diag = PREFERENCE_LOSSES["dpo"](pc, pr, rc, rr, margin_rtol=_v(1e-8, 1e-6, 1e-6))
    assert diag["reward_accuracy"].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_tie_on_equal_average_logprobs(loss: str) -> None:
    # pair 1: avg_c = -10/5 = -2, avg_r = -8 (1 + 1e-8) / 4 = -2.00000002: margin 2e-8, tie band 1e-6 x 4 = 4e-6
    # pair 2: avg_c = -2, avg_r = -12 / 4 = -3: margin 1, a win
    pc, pr = _v(-10.0, -10.0), _v(-8.0 * (1 + 1e-8), -12.0)
    lens = {"chosen_lengths": _v(5.0, 5.0), "rejected_lengths": _v(4.0, 4.0)}
    _, exact = PREFERENCE_LOSSES[loss](pc, pr, None, None, **lens)
    assert exact["reward_accuracy"].tolist() == [1.0, 1.0]
    _, diag = PREFERENCE_LOSSES[loss](pc, pr, None, None, margin_rtol=RTOL, **lens)
    assert diag["reward_accuracy"].tolist() == [0.0, 1.0]


def test_margin_rtol_is_supplied_not_a_user_hyperparameter() -> None:
    with pytest.raises(ValueError, match="margin_rtol"):
        PREFERENCE_LOSSES.validate_kwargs("dpo", {"margin_rtol": 0.1}, key="preference.kwargs")
