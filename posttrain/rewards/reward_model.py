"""Learned reward model: any ``transformers`` sequence-classification model as a component.

``score(prompts, responses)`` renders ``prompt + response`` (or the tokenizer's chat template
with a user and an assistant turn, if ``use_chat_template``), tokenizes in batches of
``batch_size`` with padding, and returns ``logits[:, label]`` per row (a Bradley-Terry reward
model has one label; Ouyang et al. 2022, arXiv:2203.02155). The score enters the reward as one
more raw component (default name ``"rm"``), weighted in the config like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status


class RewardModelScorer:
    """Batched scoring with a ``*ForSequenceClassification`` model (kept in eval mode)."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 16, max_length: int = 1024,
                 label: int = 0, component: str = "rm", use_chat_template: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"RewardModelScorer: batch_size must be >= 1, got {batch_size}")
        if getattr(model.config, "pad_token_id", None) is None:
            raise ValueError("RewardModelScorer: model.config.pad_token_id must be set (it finds the last token)")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_length, self.label = batch_size, max_length, label
        self.component, self.use_chat_template = component, use_chat_template

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> RewardModelScorer:
        """Load a local model directory with ``AutoModelForSequenceClassification``."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        return cls(AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path), **kwargs)

    def _render(self, prompt: str, response: str) -> str:
        if self.use_chat_template and getattr(self.tokenizer, "chat_template", None):
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(msgs, tokenize=False))
        return prompt + response

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """``logits[:, label]`` of each ``(prompt, response)``; float per row."""
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModelScorer: {len(prompts)} prompts for {len(responses)} responses")
        texts = [self._render(p, r) for p, r in zip(prompts, responses, strict=True)]
        device = next(self.model.parameters()).device
        out: list[float] = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[s : s + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length)
            logits = self.model(**{k: v.to(device) for k, v in enc.items()}).logits
            out.extend(float(x) for x in logits[:, self.label].float().cpu())
        return out

    def add_to(self, verdicts: Sequence[Verdict], prompts: Sequence[str], responses: Sequence[str]) -> list[Verdict]:
        """``verdicts`` with the score added as component ``self.component``.

        ``infra_error`` verdicts stay as they are (they carry no reward); only the other rows are
        scored.
        """
        rows = [i for i, v in enumerate(verdicts) if v.status is not Status.INFRA_ERROR]
        scores = self.score([prompts[i] for i in rows], [responses[i] for i in rows])
        out = list(verdicts)
        for i, sc in zip(rows, scores, strict=True):
            v = verdicts[i]
            out[i] = Verdict(v.status, {**v.components, self.component: sc}, v.explanation)
        return out
