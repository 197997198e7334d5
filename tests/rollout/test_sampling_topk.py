"""Top-k alone takes a partial selection (``torch.topk``) instead of a full sort: same distribution."""

from __future__ import annotations

import torch

from posttrain.rollout.sampling import behaviour_logprobs

# Kept sets are compared exactly: the code and the reference compute the boundary mass differently
# (topk + logsumexp vs sort + softmax, float64), so a token within ~1e-15 of a boundary could flip; the
# seeded inputs have none. Log-probs: float64 sums over <= 3000 terms, so 1e-12 is ~1e3 ulps of slack
# and still fails any wrong renormalisation (errors of order 1e-2 and up).


def _reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """log mu by the definition: keep tokens whose scaled logit is >= the row's k-th largest (ties kept)."""
    z = logits.double() / temperature.double()[:, None]
    out = []
    for i in range(z.shape[0]):
        k = int(top_k[i])
        row = z[i]
        if 0 < k < row.numel():
            kth = torch.sort(row, descending=True).values[k - 1]
            row = row.masked_fill(row < kth, float("-inf"))
        out.append(torch.log_softmax(row, dim=-1))
    return torch.stack(out)


def test_top_k_alone_equals_the_definition_per_row_with_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, :10] = 3.0  # a tie straddling the k-th place: every tied token stays
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 1.0], dtype=torch.float64)
    top_k = torch.tensor([5, 1, 4, 0, 50, 17])  # 0 and k >= V: no truncation on that row
    ones = torch.ones(6, dtype=torch.float64)
    got = behaviour_logprobs(logits, temperature, top_k, ones, torch.zeros(6, dtype=torch.float64))
    want = _reference(logits, temperature, top_k)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=0, atol=1e-12)
    assert int(torch.isfinite(got[2]).sum()) == 10 and int(torch.isfinite(got[0]).sum()) == 5
    assert bool(torch.isfinite(got[3]).all()) and bool(torch.isfinite(got[4]).all())


def _reference_full(logits, temperature, top_k, top_p):
    """top-k then top-p by full sorts, row by row (the definition of docs/rollout.md)."""
    z = logits.double() / temperature.double()[:, None]
    out = []
    for i in range(z.shape[0]):
        row = z[i].clone()
        k = int(top_k[i])
        if 0 < k < row.numel():
            row = row.masked_fill(row < torch.sort(row, descending=True).values[k - 1], float("-inf"))
        if float(top_p[i]) < 1:
            vals, order = torch.sort(row, descending=True)
            p = torch.softmax(vals, dim=-1)
            before = torch.cumsum(p, dim=-1) - p
            drop = before >= float(top_p[i])
            drop[0] = False
            keep = torch.zeros_like(drop).scatter(0, order, ~drop)
            row = row.masked_fill(~keep, float("-inf"))
        out.append(torch.log_softmax(row, dim=-1))
    return torch.stack(out)


def test_top_p_on_candidates_equals_the_full_sort_including_the_fallback():
    """V = 3000 > the 1024 candidates: peaked rows are decided on the candidates, a flat row (its
    nucleus holds ~2700 tokens) falls back to the full sort; every kept set equals the definition."""
    g = torch.Generator().manual_seed(1)
    V = 3000
    logits = 4.0 * torch.randn(6, V, generator=g)
    logits[3] = 0.01 * torch.randn(V, generator=g)  # nearly flat: nucleus beyond the candidates
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    top_k = torch.tensor([0, 0, 40, 0, 0, 0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 1.0, 0.99], dtype=torch.float64)
    got = behaviour_logprobs(logits, temperature, top_k, top_p, torch.zeros(6, dtype=torch.float64))
    want = _reference_full(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=0, atol=1e-12)
    kept = torch.isfinite(got).sum(dim=1)
    assert int(kept[3]) > 1024 and int(kept[4]) == V and int(kept[2]) <= 40  # fallback / off / top-k first


def test_peaked_rows_are_decided_without_a_full_sort(monkeypatch):
    g = torch.Generator().manual_seed(2)
    logits = 4.0 * torch.randn(4, 3000, generator=g)
    args = (torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.long),
            torch.tensor([0.9, 0.5, 0.99, 1.0], dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    want = _reference_full(logits, args[0], args[1], args[2])

    def no_sort(*a, **k):
        raise AssertionError("full sort on a peaked row")

    monkeypatch.setattr(torch, "sort", no_sort)
    got = behaviour_logprobs(logits, *args)
    monkeypatch.undo()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=0, atol=1e-12)
