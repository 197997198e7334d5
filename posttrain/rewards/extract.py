"""Final-answer extraction from free text: ``\\boxed{}``, ``<answer>`` tags, "answer:" lines, last number.

``auto`` order of preference (the usual RLVR convention, e.g. Hendrycks et al. 2021 MATH,
arXiv:2103.03874 for ``\\boxed``): the last ``\\boxed{...}`` (balanced braces), else the last
``answer: ...`` line, else the last number in the text. A single mode (:data:`EXTRACT_MODES`,
:func:`extract_answer`) reads only its own format, e.g. ``answer_tag`` for the
``<answer>...</answer>`` convention of DeepSeek-R1 (DeepSeek-AI 2025, arXiv:2501.12948).

:class:`ExtractVerifier` (recipe key ``reward.extract``) puts one of them in front of a task's
verifier: the verifier judges the extracted answer, and a response with nothing to extract is
``invalid`` (never ``wrong``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

_ANSWER_LINE = re.compile(r"(?im)^\s*(?:final\s+)?answer\s*(?:is)?\s*[:=]\s*(.+?)\s*$")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")
_ANSWER_TAG = re.compile(r"(?is)<answer>(.*?)</answer>")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, else ``None``."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1].strip()
    return best


def extract_answer_line(text: str) -> str | None:
    """The value of the last ``answer: ...`` line (case-insensitive), else ``None``."""
    found = _ANSWER_LINE.findall(text)
    return found[-1].strip().rstrip(".") if found else None


def extract_last_number(text: str) -> str | None:
    """The last number (``-12``, ``3.5``, ``1,024``, ``2/3``) with thousands commas removed."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_final_answer(text: str) -> tuple[str | None, str]:
    """``(answer, method)`` with method in ``{"boxed", "answer_line", "last_number", "none"}``."""
    for method, fn in (("boxed", extract_boxed), ("answer_line", extract_answer_line),
                       ("last_number", extract_last_number)):
        got = fn(text)
        if got:
            return got, method
    return None, "none"


def parse_integer(text: str) -> int | None:
    """``int`` of ``text.strip()`` if it is exactly an optionally signed integer, else ``None``."""
    s = text.strip()
    return int(s) if _INTEGER.fullmatch(s) else None


def extract_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` (case-insensitive, may span lines), stripped;
    ``None`` when there is none or it is empty."""
    found = _ANSWER_TAG.findall(text)
    return (found[-1].strip() or None) if found else None


def _auto(text: str) -> str | None:
    return extract_final_answer(text)[0]


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "auto": _auto,
    "last_number": extract_last_number,
    "boxed": extract_boxed,
    "answer_tag": extract_answer_tag,
    "answer_line": extract_answer_line,
}
"""mode -> extractor ``text -> answer | None``."""

EXTRACT_MODES = tuple(EXTRACTORS)


def extract_answer(text: str, mode: str) -> str | None:
    """The answer of ``text`` read by ``mode`` (one of :data:`EXTRACT_MODES`), ``None`` when absent.

    ``last_number`` strips thousands commas (``1,024`` -> ``1024``) and keeps sign, decimals and
    fractions (``-3.5``, ``2/3``); ``boxed`` balances nested braces; ``answer_tag`` takes the last
    tag; an empty extraction is ``None``. ``ValueError`` for an unknown mode.
    """
    if mode not in EXTRACTORS:
        raise ValueError(f"unknown answer extraction {mode!r}; valid: {', '.join(EXTRACT_MODES)}")
    got = EXTRACTORS[mode](text)
    return got if got else None


@dataclasses.dataclass(frozen=True)
class ExtractVerifier:
    """``base`` judging the answer that ``mode`` extracts from the response (``reward.extract``).

    Nothing extracted -> the verdict of ``base`` on an empty response (so the components are the
    base's own, e.g. ``task = 0, format = 0``) with status ``invalid``. Otherwise ``base`` judges
    the extracted text; its verdict is kept, explanation prefixed with what was read. Picklable
    (pool workers); ``version`` names the mode so the ledger's ``name@version`` records it.
    """

    base: Any
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in EXTRACTORS:
            raise ValueError(f"reward.extract: unknown mode {self.mode!r}; valid: {', '.join(EXTRACT_MODES)}")

    @property
    def name(self) -> str:
        """The base verifier's name."""
        return str(self.base.name)

    @property
    def version(self) -> str:
        """Base version + ``extract=<mode>``."""
        return f"{self.base.version}+extract={self.mode}"

    def verify(self, response: str, reference: Any, **context: Any) -> Any:
        """See the class docstring."""
        from posttrain.rewards.verdict import Verdict
        from posttrain.trajectory import Status

        answer = extract_answer(response, self.mode)
        if answer is None:
            empty = self.base.verify("", reference, **context)
            if empty.status is Status.INFRA_ERROR:
                return empty
            comps = {k: 0.0 for k in empty.components} or {"task": 0.0, "format": 0.0}
            return Verdict(Status.INVALID, comps, f"no answer found by extract={self.mode}")
        v = self.base.verify(answer, reference, **context)
        return dataclasses.replace(v, explanation=f"{self.mode}: {answer[:60]!r}; {v.explanation}")


def with_extraction(verifier: Any, mode: str) -> Any:
    """``verifier`` reading answers with ``mode``: its own ``extract`` field when it has one (``math``),
    else an :class:`ExtractVerifier` around it. ``mode='none'`` returns it unchanged."""
    if mode == "none":
        return verifier
    if (dataclasses.is_dataclass(verifier) and not isinstance(verifier, type)
            and any(f.name == "extract" for f in dataclasses.fields(verifier))):
        return dataclasses.replace(verifier, extract=mode)
    return ExtractVerifier(verifier, mode)
