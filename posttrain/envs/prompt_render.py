"""Single-turn prompts -> token ids: the one place a task example becomes what the engine samples from.

A :class:`~posttrain.envs.task.TaskExample` carries either plain text (``prompt``) or chat
``messages`` (system / few-shot user+assistant / final user). :class:`PromptRenderer` renders it:

- ``chat`` mode: ``[system_prompt] + messages`` (a plain-text example is one user message)
  through the tokenizer's own chat template, ``apply_chat_template(messages,
  add_generation_prompt=True, tokenize=False)``, then encoded without adding special tokens
  (the template already holds them), the way the model saw its instruction data;
- ``raw`` mode (what every builtin char-tokenizer preset uses, and what all runs did before
  chat templating): the text ``tokenizer(text).input_ids`` with ``text`` = the prompt, or the
  messages' contents joined by newlines, with ``system_prompt`` as a first line when set.

Every sampling and learning path (training rollouts, held-out evaluation, the ReMax greedy
baseline, SFT warm-up pairs, ``posttrain check``, the prompt checks at run start) encodes through
one renderer, so the ids the engine samples from are the ids the learner recomputes on. Each
trajectory records what it was rendered from (:meth:`PromptRenderer.record`: the mode, a
fingerprint of the chat template and the example's own messages / text) and the learner re-renders
it before computing pi_old (:meth:`PromptRenderer.verify`): a prompt rendered differently on the
learner's side (another template or system prompt) is an error naming the prompt and the first
differing position, never a silently wrong behaviour probability.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

ChatSetting = bool | Literal["auto"]

MODES = ("raw", "chat")

ROLES = ("system", "user", "assistant")
"""Roles a single-turn example's messages may use (tool turns belong to multi-turn environments)."""

META_FORMAT = "prompt_format"
META_TEMPLATE = "chat_template"
META_SOURCE = "prompt_source"
"""Trajectory ``meta`` keys written by :meth:`PromptRenderer.record`."""


class PromptMismatchError(RuntimeError):
    """The learner's rendering of a prompt differs from the ids the engine sampled from."""


def check_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    """``messages`` as a tuple of ``{"role", "content"}`` dicts, validated.

    Each item is a mapping with a ``role`` in :data:`ROLES` and a string ``content``; the list
    is non-empty and ends with a non-empty ``user`` message (the turn the model answers).
    ``ValueError`` starting with ``where`` otherwise.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.60}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {j} must be {{role, content}}, got {m!r:.60}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {j} has role {m['role']!r}; valid: {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {j} content must be a string, got {type(m['content']).__name__}")
        out.append({"role": str(m["role"]), "content": m["content"]})
    if out[-1]["role"] != "user" or not out[-1]["content"].strip():
        raise ValueError(f"{where}: the last message must be a non-empty 'user' message (the turn to answer)")
    return tuple(out)


def template_fingerprint(tokenizer: Tokenizer) -> str:
    """``sha256:<hex>`` of the tokenizer's chat template string, or ``"none"`` when it has none."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, Mapping):  # named templates: hash them all, in a stable order
        tpl = json.dumps(dict(tpl), sort_keys=True)
    if not tpl:
        return "none"
    return "sha256:" + hashlib.sha256(str(tpl).encode()).hexdigest()


def resolve_chat(setting: ChatSetting, tokenizer: Tokenizer, *, char_preset: bool) -> bool:
    """Whether prompts go through the chat template (``task.chat_template``).

    ``True``: yes (``ValueError`` when the tokenizer has no chat template); ``False``: raw text;
    ``"auto"``: yes iff the tokenizer has a chat template and the model is not a builtin
    char-tokenizer preset (``char_preset``: those models are trained from scratch on the raw
    task text, so their template is only for multi-turn environments).
    """
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting == "auto":
        return has and not char_preset
    if setting is True and not has:
        raise ValueError("task.chat_template: true, but the model's tokenizer has no chat template")
    return bool(setting)


class PromptRenderer:
    """Turns task examples into prompt token ids (module docstring); one per run.

    ``chat``: render through the tokenizer's chat template (else raw text); ``system_prompt``:
    a system message (chat) or first line (raw) put before every example's own messages.
    """

    def __init__(self, tokenizer: Tokenizer, *, chat: bool = False, system_prompt: str | None = None) -> None:
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat rendering needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.chat = bool(chat)
        self.system_prompt = system_prompt or None
        self.fingerprint = template_fingerprint(tokenizer) if self.chat else "none"
        # The producer thread renders while the learner verifies (one_step_off / async): one at a time
        # through this renderer, so no two threads drive the same Rust tokenizer at once.
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        """``"chat"`` or ``"raw"``."""
        return "chat" if self.chat else "raw"

    # ------------------------------------------------------------------ rendering
    def messages(self, example: Any) -> list[dict[str, str]]:
        """The conversation rendered for ``example``: system prompt (if any) + its messages, or one
        user message holding ``example.prompt``."""
        own = getattr(example, "messages", None)
        msgs = [dict(m) for m in own] if own else [{"role": "user", "content": str(example.prompt)}]
        if self.system_prompt:
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        return msgs

    def text(self, example: Any) -> str:
        """The exact prompt text of ``example`` (template applied in chat mode)."""
        own = getattr(example, "messages", None)
        if self.chat:
            return str(self.tokenizer.apply_chat_template(self.messages(example), add_generation_prompt=True,
                                                          tokenize=False))
        body = "\n".join(m["content"] for m in own) if own else str(example.prompt)
        return f"{self.system_prompt}\n{body}" if self.system_prompt else body

    def encode(self, text: str) -> list[int]:
        """Ids of an already rendered :meth:`text` (chat: no special tokens added, the template has them)."""
        with self._lock:
            if self.chat:
                return list(self.tokenizer(text, add_special_tokens=False).input_ids)
            return list(self.tokenizer(text).input_ids)

    def ids(self, example: Any) -> list[int]:
        """Prompt token ids of ``example``: what the engine samples from and the learner recomputes on."""
        with self._lock:
            text = self.text(example)
        return self.encode(text)

    # ------------------------------------------------------------------ record / verify
    @staticmethod
    def source(example: Any) -> str:
        """What the example's rendering depends on, as JSON: ``{"messages": [...]}`` or ``{"prompt": text}``."""
        own = getattr(example, "messages", None)
        return json.dumps({"messages": [dict(m) for m in own]} if own else {"prompt": str(example.prompt)},
                          ensure_ascii=False)

    def record(self, example: Any) -> dict[str, str]:
        """Trajectory meta of an example rendered by this renderer (mode, template fingerprint, source)."""
        return {META_FORMAT: self.mode, META_TEMPLATE: self.fingerprint, META_SOURCE: self.source(example)}

    def verify(self, trajectories: Sequence[Any]) -> int:
        """Re-render every trajectory's recorded prompt source and compare with its prompt tokens.

        A trajectory without a recorded source (``meta["prompt_source"]``: multi-turn episodes,
        hand-built records) is not checked. Returns how many were checked. Raises
        :class:`PromptMismatchError` naming the trajectory, its prompt id, the recorded and current
        mode / template fingerprint and the first differing token position.
        """
        cache: dict[str, list[int]] = {}
        checked = 0
        for t in trajectories:
            src = t.meta.get(META_SOURCE) if t.meta else None
            if not isinstance(src, str):
                continue
            if src not in cache:
                d = json.loads(src)
                ex = _Source(prompt=str(d.get("prompt", "")), messages=d.get("messages"))
                cache[src] = self.ids(ex)
            want = cache[src]
            got = [int(x) for x in t.token_ids[: t.prompt_length]]
            if got != want:
                pos = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
                raise PromptMismatchError(
                    f"prompt {t.prompt_id!r} (trajectory {t.traj_id!r}): the learner's rendering differs from the ids "
                    f"the engine sampled from at token {pos} (sampled {len(got)} prompt tokens with "
                    f"{t.meta.get(META_FORMAT)}/{t.meta.get(META_TEMPLATE)}, learner renders {len(want)} with "
                    f"{self.mode}/{self.fingerprint}); pi_old would not be the behaviour policy's prompt")
            checked += 1
        return checked


class _Source:
    """A recorded prompt source standing in for its example when re-rendering."""

    def __init__(self, prompt: str, messages: Any) -> None:
        self.prompt = prompt
        self.messages = tuple(messages) if messages else None
