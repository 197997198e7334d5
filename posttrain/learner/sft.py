"""Supervised warm-up (SFT) on prompt -> reference-answer pairs before RL.

Loss: mean negative log-likelihood of the answer tokens (and the closing eos) given the prompt,
token-mean over the batch: ``L = -sum_{i,t} m_it log pi(y_it | x_i, y_i,<t) / sum m_it``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from posttrain.trajectory import collate, make_trajectory


def sft_batch_loss(model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> torch.Tensor:
    """Token-mean NLL of the answer ids of ``pairs`` = [(prompt_ids, answer_ids_with_eos)]."""
    trajs = [
        make_trajectory(
            traj_id=str(i), prompt_id=str(i), group_id=str(i), prompt_ids=p, action_ids=a,
            action_logprobs=[0.0] * len(a), action_versions=0, finish="terminal",
        )
        for i, (p, a) in enumerate(pairs)
    ]
    b = collate(trajs, pad_token_id=pad_token_id)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    mask = b.action_mask[:, 1:].to(lp.dtype)
    return -(lp * mask).sum() / mask.sum().clamp(min=1)


def run_sft(
    model: torch.nn.Module,
    batches: Callable[[int], Sequence[tuple[list[int], list[int]]]],
    *,
    steps: int,
    lr: float,
    pad_token_id: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """``steps`` AdamW steps on ``batches(step)``; returns the loss curve (one float per step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1) * 0.9)
    model.train()
    losses: list[float] = []
    for s in range(steps):
        loss = sft_batch_loss(model, batches(s), pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(s, losses[-1])
    model.eval()
    return losses
