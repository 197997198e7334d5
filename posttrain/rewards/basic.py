"""Cheap string verifiers: ``integer`` (the demo's fast path), ``exact``, ``regex``, ``choice``,
``format`` and ``combine`` (several verifiers, components merged).

Status convention of every built-in verifier: ``invalid`` = no answer could be read from the
response (a format failure, ``format = 0``); ``wrong`` = an answer was read and it is not the
reference; ``correct`` otherwise. Components: ``task`` in {0, 1} and ``format`` in {0, 1}.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from posttrain.rewards.extract import parse_integer
from posttrain.rewards.verdict import Verdict
from posttrain.rewards.verifier import VERIFIERS, Verifier
from posttrain.trajectory import Status


def _ok(ok: bool, why: str) -> Verdict:
    return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok), "format": 1.0}, why)


def _invalid(why: str) -> Verdict:
    return Verdict(Status.INVALID, {"task": 0.0, "format": 0.0}, why)


@VERIFIERS.register("integer")
@dataclasses.dataclass(frozen=True)
class IntegerVerifier:
    """The response, stripped of whitespace, must be exactly an integer equal to ``int(reference)``.

    No extraction, no sympy: ~1 µs per call, used by the arithmetic tasks in the training loop.
    """

    name: str = "integer"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """``correct`` iff ``int(response.strip()) == int(reference)``; non-integer -> ``invalid``."""
        got = parse_integer(response)
        if got is None:
            return _invalid(f"not an integer: {response.strip()[:40]!r}")
        want = int(reference)
        return _ok(got == want, f"got {got}, expected {want}")

    def check_reference(self, reference: Any) -> str | None:
        """Why ``int(reference)`` fails (None when it works): checked at load, see ``envs.task.check_references``."""
        try:
            int(reference)
        except (TypeError, ValueError):
            return "not an integer"
        return None


@VERIFIERS.register("exact")
@dataclasses.dataclass(frozen=True)
class ExactVerifier:
    """String equality after ``strip()`` (and optional case folding / whitespace collapsing).

    ``reference`` may be a string or a sequence of acceptable strings. An empty response is
    ``invalid``.
    """

    casefold: bool = False
    collapse_whitespace: bool = True
    name: str = "exact"
    version: str = "1"

    def _norm(self, s: str) -> str:
        s = s.strip()
        if self.collapse_whitespace:
            s = " ".join(s.split())
        return s.casefold() if self.casefold else s

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """``correct`` iff the normalised response equals a normalised reference."""
        got = self._norm(response)
        if not got:
            return _invalid("empty response")
        refs = [reference] if isinstance(reference, str) else list(reference)
        return _ok(got in {self._norm(str(r)) for r in refs}, f"got {got[:60]!r}, expected {refs!r}"[:200])


@VERIFIERS.register("regex")
@dataclasses.dataclass(frozen=True)
class RegexVerifier:
    """Regex verification in two modes.

    - ``pattern`` given: the *last* match of ``pattern`` in the response is the answer (group
      ``group``), compared to ``str(reference)`` after ``strip()``; no match -> ``invalid``.
    - ``pattern`` is ``None``: ``reference`` is itself a regex the stripped response must
      ``fullmatch``.
    """

    pattern: str | None = None
    group: int = 1
    flags: int = 0
    name: str = "regex"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """See the class docstring."""
        if self.pattern is None:
            ok = re.fullmatch(str(reference), response.strip(), self.flags) is not None
            return _ok(ok, f"fullmatch of {str(reference)!r}: {ok}")
        matches = list(re.finditer(self.pattern, response, self.flags))
        if not matches:
            return _invalid(f"no match of {self.pattern!r}")
        got = matches[-1].group(self.group).strip()
        return _ok(got == str(reference).strip(), f"got {got!r}, expected {str(reference)!r}")


@VERIFIERS.register("choice")
@dataclasses.dataclass(frozen=True)
class ChoiceVerifier:
    """Multiple choice: reads one option letter from ``choices`` and compares it to ``reference``.

    The letter is, in order: the whole stripped response (``"B"``, ``"(B)"``, ``"B."``), the
    value of an ``answer: B`` line, else the last standalone option letter. Case-insensitive.
    """

    choices: str = "ABCD"
    name: str = "choice"
    version: str = "1"

    def _read(self, response: str) -> str | None:
        letters = re.escape(self.choices.upper())
        s = response.strip().upper()
        m = re.fullmatch(rf"\(?([{letters}])[).:]?", s)
        if m:
            return m.group(1)
        m2 = re.findall(rf"ANSWER\s*(?:IS)?\s*[:=]?\s*\(?([{letters}])\b", s)
        if m2:
            return str(m2[-1])
        m3 = re.findall(rf"\b([{letters}])\b", s)
        return str(m3[-1]) if m3 else None

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """``correct`` iff the read letter equals ``str(reference).upper()``."""
        got = self._read(response)
        if got is None:
            return _invalid(f"no option among {self.choices!r}")
        want = str(reference).strip().upper()
        return _ok(got == want, f"chose {got}, expected {want}")


@VERIFIERS.register("format")
@dataclasses.dataclass(frozen=True)
class FormatVerifier:
    """Format only: ``format = 1`` iff the stripped response ``fullmatch``-es ``pattern``.

    Status ``correct`` when it matches and ``invalid`` otherwise; ``reference`` is ignored.
    Combine it with a task verifier through ``combine`` to get both components.
    """

    pattern: str = r"[+-]?\d+"
    flags: int = re.DOTALL
    name: str = "format"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """See the class docstring."""
        ok = re.fullmatch(self.pattern, response.strip(), self.flags) is not None
        return Verdict(Status.CORRECT if ok else Status.INVALID, {"format": float(ok)},
                       f"format {self.pattern!r}: {'ok' if ok else 'no match'}")


@VERIFIERS.register("combine")
@dataclasses.dataclass(frozen=True)
class CombinedVerifier:
    """Runs ``verifiers`` in order; the first gives the status, later ones add components.

    A component name produced by two verifiers keeps the first one's value (the primary
    verifier decides). If any verifier returns ``infra_error`` the combined verdict is
    ``infra_error``. ``version`` joins the parts' ``name@version``.
    """

    verifiers: Sequence[Verifier] = ()
    name: str = "combine"

    def __post_init__(self) -> None:
        if not self.verifiers:
            raise ValueError("combine: needs at least one verifier")
        object.__setattr__(self, "verifiers", tuple(self.verifiers))

    @property
    def version(self) -> str:
        """``"a@1+b@2"`` of the parts."""
        return "+".join(f"{v.name}@{v.version}".replace("@", "-") for v in self.verifiers)

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """See the class docstring."""
        verdicts = [v.verify(response, reference, **context) for v in self.verifiers]
        for v in verdicts:
            if v.status is Status.INFRA_ERROR:
                return v
        comps: dict[str, float] = {}
        for v in verdicts:
            for k, x in v.components.items():
                comps.setdefault(k, x)
        return Verdict(verdicts[0].status, comps, " | ".join(v.explanation for v in verdicts))
