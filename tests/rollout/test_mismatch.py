"""measure_mismatch: |log kappa| = |log pi_old - log mu| of the built-in engine against a plain forward."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models import build_tiny_model
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.mismatch import measure_mismatch
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model("micro", seed=2, max_position_embeddings=128)  # float32


def _requests(params: SamplingParams) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    return [
        GenerationRequest(f"m{i}", torch.randint(3, 106, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist(), params)
        for i in range(6)
    ]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=1),
     SamplingParams(temperature=0.6, top_k=10, top_p=0.9, max_new_tokens=30, n=2, seed=2),
     SamplingParams(temperature=0.0, max_new_tokens=30)],
    ids=["T1", "T0.6-k10-p0.9", "greedy"],
)
def test_builtin_engine_float32_max_abs_log_kappa_below_1e4(model: torch.nn.Module, params: SamplingParams) -> None:
    eng = BuiltinEngine(copy.deepcopy(model))
    comps = eng.generate(_requests(params))
    rep = measure_mismatch(eng, model, comps)
    assert rep.n_tokens == sum(len(c.token_ids) for c in comps) > 50
    assert rep.max < 1e-4, rep
    assert 0.0 <= rep.mean <= rep.p99 <= rep.max
    assert len(rep.seq_log_ratio) == len(comps)
    assert all(abs(x) < 1e-3 for x in rep.seq_log_ratio)
    assert rep.stale_tokens == 0


def test_mismatch_detects_other_weights_and_stale_tokens(model: torch.nn.Module) -> None:
    eng = BuiltinEngine(copy.deepcopy(model))
    comps = eng.generate(_requests(SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)))
    other = build_tiny_model("micro", seed=9, max_position_embeddings=128)
    eng.update_weights(dict(other.state_dict()))
    rep = measure_mismatch(eng, other, comps)
    assert rep.max > 0.05
    assert rep.stale_tokens == rep.n_tokens  # every token came from version 0, engine is at 1


def test_hand_computed_log_ratio() -> None:
    # A 2-token vocabulary model whose logits are fixed: log pi = log_softmax([0, log 3]) = [log .25, log .75].
    class Fixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
            B, T = input_ids.shape
            logits = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))]).expand(B, T, 2)
            return type("Out", (), {"logits": logits})()

    c = Completion("h", 0, [0], [1, 0], [-0.5, -1.0], [0, 0], "length", params=SamplingParams(temperature=1.0))
    rep = measure_mismatch(type("E", (), {"version": 0})(), Fixed(), [c])
    lk = [abs(float(torch.log(torch.tensor(0.75))) + 0.5), abs(float(torch.log(torch.tensor(0.25))) + 1.0)]
    assert rep.max == pytest.approx(max(lk), abs=1e-7)
    assert rep.mean == pytest.approx(sum(lk) / 2, abs=1e-7)
    assert rep.seq_log_ratio[0] == pytest.approx(float(torch.log(torch.tensor(0.75 * 0.25))) + 1.5, abs=1e-7)
