"""Log-prob of the taken token and entropy of a linear LM head, never holding [tokens x vocab] at once.

A causal LM's head is ``logits = h W^T`` (``h`` ``[N, D]`` final hidden states, ``W`` ``[V, D]``).
The learner needs, per token, only ``log softmax(z / T)[target]`` and (optionally) the entropy
``H(softmax(z / T))`` — two numbers — yet the plain path forms ``[N, V]`` logits, their float32
upcast, their log-softmax and the entropy's softmax, and the backward keeps several of them alive
(for SmolLM2, V = 49,152: 197 KB per token per tensor). :func:`chunked_token_logprobs` computes the
same values token chunk by token chunk inside one ``torch.autograd.Function``: the forward keeps only
per-token scalars (the log-normalisers and the entropy), and the backward recomputes each chunk's
logits and forms ``grad_h`` and ``grad_W`` from them, so at most ``chunk x V`` logits exist at any time.
This is the construction of Cut Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary
Language Models", arXiv:2411.09009) and of Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024,
arXiv:2410.10989), here at token-chunk granularity and extended by the entropy and the kept-set
normaliser of truncated sampling.

Gradients (``z`` = temperature-scaled logits of one token, ``p = softmax(z)``, ``t`` the taken token):

- log-prob: ``d logp_t / dz = onehot(t) - q`` with ``q`` the softmax over the kept set ``K``
  (``q = p`` without truncation; ``K`` is a constant, as in the full path);
- entropy: ``dH / dz = -p * (log p + H)``;
- then ``dz / d(logits) = 1 / T``, ``grad_h = d_logits W`` and ``grad_W = d_logits^T h``. A tied
  head (``W`` is the input embedding) receives this gradient through the shared parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from posttrain.learner.kept_set import kept_set_mask

CHUNK_LOGITS = 1 << 23
"""Logit elements per chunk (32 MiB in float32): ``chunk tokens = CHUNK_LOGITS // V`` (170 for SmolLM2)."""


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The non-tensor settings of one chunked head pass.

    ``matmul_dtype``: dtype of the two GEMMs (the model's, or the autocast dtype); ``softmax_dtype``:
    float32 for half-precision GEMMs, else the GEMM dtype (float64 stays exact). ``chunk_tokens``:
    tokens per chunk. ``entropy``: compute the entropy; ``entropy_grad``: let gradients flow through it.
    """

    temperature: float
    top_k: int
    top_p: float
    entropy: bool
    entropy_grad: bool
    chunk_tokens: int
    matmul_dtype: torch.dtype
    softmax_dtype: torch.dtype

    @property
    def truncated(self) -> bool:
        """Whether the log-prob is normalised over a top-k / top-p kept set."""
        return self.top_k > 0 or self.top_p < 1.0


def _logits(h: torch.Tensor, w: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """``(h W^T)`` in the GEMM dtype, upcast to the softmax dtype and divided by the temperature (a new tensor)."""
    z = (h.to(spec.matmul_dtype) @ w.to(spec.matmul_dtype).t()).to(spec.softmax_dtype)
    return z.div_(spec.temperature) if spec.temperature != 1.0 else z


def _kept(z: torch.Tensor, targets: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """The sampler's kept set of each row of ``z``, the taken token always in it."""
    keep = kept_set_mask(z, top_k=spec.top_k, top_p=spec.top_p)
    return keep.scatter_(-1, targets.unsqueeze(-1), True)


class _ChunkedHead(torch.autograd.Function):
    """``(h [N, D], W [V, D], targets [N]) -> (logprob [N], entropy [N])`` chunk by chunk (module doc)."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, spec: HeadSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        logp = torch.empty(n, dtype=spec.softmax_dtype, device=h.device)
        lse = torch.empty_like(logp)  # log-normaliser over the whole vocabulary
        lse_kept = torch.empty_like(logp) if spec.truncated else lse  # ... over the kept set
        ent = torch.zeros_like(logp)
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            for s in range(0, n, spec.chunk_tokens):
                e = min(s + spec.chunk_tokens, n)
                z = _logits(h[s:e], w, spec)
                t = targets[s:e]
                lse[s:e] = torch.logsumexp(z, dim=-1)
                if spec.truncated:
                    lse_kept[s:e] = torch.logsumexp(z.masked_fill(~_kept(z, t, spec), float("-inf")), dim=-1)
                logp[s:e] = z.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse_kept[s:e]
                if spec.entropy:
                    # H = lse - sum_v p_v z_v (no log of an underflowed probability)
                    p = (z - lse[s:e, None]).exp_()
                    ent[s:e] = lse[s:e] - p.mul_(z).sum(dim=-1)
        ctx.spec = spec
        ctx.save_for_backward(h, w, targets, lse, lse_kept, ent)
        ctx.set_materialize_grads(False)
        if not (spec.entropy and spec.entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        spec: HeadSpec = ctx.spec
        h, w, targets, lse, lse_kept, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_logp is None and g_ent is None:
            return None, None, None, None
        if not (spec.entropy and spec.entropy_grad):
            g_ent = None
        n = h.shape[0]
        grad_h = torch.empty_like(h) if need_h else None
        # grad_W accumulates over chunks in at least float32 (one rounding per chunk, not per token)
        acc = torch.float64 if w.dtype == torch.float64 else torch.float32
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        wm = w.to(spec.matmul_dtype)
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            for s in range(0, n, spec.chunk_tokens):
                e = min(s + spec.chunk_tokens, n)
                # in place where possible: at most three [chunk, V] tensors (z, dz, the entropy term)
                logp_all = _logits(h[s:e], w, spec)
                keep = _kept(logp_all, targets[s:e], spec) if g_logp is not None and spec.truncated else None
                logp_all.sub_(lse[s:e, None])  # log p
                dz = logp_all.exp()  # p
                d_ent = None
                if g_ent is not None:  # dH/dz = -p (log p + H)
                    d_ent = logp_all.add_(ent[s:e, None]).mul_(dz).mul_(-g_ent[s:e, None])
                if g_logp is not None:  # d logp_t/dz = onehot(t) - q, q = p e^(lse - lse_kept) on K, 0 off it
                    g = g_logp[s:e, None]
                    if keep is not None:
                        dz.mul_(torch.exp(lse[s:e] - lse_kept[s:e])[:, None]).masked_fill_(~keep, 0.0)
                    dz.mul_(-g).scatter_add_(-1, targets[s:e].unsqueeze(-1), g.to(dz.dtype))
                    if d_ent is not None:
                        dz.add_(d_ent)
                else:
                    assert d_ent is not None
                    dz = d_ent
                if spec.temperature != 1.0:
                    dz.div_(spec.temperature)
                dzm = dz.to(spec.matmul_dtype)
                hm = h[s:e].to(spec.matmul_dtype)
                if grad_h is not None:
                    grad_h[s:e] = (dzm @ wm).to(h.dtype)
                if grad_w is not None:
                    if dzm.dtype == acc:
                        grad_w.addmm_(dzm.t(), hm)  # no [V, D] temporary
                    else:
                        grad_w += (dzm.t() @ hm).to(acc)
        return grad_h, (grad_w.to(w.dtype) if grad_w is not None else None), None, None


def head_weight(head: torch.nn.Module) -> torch.Tensor | None:
    """The ``[V, D]`` weight ``W`` with ``head(h) = h W^T`` for the active adapters, or ``None``.

    A bias-free ``nn.Linear``: its weight. A peft LoRA ``Linear`` (Hu et al. 2021, arXiv:2106.09685) over
    one (not merged, adapters enabled, no DoRA / LoRA bias, not ``fan_in_fan_out``): the folded weight
    ``W_0 + sum_a (alpha_a/r_a) B_a A_a`` over its active adapters that adapt it (peft's
    ``get_delta_weight``), differentiable in ``A`` and ``B``, so :func:`chunked_token_logprobs` runs a
    LoRA-adapted head too. Anything else: ``None`` (the caller runs the model's own forward).
    """
    if type(head) is torch.nn.Linear:
        return head.weight if head.bias is None else None
    if not type(head).__module__.startswith("peft."):  # not a peft layer: no need (or peft) to look further
        return None
    from peft.tuners.lora import Linear as LoraLinear

    if type(head) is not LoraLinear or head.merged or head.disable_adapters or head.fan_in_fan_out:
        return None
    base = head.base_layer
    if type(base) is not torch.nn.Linear or base.bias is not None:
        return None
    w: torch.Tensor = base.weight
    for a in head.active_adapters:
        if a not in head.lora_A.keys():
            continue
        if a in head.lora_variant or head.lora_bias.get(a, False):
            return None
        w = w + head.get_delta_weight(a)
    return w


def chunk_tokens_for(vocab: int, cap: int | None = None) -> int:
    """Tokens per chunk: ``CHUNK_LOGITS // vocab`` (at least 1), at most ``cap`` when given."""
    n = max(1, CHUNK_LOGITS // max(int(vocab), 1))
    return max(1, min(n, int(cap))) if cap is not None else n


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprob[i] = log softmax(h_i W^T / T)[targets[i]]`` and ``entropy[i] = H(softmax(h_i W^T / T))``.

    ``hidden`` ``[N, D]``, ``weight`` ``[V, D]`` (the LM head, no bias), ``targets`` ``[N]`` (long):
    returns ``logprob [N]`` and, with ``with_entropy``, ``entropy [N]`` (else ``None``), in float32
    for half-precision inputs and in the inputs' dtype otherwise; the same values as the full-logits
    computation up to the rounding of the chunked GEMMs (tested against it, gradients included).
    ``top_k > 0`` / ``top_p < 1``: the log-prob is normalised over the sampler's kept set
    (:func:`posttrain.learner.kept_set.kept_set_mask` of the scaled logits, the taken token always
    kept; the set is a constant for the gradient); the entropy stays the untruncated one.
    ``entropy_grad=False``: the entropy carries no gradient (a metric). Under autocast the GEMMs
    run in the autocast dtype, as ``nn.Linear`` would. ``chunk_tokens``: tokens per chunk (default
    :func:`chunk_tokens_for` of ``V``). Memory: ``O(chunk_tokens * V)`` working logits, plus ``O(N)``
    saved scalars; the backward recomputes each chunk's logits (one extra ``N x D x V`` GEMM).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked head: need hidden [N, D] and weight [V, D], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked head: targets {tuple(targets.shape)} must be [N] = [{hidden.shape[0]}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunked head: chunk_tokens must be >= 1, got {chunk_tokens}")
    dev = hidden.device.type
    mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(hidden.dtype,
                                                                                                  weight.dtype)
    spec = HeadSpec(
        temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), entropy=with_entropy,
        entropy_grad=with_entropy and entropy_grad,
        chunk_tokens=chunk_tokens if chunk_tokens is not None else chunk_tokens_for(weight.shape[0]),
        matmul_dtype=mm, softmax_dtype=torch.float32 if mm in (torch.float16, torch.bfloat16) else mm,
    )
    logp, ent = _ChunkedHead.apply(hidden, weight, targets, spec)  # type: ignore[no-untyped-call]
    return logp, (ent if with_entropy else None)
