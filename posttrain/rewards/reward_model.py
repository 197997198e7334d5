"""Learned reward model: any ``transformers`` sequence-classification model as a reward component.

A Bradley-Terry reward model (Bradley & Terry 1952; Ouyang et al. 2022, arXiv:2203.02155) maps a
``(prompt, response)`` text to one scalar ``r(x, y)`` = ``logits[:, label]`` of a
``*ForSequenceClassification`` model. :func:`render_pair` is the one rendering of a pair, shared by
the trainer (:mod:`posttrain.loop.reward_model_training`) and the scorer, so RL scores responses in
the form the model was trained on; a trained directory records it in :data:`RENDER_FILE`.
:class:`RewardModelScorer` scores in batches of ``batch_size`` with padding; :meth:`score_rows`
turns a failed batch into failures naming it (never a score of zero);
:mod:`posttrain.rewards.learned` makes it a component of each verdict.

What counts as a reward model (:func:`reward_model_evidence`, :func:`check_reward_model_dir`): a
directory posttrain trained (its :data:`RENDER_FILE`), or a Hugging Face directory whose ``config.json``
``architectures`` name a ``*ForSequenceClassification`` class (a third-party reward model: rendered as
plain text, ``max_length`` 1024) whose weights hold every parameter of that class, the score head
included. A causal-LM policy (``*ForCausalLM``, e.g. a checkpoint's ``actor/``) is refused: loaded as a
sequence classifier it would score with a freshly initialised head.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

RENDER_FILE = "posttrain_reward_model.json"
"""Written beside a trained reward model's weights: ``{"use_chat_template": bool, "max_length": int}``."""

PromptLike = str | Sequence[Mapping[str, str]]
"""A prompt text, or a chat (``{role, content}`` messages ending with the user turn)."""

_CAUSAL_LM = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
"""``architectures`` suffixes of a generating model (a policy), not a scorer."""


def _architectures(d: Path) -> list[str]:
    """``config.json``'s ``architectures`` of ``d`` (empty when absent or unreadable)."""
    try:
        data = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return []
    arch = data.get("architectures") if isinstance(data, dict) else None
    return [a for a in arch if isinstance(a, str)] if isinstance(arch, list) else []


def reward_model_evidence(d: Path) -> str | None:
    """Why directory ``d`` holds a reward model, as a phrase: its :data:`RENDER_FILE` (trained by posttrain) or
    a ``config.json`` ``architectures`` entry ending in ``ForSequenceClassification``; None when neither."""
    if (d / RENDER_FILE).is_file():
        return f"{RENDER_FILE}: trained by posttrain (trainer=reward_model)"
    seq = [a for a in _architectures(d) if a.endswith("ForSequenceClassification")]
    return f"config.json architectures {seq}" if seq else None


def check_reward_model_dir(path: str | Path, key: str = "reward.model.path") -> Path:
    """``Path(path)`` when it is a reward-model directory (module docstring), read from its files alone
    (nothing loaded). Else a one-line :class:`~posttrain.errors.UserError` naming ``key`` and what the
    directory is: missing (no ``config.json``), a causal-LM policy checkpoint, or another model. The
    weights' score head is checked when the model is loaded (:meth:`RewardModelScorer.from_pretrained`)."""
    d = Path(path)
    train = "train one with trainer=reward_model (`posttrain train reward_model`, it writes <run_dir>/reward_model)"
    if not (d / "config.json").is_file():
        inner = next((c for c in (d / "reward_model", d / "actor") if reward_model_evidence(c)), None)
        hint = "" if inner is None else f"; did you mean {inner} (that run's reward model)?"
        raise UserError(f"{key} {d}: no such model directory (no config.json); {train}{hint}")
    if reward_model_evidence(d) is not None:
        return d
    arch = _architectures(d)
    if any(a.endswith(_CAUSAL_LM) for a in arch):
        raise UserError(f"{key} {d}: a causal LM policy checkpoint (config.json architectures {arch}), not a reward "
                        f"model (no score head: a fresh random one would score every response); {train}, or give "
                        "a Hugging Face *ForSequenceClassification directory")
    raise UserError(f"{key} {d}: not a reward model (no {RENDER_FILE}, and config.json architectures "
                    f"{arch or 'absent'} name no *ForSequenceClassification class); {train}")


def render_pair(tokenizer: Tokenizer, prompt: PromptLike, response: str, *, use_chat_template: bool) -> str:
    """The text a reward model reads for ``response`` to ``prompt``.

    With ``use_chat_template`` (and a tokenizer that has one): the chat template of the prompt's messages
    (a plain prompt as one user message) followed by the assistant's ``response``. Without: the prompt
    text directly followed by the response (a chat's messages' contents joined by newlines first).
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        return str(tokenizer.apply_chat_template([*msgs, {"role": "assistant", "content": response}], tokenize=False))
    text = prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt)
    return text + response


def pair_rewards(model: Any, tokenizer: Tokenizer, texts: Sequence[str], *, max_length: int, label: int = 0) -> torch.Tensor:
    """``r(text)`` = ``logits[:, label]`` of each rendered text (``[len(texts)]``, the model's dtype), in one
    padded forward, truncated at ``max_length`` tokens; gradients flow when the caller allows them (training)."""
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True, max_length=max_length)
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in enc.items()}).logits[:, label]  # type: ignore[no-any-return]


class RewardModelScorer:
    """Batched scoring with a ``*ForSequenceClassification`` model (kept in eval mode).

    ``component`` names the score in verdicts; ``max_length`` truncates (a pair longer than the model
    was trained on is scored on its first ``max_length`` tokens). Calls from several threads (a run's
    producer thread and its held-out evaluation) take turns: a fast tokenizer's padding and truncation
    state is not thread-safe.
    """

    def __init__(self, model: Any, tokenizer: Tokenizer, *, batch_size: int = 16, max_length: int = 1024,
                 label: int = 0, component: str = "rm", use_chat_template: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"RewardModelScorer: batch_size must be >= 1, got {batch_size}")
        if getattr(model.config, "pad_token_id", None) is None:
            raise ValueError("RewardModelScorer: model.config.pad_token_id must be set (it finds the last token)")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_length, self.label = batch_size, max_length, label
        self.component, self.use_chat_template = component, use_chat_template
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> RewardModelScorer:
        """Load a local model directory with ``AutoModelForSequenceClassification`` and its tokenizer.

        The rendering and length of a posttrain-trained directory (:data:`RENDER_FILE`) are used unless
        ``kwargs`` give them. A directory that is not a reward model (:func:`check_reward_model_dir`: missing,
        a causal-LM policy, ...) or whose weights lack a parameter of the model (a head that loading would
        initialise afresh) is a :class:`~posttrain.errors.UserError` naming ``reward.model.path``.
        """
        from transformers import AutoModelForSequenceClassification

        from posttrain.models.tokenizer import load_pretrained_tokenizer

        d = check_reward_model_dir(path)
        render = json.loads((d / RENDER_FILE).read_text()) if (d / RENDER_FILE).is_file() else {}
        opts = {k: render[k] for k in ("use_chat_template", "max_length") if k in render}
        model, info = AutoModelForSequenceClassification.from_pretrained(str(d), output_loading_info=True)
        fresh = sorted({*info.get("missing_keys", ()), *(k[0] if isinstance(k, tuple) else k
                                                         for k in info.get("mismatched_keys", ()))})
        if fresh:
            raise UserError(f"reward.model.path {d}: its weights lack {fresh[:4]} (loading would initialise them "
                            f"afresh, e.g. an untrained score head), so it is not a trained reward model")
        return cls(model, load_pretrained_tokenizer(d), **{**opts, **kwargs})

    def _render(self, prompt: PromptLike, response: str) -> str:
        return render_pair(self.tokenizer, prompt, response, use_chat_template=self.use_chat_template)

    @torch.no_grad()
    def score(self, prompts: Sequence[PromptLike], responses: Sequence[str]) -> list[float]:
        """``logits[:, label]`` of each ``(prompt, response)``; a float per row. Raises on any failure."""
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModelScorer: {len(prompts)} prompts for {len(responses)} responses")
        texts = [self._render(p, r) for p, r in zip(prompts, responses, strict=True)]
        out: list[float] = []
        for s in range(0, len(texts), self.batch_size):
            with self._lock:
                r = pair_rewards(self.model, self.tokenizer, texts[s : s + self.batch_size],
                                 max_length=self.max_length, label=self.label)
            out.extend(float(x) for x in r.float().cpu())
        return out

    def score_rows(self, prompts: Sequence[PromptLike], responses: Sequence[str]) -> list[float | str]:
        """Per row, its score, or a string saying why it has none.

        Batch by batch: a batch whose forward raises gives each of its rows the error (an honest failure:
        the caller makes those rows ``infra_error``, never a zero score); a non-finite score is a failure
        of its row alone.
        """
        out: list[float | str] = []
        for s in range(0, len(prompts), self.batch_size):
            p, r = prompts[s : s + self.batch_size], responses[s : s + self.batch_size]
            try:
                scores = self.score(p, r)
            except Exception as e:  # noqa: BLE001 - becomes these rows' infra_error (see docstring)
                out.extend([f"reward model {self.component!r} failed on a batch: {type(e).__name__}: {e}"[:300]] * len(p))
                continue
            out.extend(x if math.isfinite(x) else f"reward model {self.component!r} scored {x}" for x in scores)
        return out
