"""Sampling parameters and the sampler's exact behaviour distribution ``mu``.

The distribution a token is drawn from, for next-token logits ``z`` (one row, vocabulary ``V``):

1. temperature: ``z' = z / T`` (``T = 0`` is greedy, see below);
2. top-k (``k > 0``): keep tokens with ``z'_v >= z'_(k)`` (the k-th largest; ties at the k-th value
   are kept), others get ``-inf``;
3. top-p / nucleus (Holtzman et al. 2019, arXiv:1904.09751): over ``p = softmax(z')`` of the kept
   set, sorted in descending order, keep token ``i`` while the mass strictly before it is
   ``< top_p`` (the smallest prefix whose mass reaches ``top_p``; the top token is always kept);
4. min-p (Nguyen et al. 2024, arXiv:2407.01082): keep tokens with ``p_v >= min_p * max_v p_v``;
5. ``log mu = log_softmax(z')`` over the kept set (renormalised), computed in float64.

This is the order ``transformers`` applies its warpers in (temperature, top-k, top-p, min-p).
The recorded ``behavior_logprob`` of a sampled token is ``log mu[token]`` of exactly this float64
distribution, and the token is drawn from the same float64 distribution (inverse-CDF with a
counter-based uniform, :func:`uniforms`), so the record is the true behaviour probability.

Greedy (``T = 0``): the token is ``argmax z`` (first index on ties, as ``torch.argmax`` and
``transformers`` do). The behaviour distribution is then a point mass, so the recorded
log-prob is ``0.0`` (``mu(argmax) = 1``). A learner's importance ratio ``pi/mu`` under greedy
rollouts is therefore ``pi(token)`` itself; use ``T > 0`` for on-policy RL.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np
import torch

JSONScalar = str | int | float | bool | None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (see the module docstring for the exact distribution).

    ``eos`` of the engine always stops a sample (finish ``"eos"``); a token of ``stop_token_ids``
    stops with ``"stop"``, as does a generated text containing one of ``stop_strings`` (needs a
    tokenizer on the engine). The stopping token is kept in the completion: it was sampled and
    carries a log-prob. ``n`` samples are drawn per prompt; ``seed`` fixes their random streams
    (``None``: the engine draws one and records it on each completion).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    return_full_logprobs: bool = False

    def __post_init__(self) -> None:
        # Lists from YAML/JSON become tuples so the record stays hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(s) for s in self.stop_strings))

    @property
    def greedy(self) -> bool:
        """``temperature == 0``: argmax decoding with a point-mass behaviour distribution."""
        return self.temperature == 0

    def validate(self, request_id: str, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming ``request_id`` for any parameter out of its domain.

        Domains: ``temperature >= 0`` (finite), ``0 < top_p <= 1``, ``top_k >= 0``,
        ``0 <= min_p < 1``, ``max_new_tokens > 0``, ``n >= 1``, stop ids in ``[0, vocab_size)``
        when the vocabulary size is known, stop strings non-empty.
        """

        def bad(msg: str) -> ValueError:
            return ValueError(f"request {request_id!r}: {msg}")

        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 <= self.min_p < 1):
            raise bad(f"min_p must be in [0, 1), got {self.min_p}")
        if self.max_new_tokens <= 0:
            raise bad(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.n < 1:
            raise bad(f"n must be >= 1, got {self.n}")
        if vocab_size is not None:
            unknown = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if unknown:
                raise bad(f"unknown stop token ids {unknown} (vocabulary size {vocab_size})")
        if any(s == "" for s in self.stop_strings):
            raise bad("stop_strings must not contain the empty string")

    def to_record(self) -> dict[str, JSONScalar]:
        """JSON scalars for ``Trajectory.sampling``; tuples are JSON-encoded lists (see :meth:`from_record`)."""
        rec: dict[str, JSONScalar] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            rec[f.name] = json.dumps(list(v)) if isinstance(v, tuple) else v
        return rec

    @classmethod
    def from_record(cls, rec: Mapping[str, JSONScalar]) -> SamplingParams:
        """Inverse of :meth:`to_record` (``from_record(p.to_record()) == p``)."""
        kw: dict[str, object] = dict(rec)
        for name in ("stop_token_ids", "stop_strings"):
            if isinstance(kw.get(name), str):
                kw[name] = tuple(json.loads(str(kw[name])))
        return cls(**kw)  # type: ignore[arg-type]  # the values are the fields' own JSON scalars (to_record)


def behaviour_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """``log mu [B, V]`` float64 of the module docstring; ``-inf`` outside the kept set.

    ``logits [B, V]`` (any float dtype; upcast to float64), and per-row parameters ``[B]``
    (``temperature`` float, ``top_k`` int with 0 = off, ``top_p`` float, ``min_p`` float).
    Greedy rows (``temperature == 0``) get ``0`` at ``argmax logits`` and ``-inf`` elsewhere.
    """
    B, V = logits.shape
    z = logits.to(torch.float64)
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float64)
    z = z / t[:, None]
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=z.device)
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1
    if bool(use_k.any()):
        # top-k needs only each row's k-th largest value: a partial selection, not a full sort
        kmax = int(top_k[use_k].max())
        kth = torch.topk(z, kmax, dim=-1).values.gather(1, (top_k.clamp(1, kmax) - 1).to(torch.long)[:, None])
        z = z.masked_fill(use_k[:, None] & (z < kth), neg_inf)
    if bool(use_p.any()):
        z = _top_p(z, use_p, top_p.to(torch.float64), neg_inf)
    use_m = min_p > 0
    if bool(use_m.any()):
        p = torch.softmax(z, dim=-1)
        thresh = min_p.to(torch.float64)[:, None] * p.max(dim=-1, keepdim=True).values
        z = z.masked_fill(use_m[:, None] & (p < thresh), neg_inf)
    logp = torch.log_softmax(z, dim=-1)
    if bool(greedy.any()):
        am = logits.argmax(dim=-1)
        point = torch.full_like(logp, float("-inf"))
        point.scatter_(1, am[:, None], 0.0)
        logp = torch.where(greedy[:, None], point, logp)
    return logp


#: Candidates the top-p filter looks at first; rows whose nucleus is not inside them fall back to a full sort.
TOP_P_CANDIDATES = 1024


def _nucleus_keep(vals: torch.Tensor, order: torch.Tensor, p_sorted: torch.Tensor, top_p: torch.Tensor, V: int
                  ) -> torch.Tensor:
    """Boolean ``[b, V]``: tokens kept by the nucleus rule, given each row's largest logits ``vals``
    (descending, at ``order``) with probabilities ``p_sorted``; tokens not listed are dropped."""
    before = torch.cumsum(p_sorted, dim=-1) - p_sorted  # mass strictly before each listed token
    keep_sorted = before < top_p[:, None]
    keep_sorted[:, 0] = True  # the top token always stays
    return torch.zeros(vals.shape[0], V, dtype=torch.bool, device=vals.device).scatter(1, order, keep_sorted)


def _top_p(z: torch.Tensor, use_p: torch.Tensor, top_p: torch.Tensor, neg_inf: torch.Tensor) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2020, arXiv:1904.09751) on scaled logits ``z [B, V]``: in each
    row with ``use_p``, drop every token whose *preceding* probability mass in descending order is
    ``>= top_p`` (the top token always stays).

    Only the ``TOP_P_CANDIDATES`` largest logits of a row are sorted (``torch.topk``): a token beyond
    them has at least their whole mass before it, so when that mass reaches ``top_p`` every such
    token is dropped, exactly as a full sort would decide. A row where it does not (a flat
    distribution) is decided by a full sort of that row.
    """
    B, V = z.shape
    rows = torch.nonzero(use_p).squeeze(1)
    zp, tp = z.index_select(0, rows), top_p.index_select(0, rows)
    m = min(V, TOP_P_CANDIDATES)
    vals, order = torch.topk(zp, m, dim=-1)
    p_sorted = torch.exp(vals - torch.logsumexp(zp, dim=-1, keepdim=True))
    keep = _nucleus_keep(vals, order, p_sorted, tp, V)
    flat = torch.nonzero(p_sorted.sum(dim=-1) < tp).squeeze(1) if m < V else rows.new_empty(0)
    if flat.numel():
        zf = zp.index_select(0, flat)
        fv, fo = torch.sort(zf, dim=-1, descending=True)
        keep[flat] = _nucleus_keep(fv, fo, torch.softmax(fv, dim=-1), tp.index_select(0, flat), V)
    full = torch.ones_like(z, dtype=torch.bool)
    full[rows] = keep
    return z.masked_fill(~full, neg_inf)


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele, Lea & Flood 2014) on uint64 arrays (wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def uniforms(seeds: Sequence[int], sample_index: Sequence[int], step: Sequence[int]) -> torch.Tensor:
    """One uniform in ``[0, 1)`` per row, a pure function of ``(seed, sample_index, step)``.

    Counter-based (hash of the key, SplitMix64 rounds), so a sample's random stream does not
    depend on which other requests share its batch, and a resumed sample continues the very
    stream it would have used uninterrupted (``step`` = index of the generated token).
    Returns float64 ``[B]`` with 53 random bits.
    """
    s = np.asarray(seeds, dtype=np.uint64)
    i = np.asarray(sample_index, dtype=np.uint64)
    t = np.asarray(step, dtype=np.uint64)
    h = _splitmix64(_splitmix64(_splitmix64(s) ^ i) ^ t)
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
    return torch.from_numpy(u)


def sample_tokens(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from ``exp(logp) [B, V]`` with uniforms ``u [B]``; returns ``[B]`` int64.

    ``cdf`` is the float64 cumulative sum divided by its last entry (so ``cdf[-1] == 1``
    exactly); the token is the first index with ``cdf > u``. A token of probability 0 is never
    chosen (its ``cdf`` equals its predecessor's), so greedy rows return their argmax.
    """
    p = torch.exp(logp)
    cdf = torch.cumsum(p, dim=-1)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None].contiguous(), right=True).squeeze(1)
    return idx.clamp_(max=logp.shape[1] - 1)
