"""``math``: final-answer extraction + equivalence with ``math-verify`` (optional extra ``math``).

Pipeline for a response:
1. Fast path: if the stripped response and reference are both plain integers, compare them.
2. Extract the final answer (:func:`~posttrain.rewards.extract.extract_final_answer`:
   ``\\boxed{}`` > ``answer:`` line > last number). Nothing found -> ``invalid``.
3. ``math_verify.parse`` both sides and ``math_verify.verify(gold, pred)`` (fractions, decimals,
   LaTeX, sets, intervals; Hugging Face 2025, github.com/huggingface/Math-Verify).

math-verify's own timeouts use ``signal.alarm`` which fails outside the main thread, so they are
disabled here (``parsing_timeout=None``, ``timeout_seconds=None``); the time limit is enforced by
:class:`~posttrain.rewards.pool.VerifierPool` (worker-side alarm + host-side kill).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from posttrain.rewards.extract import EXTRACT_MODES, extract_answer, extract_final_answer, parse_integer
from posttrain.rewards.verdict import Verdict
from posttrain.rewards.verifier import VERIFIERS
from posttrain.trajectory import Status


def _wrap(s: str) -> str:
    # math-verify's LaTeX extractor looks for delimited math; a bare extracted answer is wrapped.
    return s if "$" in s or "\\boxed" in s else f"${s}$"


@VERIFIERS.register("math")
@dataclasses.dataclass(frozen=True)
class MathVerifier:
    """Math answer equivalence. ``reference`` is the gold answer as a string or number.

    Components: ``task`` in {0, 1}, ``format`` = 1 iff an answer was extracted.
    ``explanation`` names the extraction method and both parsed values.
    ``extract``: ``auto`` (integer fast path, then ``\\boxed{}`` > ``answer:`` line > last number)
    or one mode of :data:`~posttrain.rewards.extract.EXTRACT_MODES` (only that format counts, no
    fast path); a mode other than ``auto`` is part of ``version`` (``1+extract=boxed``).
    """

    float_rounding: int = 6
    name: str = "math"
    version: str = "1"
    extract: str = "auto"

    def __post_init__(self) -> None:
        if self.extract not in EXTRACT_MODES:
            raise ValueError(f"math verifier: unknown extract {self.extract!r}; valid: {', '.join(EXTRACT_MODES)}")
        base = self.version.split("+extract=")[0]
        object.__setattr__(self, "version", base if self.extract == "auto" else f"{base}+extract={self.extract}")

    def check_reference(self, reference: Any) -> str | None:
        """Why ``reference`` can never be compared (None when it can): math-verify finds no answer in
        it, or only its text and no mathematical object (malformed LaTeX such as ``\\frac{1}{``, which
        would make every verification an ``infra_error`` or a string comparison). Integers pass at once.
        """
        if parse_integer(str(reference)) is not None:
            return None
        gold = self._parse(str(reference))
        if not gold:
            return "math-verify finds no answer in it"
        if isinstance(gold[0], str):
            return "math-verify cannot parse it as math (malformed LaTeX?)"
        return None

    @staticmethod
    def _parse(text: str) -> list[Any]:
        try:
            import math_verify
        except ImportError as e:
            raise ImportError("the 'math' verifier needs math-verify: pip install 'posttrain[math]'") from e
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning is expected
        return list(math_verify.parse(_wrap(text), parsing_timeout=None))

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """See the class docstring."""
        if self.extract == "auto":
            gi, ri = parse_integer(response), parse_integer(str(reference))
            if gi is not None and ri is not None:
                return Verdict(Status.CORRECT if gi == ri else Status.WRONG,
                               {"task": float(gi == ri), "format": 1.0}, f"integer fast path: {gi} vs {ri}")
            answer, method = extract_final_answer(response)
        else:
            answer, method = extract_answer(response, self.extract), self.extract
        if answer is None:
            return Verdict(Status.INVALID, {"task": 0.0, "format": 0.0}, "no final answer found")
        try:
            import math_verify
        except ImportError as e:
            raise ImportError("the 'math' verifier needs math-verify: pip install 'posttrain[math]'") from e
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning is expected
        gold = math_verify.parse(_wrap(str(reference)), parsing_timeout=None)
        pred = math_verify.parse(_wrap(answer), parsing_timeout=None)
        if not pred:
            return Verdict(Status.INVALID, {"task": 0.0, "format": 0.0},
                           f"{method}: {answer[:60]!r} does not parse")
        if not gold:
            raise ValueError(f"math verifier: reference {reference!r} does not parse")
        ok = bool(math_verify.verify(gold, pred, float_rounding=self.float_rounding, timeout_seconds=None))
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok), "format": 1.0},
                       f"{method}: {answer[:60]!r} -> {str(pred[0])[:40]} vs {str(gold[0])[:40]}")
