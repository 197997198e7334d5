"""Final-answer extraction from free text: ``\\boxed{}``, "answer:" lines, last number.

Order of preference (the usual RLVR convention, e.g. Hendrycks et al. 2021 MATH, arXiv:2103.03874
for ``\\boxed``): the last ``\\boxed{...}`` (balanced braces), else the last ``answer: ...`` line,
else the last number in the text.
"""

from __future__ import annotations

import re

_ANSWER_LINE = re.compile(r"(?im)^\s*(?:final\s+)?answer\s*(?:is)?\s*[:=]\s*(.+?)\s*$")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")


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
