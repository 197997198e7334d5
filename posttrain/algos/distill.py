"""On-policy distillation against a frozen teacher: the per-token signal and two token losses.

:func:`reverse_kl_advantage` is the per-token advantage the training loop adds (``loss.distill``);
:func:`reverse_kl_distill` / :func:`forward_kl_distill` return a per-token loss ``[B, T]``, exactly 0
off the action mask, for a learner that reduces it with a ``REDUCTIONS`` weight function like any
policy loss. Masked positions may hold anything (``inf``/``nan``): inputs are replaced with
``torch.where`` before use, so they never reach the value or the gradient. The teacher is always
detached.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _mask(action_mask: Tensor, shape: torch.Size, name: str) -> Tensor:
    if action_mask.shape != shape:
        raise ValueError(f"{name}: action_mask has shape {tuple(action_mask.shape)}, expected {tuple(shape)}")
    if not bool(((action_mask == 0) | (action_mask == 1)).all()):
        raise ValueError(f"{name}: action_mask must hold only 0/1 values")
    return action_mask.bool()


def reverse_kl_advantage(student_logprob: Tensor, teacher_logprob: Tensor, action_mask: Tensor,
                         coef: float = 1.0) -> Tensor:
    """Per-token advantage ``-coef * (log s_t - log p^T_t)`` ``[B, T]`` float64, exactly 0 off the action mask.

    ``log s_t - log p^T_t`` is the single-sample (k1) estimate of the reverse KL KL(s || p^T) at the
    sampled token ``t`` of a student sample (``student_logprob``: pi_old, the weights that sampled it);
    its negation is the per-token reward of on-policy distillation with no future-token credit
    (discount 0), as in Agarwal et al. 2024 (GKD, arXiv:2306.13649, reverse KL, on-policy data),
    Gu et al. 2024 (MiniLLM, arXiv:2306.08543, the single-step term of its decomposed gradient) and
    Thinking Machines' "On-Policy Distillation" (2025). A policy-gradient loss on this advantage
    has the gradient of :func:`reverse_kl_distill`. Teacher == student gives exactly 0. ``coef`` > 0.
    """
    if student_logprob.dim() != 2 or teacher_logprob.shape != student_logprob.shape:
        raise ValueError(
            f"reverse_kl_advantage: student/teacher log-probs must both be [B, T], got "
            f"{tuple(student_logprob.shape)} and {tuple(teacher_logprob.shape)}"
        )
    if not coef > 0:
        raise ValueError(f"reverse_kl_advantage: coef must be > 0, got {coef}")
    m = _mask(action_mask, student_logprob.shape, "reverse_kl_advantage")
    zero = torch.zeros((), dtype=torch.float64, device=student_logprob.device)
    s = torch.where(m, student_logprob.detach().to(torch.float64), zero)
    t = torch.where(m, teacher_logprob.detach().to(torch.float64), zero)
    return torch.where(m, -coef * (s - t), zero)


def reverse_kl_distill(student_logprob: Tensor, teacher_logprob: Tensor, action_mask: Tensor) -> Tensor:
    """Sampled-token reverse-KL distillation loss ``[B, T]`` (on-policy: tokens sampled by the student).

    Per action token ``t`` of a student sample, ``adv_t = -sg(log s_t - log p^T_t)`` (the per-token
    "reward" ``log p^T - log s`` of the reverse-KL objective) and ``loss_t = -adv_t * log s_t``.
    Its gradient ``(log s_t - log p^T_t) grad log s_t`` is the score-function (REINFORCE) estimator
    of the gradient of KL(s || p^T) = E_{y ~ s}[log s(y) - log p^T(y)], with each token's own log
    ratio as its reward (no future-token credit, as in Thinking Machines' "On-Policy
    Distillation", 2025, and Agarwal et al. 2024 GKD, arXiv:2306.13649, with the reverse KL).
    The loss VALUE is not the KL: the per-token k1 KL estimate is ``adv_t`` negated, which the
    caller can log. When student == teacher every advantage and gradient is exactly 0.
    Shapes: ``student_logprob`` (requires grad), ``teacher_logprob``, ``action_mask`` all ``[B, T]``.
    """
    if student_logprob.dim() != 2 or teacher_logprob.shape != student_logprob.shape:
        raise ValueError(
            f"reverse_kl_distill: student/teacher log-probs must both be [B, T], got "
            f"{tuple(student_logprob.shape)} and {tuple(teacher_logprob.shape)}"
        )
    m = _mask(action_mask, student_logprob.shape, "reverse_kl_distill")
    zero = torch.zeros((), dtype=student_logprob.dtype, device=student_logprob.device)
    s = torch.where(m, student_logprob, zero)
    t = torch.where(m, teacher_logprob.detach().to(s.dtype), zero)
    adv = -(s.detach() - t)
    return torch.where(m, -adv * s, zero)


def forward_kl_distill(student_logits: Tensor, teacher_logits: Tensor, action_mask: Tensor) -> Tensor:
    """Full-distribution forward KL per token: ``KL(p^T_t || s_t) = sum_v p^T(v) (log p^T(v) - log s(v))``.

    ``student_logits`` and ``teacher_logits`` are ``[B, T, V]`` over the same vocabulary, both for
    the distribution of the token at position ``t``. The teacher may be given as logits or as
    log-probs: it is passed through ``log_softmax``, which leaves normalised log-probs unchanged.
    Vocabulary entries where the teacher has probability 0 contribute 0 (``0 log 0 = 0``).
    Gradient flows to the student only: ``d KL / d student_logits = softmax(student) - p^T``.
    (Hinton et al. 2015, arXiv:1503.02531; GKD's forward-KL case, Agarwal et al. 2024.)
    Returns ``[B, T]``, 0 off the action mask. Memory is O(B T V); chunk over T upstream if needed.
    """
    if student_logits.dim() != 3 or teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"forward_kl_distill: student/teacher logits must both be [B, T, V], got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    m = _mask(action_mask, student_logits.shape[:2], "forward_kl_distill")
    m3 = m.unsqueeze(-1)
    zero = torch.zeros((), dtype=student_logits.dtype, device=student_logits.device)
    log_s = torch.log_softmax(torch.where(m3, student_logits, zero), dim=-1)
    log_t = torch.log_softmax(torch.where(m3, teacher_logits.detach().to(log_s.dtype), zero), dim=-1)
    p_t = log_t.exp()
    # where, not multiply: log_t - log_s is -inf - x = -inf where the teacher has zero mass.
    per_vocab = torch.where(p_t > 0, p_t * (log_t - log_s), zero)
    return torch.where(m, per_vocab.sum(dim=-1), zero)
