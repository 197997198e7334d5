"""Demonstrations for supervised fine-tuning (``trainer: sft``): load, render, mask, split, pack.

**Rows.** A JSONL (``.jsonl``) or Parquet (``.parquet``) file; each row is one of

- a chat: ``{"messages": [{"role", "content"}, ...]}``, roles ``system`` / ``user`` / ``assistant`` /
  ``tool``; every assistant turn is trained;
- a prompt-completion pair with two strings: ``{"prompt": str, "completion": str}``; the completion is
  trained;
- a conversational prompt-completion pair (TRL's layout): ``prompt`` a list of messages, ``completion`` a
  list of assistant messages; only the completion's turns are trained (an assistant turn inside the prompt,
  a few-shot example, is not).

Every row is validated on load; a missing field, a role outside the four, a non-string content, an empty
assistant turn, a row with nothing to train, a chat that starts with an assistant turn or a field of both
layouts is a :class:`~posttrain.errors.UserError` naming the file, the row (0-based) and the field.

**Rendering and the loss mask** (:func:`encode_row`). Chats and conversational pairs go through the
tokenizer's chat template (a tokenizer without one is an error naming the model and the row). Each assistant
turn ``k`` is cut out of the rendering by two renders of the conversation: up to turn ``k`` with the
generation prompt, and through turn ``k``; the text the second adds is the turn, which must extend the first
(else the template cannot be masked, an error). The pieces are encoded one by one without special tokens
and concatenated: the ids of a prompt are exactly those :class:`~posttrain.envs.prompt_render.PromptRenderer`
gives the engine (so an SFT'd model is trained on what RL then samples from), and a turn's are what the
engine would have sampled after it. Loss mask: 1 on a trained turn's tokens up to and including its
end-of-turn token (the first special token after the content: ``<|im_end|>``, ``<eos>``), 0 on everything
else (system and user turns, the generation prompt, template text after the end-of-turn such as a newline,
padding). A string prompt-completion pair is rendered as the run's prompts are (``task.chat_template``,
``task.system_prompt``: chat, or raw text then the completion's ids and EOS, as the preference trainer
encodes a response). Token 0 of a row is never a target (it has no context).

**Length.** A row longer than ``sft.max_length`` tokens is an error naming its file, row and length (raise
``sft.max_length`` or shorten the row): silently cutting a demonstration would train on a reply without its
end, or drop it.

**Held-out rows.** :func:`split_rows` splits by a hash of the row's prompt (the messages before its first
trained turn; :func:`~posttrain.envs.task.split_of`), so rows sharing a prompt (several kept answers of one
problem) fall on one side, the same in every run and every seed.

**Packing.** :func:`pack_rows` puts whole rows into blocks of at most ``capacity`` tokens (best-fit
decreasing, deterministic); a row is never split across blocks. The loop gives each row of a block its own
position ids (restarting at 0) and attention within itself only (posttrain/loop/sft_training.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.config.paths import resolve_shipped_path
from posttrain.envs.files import iter_jsonl, iter_parquet
from posttrain.envs.task import split_of
from posttrain.errors import UserError
from posttrain.models.tokenizer_protocol import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
"""Roles a demonstration's messages may use."""

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class SFTRow:
    """One validated demonstration: the conversation ``messages``, which of them are ``trained`` (one flag per
    message: assistant turns, for a pair only the completion's), ``text`` (a string prompt-completion pair,
    rendered as the run renders prompts) and ``source`` (``"<file>: row <i>"``)."""

    messages: tuple[Message, ...]
    trained: tuple[bool, ...]
    text: bool
    source: str

    def prompt_key(self) -> str:
        """The messages before the first trained turn, as JSON: what the held-out split hashes."""
        first = self.trained.index(True)
        return json.dumps(list(self.messages[:first]), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class EncodedRow:
    """A row as ids: ``input_ids`` and ``loss_mask`` (1 = a target token) of the same length, and its source."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    source: str

    @property
    def targets(self) -> int:
        """Target tokens (the loss mask's sum)."""
        return sum(self.loss_mask)


def _messages(value: Any, where: str, *, completion: bool = False) -> tuple[Message, ...]:
    """``value`` as validated ``{role, content}`` messages (``completion``: every one an assistant turn)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise UserError(f"{where} must be a non-empty list of {{role, content}} messages, got {value!r:.60}")
    out: list[Message] = []
    for j, m in enumerate(value):
        at = f"{where}: message {j}"
        if not isinstance(m, Mapping):
            raise UserError(f"{at} must be a {{role, content}} object, got {m!r:.60}")
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            raise UserError(f"{at}: field {missing[0]!r} is missing")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise UserError(f"{at}: unknown field {extra[0]!r} (a message is {{role, content}})")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise UserError(f"{at}: role {role!r} is not one of {', '.join(ROLES)}")
        if completion and role != "assistant":
            raise UserError(f"{at}: role {role!r} in a completion; a completion's messages are 'assistant' turns")
        if not isinstance(content, str):
            raise UserError(f"{at}: content must be a string, got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise UserError(f"{at}: empty assistant turn (nothing to train on; drop the turn or the row)")
        out.append({"role": role, "content": content})
    return tuple(out)


def parse_row(rec: Mapping[str, Any], where: str) -> SFTRow:
    """One record as an :class:`SFTRow` (the layouts of the module docstring); ``UserError`` starting with
    ``where`` naming the field otherwise."""
    if "messages" in rec:
        both = [k for k in ("prompt", "completion") if k in rec]
        if both:
            raise UserError(f"{where}: fields 'messages' and {both[0]!r} both given; a row is a chat (messages) or "
                            "a prompt-completion pair, not both")
        msgs = _messages(rec["messages"], f"{where}: field 'messages'")
        trained = tuple(m["role"] == "assistant" for m in msgs)
        if not any(trained):
            raise UserError(f"{where}: field 'messages' has no assistant turn (nothing to train on)")
        if trained[0]:
            raise UserError(f"{where}: field 'messages': message 0 is an assistant turn with nothing before it "
                            "(give the user turn it answers)")
        return SFTRow(msgs, trained, False, where)
    if "prompt" not in rec and "completion" not in rec:
        raise UserError(f"{where}: field 'messages' is missing (a row is a chat {{messages}} or a pair "
                        "{prompt, completion})")
    for key in ("prompt", "completion"):
        if key not in rec:
            raise UserError(f"{where}: field {key!r} is missing (a prompt-completion row has both)")
    prompt, completion = rec["prompt"], rec["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not prompt.strip():
            raise UserError(f"{where}: field 'prompt' is an empty string")
        if not completion.strip():
            raise UserError(f"{where}: field 'completion' is an empty string (nothing to train on)")
        return SFTRow(({"role": "user", "content": prompt}, {"role": "assistant", "content": completion}),
                      (False, True), True, where)
    if isinstance(prompt, str) or isinstance(completion, str):
        raise UserError(f"{where}: fields 'prompt' and 'completion' must both be strings or both lists of "
                        f"messages, got {type(prompt).__name__} and {type(completion).__name__}")
    p = _messages(prompt, f"{where}: field 'prompt'")
    c = _messages(completion, f"{where}: field 'completion'", completion=True)
    return SFTRow(p + c, (False,) * len(p) + (True,) * len(c), False, where)


def load_sft_rows(path: str | Path) -> list[SFTRow]:
    """Every row of the JSONL or Parquet file ``path`` (a shipped relative path is found under the install
    root), validated (:func:`parse_row`). A missing file, an unknown suffix, a malformed row or a file without
    rows is a :class:`~posttrain.errors.UserError` naming the file (and the row)."""
    p = resolve_shipped_path(path)
    if not p.is_file():
        hint = ""
        if p.name == "sft.jsonl" and not (p.parent / "request.json").is_file():  # a `posttrain sample` output to be
            hint = (f" (`posttrain sample RECIPE --out {p.parent}` writes it: run that stage first, "
                     "docs/expert_iteration.md)")
        raise UserError(f"{p}: no such SFT data file{hint}")
    readers = {".jsonl": iter_jsonl, ".parquet": iter_parquet}
    if p.suffix not in readers:
        raise UserError(f"{p}: unknown SFT data file suffix {p.suffix!r}; valid: .jsonl, .parquet")
    try:
        rows = [parse_row(rec, f"{p}: row {i}") for i, rec in readers[p.suffix](p)]
    except ValueError as e:  # the readers' own errors (not UTF-8, not JSON, a row too long) name the row
        raise UserError(str(e)) from None
    if not rows:
        raise UserError(f"{p}: no rows")
    return rows


def split_rows(rows: Sequence[SFTRow], heldout_fraction: float) -> tuple[list[SFTRow], list[SFTRow]]:
    """``(train, heldout)``: a row is held out iff ``split_of("sft|" + prompt_key, heldout_fraction)`` says so
    (module docstring); the order of the file is kept on each side."""
    train: list[SFTRow] = []
    held: list[SFTRow] = []
    for r in rows:
        (held if split_of(f"sft|{r.prompt_key()}", heldout_fraction) == "heldout" else train).append(r)
    return train, held


def _render(tokenizer: Tokenizer, messages: Sequence[Message], *, generation_prompt: bool) -> str:
    return str(tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False))


def _end_of_turn(turn: str, content: str, special: Iterable[str]) -> int:
    """Length of the trained part of an assistant ``turn`` text: through the first special token after its
    ``content`` (the end-of-turn marker); the whole turn when none follows."""
    start = turn.find(content)
    start = 0 if start < 0 else start + len(content)
    ends = [(i, len(s)) for s in special if s and (i := turn.find(s, start)) >= 0]
    if not ends:
        return len(turn)
    i, n = min(ends)
    return i + n


def chat_pieces(row: SFTRow, tokenizer: Tokenizer, system_prompt: str | None = None) -> list[tuple[str, bool]]:
    """The row's chat rendering as ``(text, trained)`` pieces whose concatenation is the rendering of the whole
    conversation (module docstring); ``system_prompt`` is put first as the run's renderer does. ``UserError``
    naming the row when the template does not render a turn as an extension of its generation prompt."""
    msgs = [dict(m) for m in row.messages]
    trained = list(row.trained)
    if system_prompt:
        msgs, trained = [{"role": "system", "content": system_prompt}, *msgs], [False, *trained]
    special = list(getattr(tokenizer, "all_special_tokens", []) or [])
    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, msgs[:k], generation_prompt=True)
        through = _render(tokenizer, msgs[: k + 1], generation_prompt=False)
        if not before.startswith(done) or not through.startswith(before):
            raise UserError(f"{row.source}: the chat template does not render assistant turn {k} as text after its "
                            "generation prompt, so its tokens cannot be masked; use prompt-completion string rows")
        turn = through[len(before):]
        cut = _end_of_turn(turn, m["content"], special) if trained[k] else len(turn)
        pieces += [(before[len(done):], False), (turn[:cut], trained[k]), (turn[cut:], False)]
        done = through
    whole = _render(tokenizer, msgs, generation_prompt=False)
    if not whole.startswith(done):
        raise UserError(f"{row.source}: the chat template renders the whole conversation differently from its turns")
    pieces.append((whole[len(done):], False))
    return [(t, tr) for t, tr in pieces if t]


def encode_row(row: SFTRow, tokenizer: Tokenizer, *, chat: bool, system_prompt: str | None, max_length: int,
               model_name: str) -> EncodedRow:
    """``row`` as ids and loss mask (module docstring). ``chat``: whether string pairs go through the chat
    template (``task.chat_template`` resolved; chats always do); ``model_name`` names the tokenizer in errors.
    ``UserError`` naming the row when it needs a chat template the tokenizer lacks, has no target token, or is
    longer than ``max_length`` (``sft.max_length``)."""
    ids: list[int] = []
    mask: list[int] = []
    if row.text and not chat:
        head = f"{system_prompt}\n{row.messages[0]['content']}" if system_prompt else row.messages[0]["content"]
        ids = list(tokenizer(head).input_ids)
        tail = list(tokenizer(row.messages[1]["content"], add_special_tokens=False).input_ids)
        if tokenizer.eos_token_id is not None:
            tail.append(int(tokenizer.eos_token_id))
        mask = [0] * len(ids) + [1] * len(tail)
        ids += tail
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{row.source}: a chat row, but the tokenizer of model.path={model_name} has no chat "
                            "template; use a model whose tokenizer has one, or prompt/completion string rows "
                            "(rendered as plain text with task.chat_template=false)")
        for text, trained in chat_pieces(row, tokenizer, system_prompt):
            piece = list(tokenizer(text, add_special_tokens=False).input_ids)
            ids += piece
            mask += [int(trained)] * len(piece)
    if mask and mask[0]:
        mask[0] = 0  # the first token has no context: never a target
    if not any(mask):
        raise UserError(f"{row.source}: the trained turns encode to no tokens")
    if len(ids) > max_length:
        raise UserError(f"{row.source}: {len(ids)} tokens, over sft.max_length={max_length} (raise sft.max_length "
                        "or shorten the row; rows are never truncated)")
    return EncodedRow(tuple(ids), tuple(mask), row.source)


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Row indices in blocks of at most ``capacity`` tokens, best-fit decreasing: rows by decreasing length
    (ties by index), each into the fullest block it still fits, else a new one. Every index once; indices
    ascending within a block; a row is never split (``ValueError`` for a row longer than ``capacity``)."""
    blocks: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"pack_rows: row {i} has {n} tokens, over the block capacity {capacity}")
        fits = [b for b in range(len(blocks)) if room[b] >= n]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
            blocks[b].append(i)
            room[b] -= n
        else:
            blocks.append([i])
            room.append(capacity - n)
    return [sorted(b) for b in blocks]


__all__ = ["ROLES", "EncodedRow", "SFTRow", "chat_pieces", "encode_row", "load_sft_rows", "pack_rows", "parse_row",
           "split_rows"]
