"""SFT warm-up (posttrain/learner/sft.py) over the learner's forward_backward primitive: the same curve and
weights as the warm-up's own AdamW loop it replaced (reference-vs-refactor equivalence)."""

from __future__ import annotations

import torch

from posttrain.learner import PolicyLearner
from posttrain.learner.sft import run_sft


def _pairs(step: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(4):
        p = int(torch.randint(2, 6, (1,), generator=g))
        a = int(torch.randint(1, 5, (1,), generator=g))
        ids = torch.randint(3, 106, (p + a,), generator=g).tolist()
        out.append((ids[:p], ids[p:] + [2]))
    return out


def _reference_sft(model: torch.nn.Module, steps: int, lr: float) -> list[float]:
    """The warm-up as written before the trainer skeleton (torch's AdamW defaults, linear decay to 10%)."""
    from posttrain.trajectory import collate, make_trajectory

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1) * 0.9)
    model.train()
    losses = []
    for s in range(steps):
        trajs = [make_trajectory(traj_id=str(i), prompt_id=str(i), group_id=str(i), prompt_ids=p, action_ids=a,
                                 action_logprobs=[0.0] * len(a), action_versions=0, finish="terminal")
                 for i, (p, a) in enumerate(_pairs(s))]
        b = collate(trajs, pad_token_id=0)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
        mask = b.action_mask[:, 1:].to(lp.dtype)
        loss = -(lp * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def test_run_sft_reproduces_the_reference_warmup(make_model):
    ref_model, model = make_model(dtype=torch.float32), make_model(dtype=torch.float32)
    expected = _reference_sft(ref_model, steps=6, lr=3e-2)
    seen: list[tuple[int, float]] = []
    losses = run_sft(PolicyLearner(model), _pairs, steps=6, lr=3e-2, pad_token_id=0, on_step=lambda s, v: seen.append((s, v)))
    # Bit-equal is right here (not a tolerance): both sides run the same ops on the same shapes in one
    # process (one micro-batch of the step's pairs, the same AdamW path), so no kernel choice can differ.
    assert losses == expected
    assert seen == list(enumerate(losses))
    assert not model.training
    for (k, v), w in zip(model.state_dict().items(), ref_model.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
