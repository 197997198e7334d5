"""Preference pairs from files: JSONL or Parquet rows of (prompt, chosen, rejected).

A row holds a prompt and two responses to it, the preferred (``chosen``) and the dispreferred
(``rejected``). The field mapping names the columns, as for file tasks
(:mod:`posttrain.envs.files`): keys of ``fields`` are the roles below, values the row's column
(dotted names reach into nested records, ``"extra.answer"``):

The roles (:data:`~posttrain.config.preference.FIELD_ROLES`):

- ``prompt`` (default column ``prompt``): a non-empty string, or a chat (a list of
  ``{role, content}`` ending with the user turn, :func:`~posttrain.envs.prompt_render.check_messages`);
- ``messages``: read the prompt as a chat from this column instead of ``prompt``;
- ``chosen`` / ``rejected`` (default columns of the same names): a non-empty string, or a chat whose
  LAST message is the ``assistant`` response (the common "binarized" layout, where each side repeats
  the conversation): the response is that last message's content. When the prompt column is absent
  from the row and both sides are chats, the prompt is their shared prefix (everything before the
  last message), which must be the same on both sides;
- ``id`` (optional): a scalar pair id, unique in the file (default: the row index);
- ``score_diff`` (optional): a number >= 0, score(chosen) - score(rejected), kept in ``meta``
  (ODPO's offset, :func:`posttrain.algos.preference.odpo`).

Every row is validated on load; a missing or malformed field is a :class:`~posttrain.errors.UserError`
naming the file, the row (0-based) and the column. Two rules compare texts with their whitespace
normalised (runs of whitespace as one space, none at either end; :func:`normalize_whitespace`): a
``chosen`` equal to its ``rejected`` is refused (a pair must differ in more than whitespace), and so is a
pair (prompt, chosen, rejected) that an earlier row already holds, whatever their ids (it would train
with double weight), naming both rows.

Held-out pairs: :func:`split_pairs` splits by a hash of the prompt
(:func:`~posttrain.envs.task.split_of`), so all pairs of one prompt fall on one side, the same in
every run, whatever the row order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.config.paths import resolve_shipped_path
from posttrain.config.preference import FIELD_ROLES
from posttrain.envs.files import MISSING, get_dotted, iter_jsonl, iter_parquet
from posttrain.envs.prompt_render import check_messages
from posttrain.envs.task import split_of
from posttrain.errors import UserError

Prompt = str | tuple[dict[str, str], ...]
"""A plain-text prompt or a chat ending with the user turn."""


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One preference: ``chosen`` is preferred to ``rejected`` as the answer to ``prompt``.

    ``prompt`` is a string or a chat (``{role, content}`` dicts ending with the user turn);
    ``chosen`` / ``rejected`` are the response texts. ``meta`` holds ``source`` (``"<file>: row
    <i>"``, for errors found later) and, when mapped, ``score_diff``.
    """

    pair_id: str
    prompt: str | Sequence[dict[str, str]]
    chosen: str
    rejected: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def prompt_key(self) -> str:
        """The prompt as one string (a chat as its JSON): what the held-out split hashes."""
        return self.prompt if isinstance(self.prompt, str) else json.dumps(list(self.prompt), sort_keys=True)


def normalize_whitespace(text: str) -> str:
    """``text`` with each run of whitespace as one space and none at either end: what the pair checks compare."""
    return " ".join(text.split())


def _pair_key(prompt: str | tuple[dict[str, str], ...], chosen: str, rejected: str) -> bytes:
    """A digest of the pair with its whitespace normalised (a chat prompt's string fields each)."""
    norm_prompt: Any = (normalize_whitespace(prompt) if isinstance(prompt, str) else
                        [{k: normalize_whitespace(v) if isinstance(v, str) else v for k, v in m.items()} for m in prompt])
    text = json.dumps([norm_prompt, normalize_whitespace(chosen), normalize_whitespace(rejected)], sort_keys=True)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _check_fields(fields: Mapping[str, str] | None) -> dict[str, str]:
    cols = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    for role, col in (fields or {}).items():
        if role not in FIELD_ROLES:
            raise UserError(f"preference fields: unknown key {role!r}; valid: {', '.join(FIELD_ROLES)}")
        if not isinstance(col, str) or not col:
            raise UserError(f"preference fields: {role!r} must name a column, got {col!r}")
        cols[role] = col
    if "messages" in cols:
        cols.pop("prompt")
    return cols


def _response(value: Any, where: str) -> tuple[str, tuple[dict[str, str], ...] | None]:
    """``(text, prompt prefix or None)`` of a chosen/rejected value: a string, or a chat ending with the
    assistant's response."""
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where} is an empty string")
        return value, None
    if isinstance(value, Sequence) and value and isinstance(value[-1], Mapping):
        last = value[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or not last["content"].strip():
            raise UserError(f"{where}: the last message must be a non-empty 'assistant' message (the response), "
                            f"got {dict(last)!r:.80}")
        prefix = None
        if len(value) > 1:
            try:
                prefix = check_messages(value[:-1], where)
            except ValueError as e:
                raise UserError(str(e)) from None
        return last["content"], prefix
    raise UserError(f"{where} must be a string or a chat ending with the assistant's response, got {value!r:.60}")


def _prompt(rec: Mapping[str, Any], cols: Mapping[str, str], where: str,
            prefixes: tuple[tuple[dict[str, str], ...] | None, ...]) -> str | tuple[dict[str, str], ...]:
    role = "messages" if "messages" in cols else "prompt"
    raw = get_dotted(rec, cols[role])
    if raw is MISSING:
        c, r = prefixes
        if c is not None and r is not None:
            if c != r:
                raise UserError(f"{where}: field {cols[role]!r} is missing and the chosen and rejected chats have "
                                "different conversations before their responses (no shared prompt)")
            return c
        raise UserError(f"{where}: field {cols[role]!r} is missing")
    if role == "prompt" and isinstance(raw, str):
        if not raw.strip():
            raise UserError(f"{where}: field {cols[role]!r} is an empty string")
        return raw
    try:
        return check_messages(raw, f"{where}: field {cols[role]!r}")
    except ValueError as e:
        raise UserError(str(e)) from None


def _score_diff(rec: Mapping[str, Any], col: str, where: str) -> float:
    v = get_dotted(rec, col)
    if v is MISSING or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise UserError(f"{where}: field {col!r} must be a finite number >= 0 (score(chosen) - score(rejected)), "
                         f"got {None if v is MISSING else v!r}")
    return float(v)


def load_preference_pairs(path: str | Path, fields: Mapping[str, str] | None = None) -> list[PreferencePair]:
    """Every row of the JSONL (``.jsonl``) or Parquet (``.parquet``) file ``path`` as a validated pair.

    ``fields`` maps the roles of :data:`FIELD_ROLES` to column names (module docstring). Pair ids
    are ``"<file stem>/<id or row>"``. A missing file, an unknown suffix, an unknown field role, a
    missing or malformed field, a duplicate id, chosen and rejected responses equal up to whitespace, a
    pair (prompt, chosen, rejected) an earlier row holds (whitespace aside; both rows named), or a file
    without rows is a :class:`~posttrain.errors.UserError` naming the file (and the row and column).
    """
    p = resolve_shipped_path(path)
    cols = _check_fields(fields)
    if not p.is_file():
        raise UserError(f"{p}: no such preference file")
    readers = {".jsonl": iter_jsonl, ".parquet": iter_parquet}
    if p.suffix not in readers:
        raise UserError(f"{p}: unknown preference file suffix {p.suffix!r}; valid: .jsonl, .parquet")
    out: list[PreferencePair] = []
    seen: dict[str, int] = {}
    seen_pairs: dict[bytes, int] = {}
    try:
        for i, rec in readers[p.suffix](p):
            where = f"{p}: row {i}"
            sides = []
            for role in ("chosen", "rejected"):
                raw = get_dotted(rec, cols[role])
                if raw is MISSING:
                    raise UserError(f"{where}: field {cols[role]!r} is missing")
                sides.append(_response(raw, f"{where}: field {cols[role]!r}"))
            (chosen, c_prefix), (rejected, r_prefix) = sides
            if chosen == rejected:
                raise UserError(f"{where}: fields {cols['chosen']!r} and {cols['rejected']!r} hold the same response "
                                "(a pair must differ)")
            if normalize_whitespace(chosen) == normalize_whitespace(rejected):
                raise UserError(f"{where}: fields {cols['chosen']!r} and {cols['rejected']!r} differ only in whitespace "
                                f"({chosen!r:.40} vs {rejected!r:.40}): the same response (a pair must differ)")
            prompt = _prompt(rec, cols, where, (c_prefix, r_prefix))
            key = _pair_key(prompt, chosen, rejected)
            if key in seen_pairs:
                raise UserError(f"{p}: rows {seen_pairs[key]} and {i}: the same pair (prompt, {cols['chosen']!r}, "
                                f"{cols['rejected']!r}; whitespace aside) twice, which would train on it with double "
                                "weight; keep one")
            seen_pairs[key] = i
            pid = str(i)
            if "id" in cols:
                raw_id = get_dotted(rec, cols["id"])
                if raw_id is MISSING or raw_id is None or not isinstance(raw_id, str | int | float | bool):
                    raise UserError(f"{where}: field {cols['id']!r} must be a present scalar id")
                pid = str(raw_id)
                if pid in seen:
                    raise UserError(f"{p}: rows {seen[pid]} and {i}: duplicate id {raw_id!r} (field {cols['id']!r})")
                seen[pid] = i
            meta: dict[str, Any] = {"source": where}
            if "score_diff" in cols:
                meta["score_diff"] = _score_diff(rec, cols["score_diff"], where)
            out.append(PreferencePair(pair_id=f"{p.stem}/{pid}", prompt=prompt, chosen=chosen, rejected=rejected,
                                      meta=meta))
    except UserError:
        raise
    except ValueError as e:  # the readers' own errors (not UTF-8, not JSON, a row too long) name the row
        raise UserError(str(e)) from None
    if not out:
        raise UserError(f"{p}: no rows")
    return out


def split_pairs(pairs: Sequence[PreferencePair], heldout_fraction: float
                ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """``(train, heldout)``: a pair is held out iff ``split_of("preference|" + prompt, heldout_fraction)``
    says so (a hash of its prompt: deterministic, independent of order and seed; all pairs of one
    prompt on one side). ``heldout_fraction`` in (0, 1), else ``ValueError``."""
    train: list[PreferencePair] = []
    heldout: list[PreferencePair] = []
    for pair in pairs:
        (heldout if split_of(f"preference|{pair.prompt_key()}", heldout_fraction) == "heldout" else train).append(pair)
    return train, heldout
