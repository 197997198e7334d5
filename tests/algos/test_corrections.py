"""Tests for posttrain/algos/corrections.py (hand cases, padding never vetoes, masked invariance)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos import CORRECTIONS
from posttrain.algos.corrections import CorrectionOutputs

D = torch.float64
NAN, INF = math.nan, math.inf


def _kappa_batch(kappas: list[list[float | None]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of token ratios kappa = pi_old / mu; None marks a masked (padding) position.

    behavior = 0 and old = log kappa, so old - behavior is log kappa bit for bit and the band
    edges (compared in log space) are exact; corrections only look at the difference.
    Masked positions get garbage (nan old, -inf behavior) that must never matter.
    """
    old, beh, mask = [], [], []
    for row in kappas:
        old.append([NAN if k is None else math.log(k) for k in row])
        beh.append([-INF if k is None else 0.0 for k in row])
        mask.append([0.0 if k is None else 1.0 for k in row])
    return torch.tensor(beh, dtype=D), torch.tensor(old, dtype=D), torch.tensor(mask, dtype=D)


def _call(name: str, kappas: list[list[float | None]], **hp: Any) -> CorrectionOutputs:
    beh, old, mask = _kappa_batch(kappas)
    out: CorrectionOutputs = CORRECTIONS[name](beh, old, mask, **hp)
    return out


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def test_every_registered_correction_is_covered() -> None:
    assert set(CORRECTIONS) == {"tis", "icepop", "mis", "token_veto", "staleness"}


def test_tis_hand() -> None:
    # kappa [3, 0.5, pad], C = 2: weights [min(3, 2), 0.5, 1 (pad)] ; keep = action mask
    out = _call("tis", [[3.0, 0.5, None]], cap=2.0)
    assert torch.allclose(out.weights, _t([[2.0, 0.5, 1.0]]), atol=1e-12)
    assert torch.equal(out.keep, _t([[1.0, 1.0, 0.0]]))
    assert torch.equal(out.diagnostics["truncated"], _t([[1.0, 0.0, 0.0]]))
    assert torch.allclose(out.diagnostics["log_ratio"], _t([[math.log(3.0), math.log(0.5), 0.0]]), atol=1e-12)
    # a ratio of e^800 would overflow exp; the log-space min gives exactly the cap
    beh = torch.tensor([[-801.0]], dtype=D)
    out = CORRECTIONS["tis"](beh, torch.tensor([[-1.0]], dtype=D), torch.ones(1, 1, dtype=D), cap=2.0)
    assert torch.allclose(out.weights, _t([[2.0]]), atol=1e-12)


def test_icepop_hand() -> None:
    # band [0.5, 5], inclusive: kappa 0.4 (low, out), 1 (in), 6 (high, out), 5 (edge, in), 0.5 (edge, in)
    out = _call("icepop", [[0.4, 1.0, 6.0, 5.0, 0.5, None]], alpha=0.5, beta=5.0)
    assert torch.equal(out.keep, _t([[0, 1, 0, 1, 1, 0]]))
    assert torch.equal(out.weights, torch.ones(1, 6, dtype=D))
    assert torch.equal(out.diagnostics["masked_low"], _t([[1, 0, 0, 0, 0, 0]]))
    assert torch.equal(out.diagnostics["masked_high"], _t([[0, 0, 1, 0, 0, 0]]))


def test_mis_hand() -> None:
    e = math.exp
    # row 0: log kappa 0.3 + 0.2 = 0.5 -> rho = e^0.5 = 1.6487 <= 2: kept, weight rho on its tokens
    # row 1: 0.5 + 0.4 = 0.9 -> rho = e^0.9 = 2.4596 > 2: dropped whole
    # padding (None) never enters the product
    rows: list[list[float | None]] = [[e(0.3), e(0.2), None], [e(0.5), e(0.4), None]]
    out = _call("mis", rows, threshold=2.0)
    assert torch.equal(out.keep, _t([[1, 1, 0], [0, 0, 0]]))
    assert torch.allclose(out.weights, _t([[e(0.5), e(0.5), 1.0], [1.0, 1.0, 1.0]]), atol=1e-12)
    assert torch.equal(out.diagnostics["dropped"], _t([[0, 0, 0], [1, 1, 0]]))
    assert torch.allclose(
        out.diagnostics["seq_log_ratio"], _t([[0.5, 0.5, 0.0], [0.9, 0.9, 0.0]]), atol=1e-12
    )
    # geometric mean: row 1 -> e^0.45 = 1.568 <= 2: kept
    out = _call("mis", rows, threshold=2.0, aggregation="mean")
    assert torch.equal(out.keep, _t([[1, 1, 0], [1, 1, 0]]))
    assert torch.allclose(out.weights[1, :2], torch.full((2,), e(0.45), dtype=D), atol=1e-12)
    # a lower bound drops too-small sequence ratios: row 0 rho = e^0.5 < 1.7
    out = _call("mis", rows, threshold=3.0, lower=1.7)
    assert torch.equal(out.keep, _t([[0, 0, 0], [1, 1, 0]]))
    # a long sequence whose product overflows is dropped, not turned into inf/nan
    out = _call("mis", [[e(5.0)] * 200])
    assert torch.equal(out.keep, torch.zeros(1, 200, dtype=D)) and bool(torch.isfinite(out.weights).all())


def test_token_veto_hand_and_padding_never_vetoes() -> None:
    # row 0 has a token with kappa 1e-5 < 1e-4: whole row vetoed
    # row 1 only has tiny ratios at padding positions (garbage there) -> kept
    beh, old, mask = _kappa_batch([[1.0, 1e-5, 0.9], [1.0, 0.8, None]])
    # make row 1's padding position look like a catastrophic ratio: old - beh = -1e9
    old[1, 2] = -1e9
    beh[1, 2] = 0.0
    out = CORRECTIONS["token_veto"](beh, old, mask, threshold=1e-4)
    assert torch.equal(out.keep, _t([[0, 0, 0], [1, 1, 0]]))
    assert torch.equal(out.diagnostics["vetoed"], _t([[1, 1, 1], [0, 0, 0]]))
    assert torch.equal(out.diagnostics["veto_token"], _t([[0, 1, 0], [0, 0, 0]]))
    assert torch.equal(out.weights, torch.ones(2, 3, dtype=D))
    # kappa exactly at the threshold is kept (veto is strictly below)
    out = _call("token_veto", [[1e-4, 1.0]], threshold=1e-4)
    assert torch.equal(out.keep, _t([[1, 1]]))


def _staleness(
    versions: list[list[int]], mask_rows: list[list[int]], current: int, max_lag: int
) -> CorrectionOutputs:
    mask = torch.tensor(mask_rows, dtype=D)
    zeros = torch.zeros_like(mask)
    out: CorrectionOutputs = CORRECTIONS["staleness"](
        zeros,
        zeros,
        mask,
        behavior_version=torch.tensor(versions),
        current_version=current,
        max_staleness=max_lag,
    )
    return out


def test_staleness_drop() -> None:
    versions = [[5, 5, 5], [3, 4, 4], [4, 4, -1], [0, 0, 0], [2, 5, 99]]
    mask = [[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0], [0, 1, 0]]
    # current 5, max 1: lags 0, 5-3=2 (dropped: judged by the oldest token), 1 (the -1 at the padding
    # position is ignored; counting it would give lag 6), no action tokens -> 0, only version 5 -> 0
    # (the 99 and 2 sit at masked positions and are ignored)
    out = _staleness(versions, mask, current=5, max_lag=1)
    assert torch.equal(out.keep, _t([[1, 1, 1], [0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 1, 0]]))
    assert torch.equal(out.diagnostics["lag"], _t([[0, 0, 0], [2, 2, 2], [1, 1, 0], [0, 0, 0], [0, 0, 0]]))
    assert torch.equal(out.weights, torch.ones(5, 3, dtype=D))
    # max_staleness 0 keeps only fully on-policy rows
    out = _staleness(versions, mask, current=5, max_lag=0)
    assert torch.equal(out.keep.sum(dim=1), _t([[3, 0, 0, 0, 1]])[0])
    # a generous bound keeps everything
    out = _staleness(versions, mask, current=5, max_lag=2)
    assert torch.equal(out.keep, torch.tensor(mask, dtype=D))


def test_staleness_errors() -> None:
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        _staleness([[6, 5]], [[1, 1]], current=5, max_lag=1)  # a version from the future
    with pytest.raises(ValueError, match="max_staleness"):
        _staleness([[5, 5]], [[1, 1]], current=5, max_lag=-1)
    with pytest.raises(ValueError, match="behavior_version"):
        _staleness([[5]], [[1, 1]], current=5, max_lag=1)


def test_bad_inputs_raise() -> None:
    beh, old, mask = _kappa_batch([[1.0, 2.0]])
    with pytest.raises(ValueError, match="behavior_logprob"):
        CORRECTIONS["tis"](beh[:, :1], old, mask)
    with pytest.raises(ValueError, match="0/1"):
        CORRECTIONS["icepop"](beh, old, mask * 0.5)
    with pytest.raises(ValueError, match="alpha"):
        CORRECTIONS["icepop"](beh, old, mask, alpha=2.0, beta=1.0)
    with pytest.raises(ValueError, match="aggregation"):
        CORRECTIONS["mis"](beh, old, mask, aggregation="max")
    with pytest.raises(ValueError, match="cap"):
        CORRECTIONS["tis"](beh, old, mask, cap=0.0)


# ---------------------------------------------------------------- masked positions are inert

_WILD = st.one_of(
    st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -1e30, 0.0]),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_masked_positions_never_change_corrections(data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 3))
    t = data.draw(st.integers(1, 5))
    n = b * t

    def vec(elem: st.SearchStrategy[Any]) -> list[Any]:
        return data.draw(st.lists(elem, min_size=n, max_size=n))

    mask = torch.tensor(vec(st.booleans()), dtype=D).view(b, t)
    m = mask.bool()
    # ratios spread over the thresholds of every correction (log kappa in [-12, 3])
    beh = torch.tensor(vec(st.floats(-6.0, -0.01)), dtype=D).view(b, t)
    old = beh + torch.tensor(vec(st.floats(-12.0, 3.0)), dtype=D).view(b, t)
    version = torch.tensor(vec(st.integers(0, 6)), dtype=torch.int64).view(b, t)
    wild_beh = torch.where(m, beh, torch.tensor(vec(_WILD), dtype=D).view(b, t))
    wild_old = torch.where(m, old, torch.tensor(vec(_WILD), dtype=D).view(b, t))
    wild_version = torch.where(m, version, torch.tensor(vec(st.integers(-(10**9), 10**9))).view(b, t))
    calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("tis", {}, {}),
        ("icepop", {}, {}),
        ("mis", {}, {}),
        ("mis", {"aggregation": "mean", "lower": 0.5}, {}),
        ("token_veto", {"threshold": 1e-3}, {}),
        (
            "staleness",
            {"behavior_version": version, "current_version": 6, "max_staleness": 2},
            {"behavior_version": wild_version, "current_version": 6, "max_staleness": 2},
        ),
    ]
    for name, hp, wild_hp in calls:
        o1 = CORRECTIONS[name](beh, old, mask, **hp)
        o2 = CORRECTIONS[name](wild_beh, wild_old, mask, **(wild_hp or hp))
        assert torch.equal(o1.weights, o2.weights), name
        assert torch.equal(o1.keep, o2.keep), name
        assert o1.diagnostics.keys() == o2.diagnostics.keys()
        for k in o1.diagnostics:
            assert torch.equal(o1.diagnostics[k], o2.diagnostics[k]), (name, k)
        # contract: keep inside the action mask, weight 1 where not kept, finite, detached
        assert bool((o1.keep <= mask).all()), name
        assert torch.equal(o1.weights[o1.keep == 0], torch.ones(int((o1.keep == 0).sum()), dtype=D)), name
        assert bool(torch.isfinite(o2.weights).all()), name
        assert not o1.weights.requires_grad
