"""Stand-ins for the tokenizer, examples and task that held-out evaluation (``posttrain.loop.heldout.evaluate``),
``play_once`` and ReMax's greedy baseline read, shared by the tests that drive them with a stub engine
(test_play_once_infra.py, test_heldout_passk.py, test_heldout_breakdown.py, test_requirements.py)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Ids:
    """What calling a tokenizer gives: ``input_ids``."""

    input_ids: list[int]


class CodePointTokenizer:
    """A text is its characters' code points; ``decode`` joins them back (a test overrides it to script the
    responses)."""

    def __call__(self, text: str) -> Ids:
        return Ids([ord(ch) for ch in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@dataclasses.dataclass(frozen=True)
class Example:
    """The fields of a :class:`~posttrain.envs.task.TaskExample` that evaluation reads."""

    prompt_id: str
    prompt: str
    reference: Any


@dataclasses.dataclass(frozen=True)
class StubTask:
    """A task as evaluation reads it: its ``verifier``."""

    verifier: Any


__all__ = ["CodePointTokenizer", "Example", "Ids", "StubTask"]
