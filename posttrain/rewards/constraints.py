"""Checkers of verifiable instructions: one pure function per constraint family.

The families follow IFEval's verifiable instructions (Zhou et al. 2023, "Instruction-Following
Evaluation for Large Language Models", arXiv:2311.07911), the set Tulu 3 trains on with RLVR
(Lambert et al. 2024, "Tulu 3: Pushing Frontiers in Open Language Model Post-Training",
arXiv:2411.15124). Every checker is ``check(text, **params) -> bool`` over the whole response text;
:data:`CHECKERS` maps a family name to its checker and :func:`check_spec` validates a constraint
spec ``{"family": name, **params}`` before it is ever checked.

Definitions shared by the checkers (unicode-aware):

- a **word** is a maximal run of letters or digits, with inner apostrophes or hyphens kept inside
  it (``don't``, ``well-known``, ``l'eau`` are one word each); punctuation and markup are not words.
- a **sentence** is a stretch of text ended by ``.``, ``!``, ``?`` or ``…`` (a run of them counts
  once) followed by whitespace or the end, or by a line break; only stretches holding a word count
  (``"P.S. Hi."`` is two sentences: abbreviations are not special).
- a **paragraph** is a block of non-blank lines; blocks are separated by one or more blank lines
  (lines of whitespace only; ``\r\n`` line ends too).
- keyword and phrase matches ignore case and must be bounded by non-letters / non-digits (``cat``
  is not in ``cats``; ``light`` is in ``morning-light``).

An empty response satisfies the vacuous constraints (no commas, forbidden words); the verifier
(:mod:`posttrain.rewards.instructions`) rejects an empty response before any checker runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_WORD = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*")
_SENTENCE_END = re.compile(r"[.!?…]+(?=\s|$)|\n")
_BULLET = re.compile(r"^[ \t]*[-*][ \t]+\S", re.MULTILINE)
_NUMBERED = re.compile(r"^[ \t]*\d+[.)][ \t]+\S", re.MULTILINE)
_FENCE = re.compile(r"\A```[ \t]*(?:json)?[ \t]*\n(.*)\n[ \t]*```\Z", re.DOTALL | re.IGNORECASE)
_TITLE = re.compile(r"<<[^<>\n]*[^\W_][^<>\n]*>>")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]*[^\W_][^\[\]\n]*\]")
_POSTSCRIPT = re.compile(r"^[ \t]*P\.S\.", re.MULTILINE)
_COMMAS = (",", "\uff0c", "\u3001", "\u060c")  # ASCII, fullwidth, ideographic, Arabic comma
_QUOTES = (('"', '"'), ("\u201c", "\u201d"))


def words(text: str) -> list[str]:
    """The words of ``text`` (module docstring: letters / digits with inner ``'`` or ``-``)."""
    return _WORD.findall(text)


def count_sentences(text: str) -> int:
    """Sentences of ``text``: stretches between sentence ends (``.!?…`` + space/end, or a line break)
    that hold at least one word."""
    return sum(1 for part in _SENTENCE_END.split(text) if _WORD.search(part))


def count_paragraphs(text: str) -> int:
    """Blocks of non-blank lines separated by blank lines (0 for an empty or blank text)."""
    return sum(1 for block in re.split(r"\n[ \t\r]*\n", text) if block.strip())


def _norm(text: str) -> str:
    """Lower-cased, whitespace collapsed."""
    return " ".join(text.split()).casefold()


def _contains_word(text: str, phrase: str) -> int:
    """How many times ``phrase`` occurs in ``text`` as whole words, ignoring case."""
    pat = r"(?<![^\W_])" + re.escape(_norm(phrase)).replace(r"\ ", r"\s+") + r"(?![^\W_])"
    return len(re.findall(pat, text.casefold()))


def words_at_most(text: str, n: int) -> bool:
    """At most ``n`` words."""
    return len(words(text)) <= n


def words_at_least(text: str, n: int) -> bool:
    """At least ``n`` words."""
    return len(words(text)) >= n


def words_between(text: str, lo: int, hi: int) -> bool:
    """Between ``lo`` and ``hi`` words, both included."""
    return lo <= len(words(text)) <= hi


def sentences_at_most(text: str, n: int) -> bool:
    """At least one and at most ``n`` sentences."""
    return 1 <= count_sentences(text) <= n


def paragraph_count(text: str, n: int) -> bool:
    """Exactly ``n`` paragraphs (blank-line separated blocks)."""
    return count_paragraphs(text) == n


def all_lowercase(text: str) -> bool:
    """Has a letter and no upper-case (or title-case) letter."""
    return any(c.isalpha() for c in text) and text == text.lower()


def all_capitals(text: str) -> bool:
    """Has a letter and no lower-case letter."""
    return any(c.isalpha() for c in text) and text == text.upper()


def include_keywords(text: str, keywords: Sequence[str]) -> bool:
    """Every keyword at least once (whole words, any case)."""
    return all(_contains_word(text, k) >= 1 for k in keywords)


def mentions_any(text: str, words: Sequence[str]) -> bool:
    """At least one of ``words`` (whole words, any case): the implicit "write about the topic" of a
    request, which IFEval leaves unchecked (an off-topic one-liner meets "no commas" as well as an
    answer does)."""
    return any(_contains_word(text, w) for w in words)


def keyword_frequency(text: str, keyword: str, n: int) -> bool:
    """``keyword`` at least ``n`` times (whole words, any case)."""
    return _contains_word(text, keyword) >= n


def forbidden_words(text: str, forbidden: Sequence[str]) -> bool:
    """None of ``forbidden`` as a whole word, in any case."""
    return all(_contains_word(text, w) == 0 for w in forbidden)


def start_with(text: str, phrase: str) -> bool:
    """The response (leading whitespace ignored) starts with ``phrase`` as whole words, any case and
    any spacing: ``Once upon a time,`` starts with ``once upon a time``."""
    got, want = _norm(text), _norm(phrase)
    return got.startswith(want) and not got[len(want):len(want) + 1].isalnum()


def end_with(text: str, phrase: str) -> bool:
    """The response ends with ``phrase`` (its punctuation included), nothing after it but whitespace;
    any case and spacing; the phrase starts a word."""
    got, want = _norm(text), _norm(phrase)
    return got.endswith(want) and not got[:len(got) - len(want)][-1:].isalnum()


def bullet_list(text: str, n: int) -> bool:
    """Exactly ``n`` markdown bullet items: lines starting (after indentation) with ``- `` or ``* ``
    followed by text."""
    return len(_BULLET.findall(text)) == n


def numbered_list(text: str, n: int) -> bool:
    """Exactly ``n`` numbered items: lines starting with ``1.`` / ``2)`` ... and a space, then text."""
    return len(_NUMBERED.findall(text)) == n


def json_keys(text: str, keys: Sequence[str]) -> bool:
    """The whole response (optionally inside one markdown fence, ```` ```json ```` or ```` ``` ````)
    parses as a JSON object holding every key of ``keys`` (more keys are allowed)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and all(k in obj for k in keys)


def quoted(text: str) -> bool:
    """The whole response (outer whitespace ignored) is wrapped in double quotes, straight ``"..."``
    or curly, around some text."""
    body = text.strip()
    return len(body) > 2 and any(body.startswith(a) and body.endswith(b) and body[1:-1].strip()
                                 for a, b in _QUOTES)


def no_commas(text: str) -> bool:
    """No comma: ASCII ``,``, fullwidth, ideographic or Arabic."""
    return not any(c in text for c in _COMMAS)


def title(text: str) -> bool:
    """A title in double angular brackets on one line, holding a letter or digit: ``<<The Sea>>``."""
    return _TITLE.search(text) is not None


def placeholders(text: str, n: int) -> bool:
    """At least ``n`` placeholders: square brackets on one line around a letter or digit, ``[name]``."""
    return len(_PLACEHOLDER.findall(text)) >= n


def postscript(text: str) -> bool:
    """A line starting with ``P.S.`` (after indentation; capitals and dots as written)."""
    return _POSTSCRIPT.search(text) is not None


CHECKERS: Mapping[str, Callable[..., bool]] = {
    f.__name__: f
    for f in (words_at_most, words_at_least, words_between, sentences_at_most, paragraph_count, all_lowercase,
              all_capitals, include_keywords, keyword_frequency, forbidden_words, start_with, end_with,
              bullet_list, numbered_list, json_keys, quoted, no_commas, title, placeholders, postscript,
              mentions_any)
}
"""Family name -> checker ``(text, **params) -> bool``."""

_PARAMS: Mapping[str, Mapping[str, type]] = {
    "words_at_most": {"n": int}, "words_at_least": {"n": int}, "words_between": {"lo": int, "hi": int},
    "sentences_at_most": {"n": int}, "paragraph_count": {"n": int}, "all_lowercase": {}, "all_capitals": {},
    "include_keywords": {"keywords": list}, "keyword_frequency": {"keyword": str, "n": int},
    "forbidden_words": {"forbidden": list}, "start_with": {"phrase": str}, "end_with": {"phrase": str},
    "bullet_list": {"n": int}, "numbered_list": {"n": int}, "json_keys": {"keys": list}, "quoted": {},
    "no_commas": {}, "title": {}, "placeholders": {"n": int}, "postscript": {}, "mentions_any": {"words": list},
}


def check_spec(spec: Any) -> str | None:
    """Why ``spec`` is not a valid constraint (None when it is): a mapping ``{"family": name,
    **params}`` with a family of :data:`CHECKERS` and exactly its parameters, of the right types
    (positive ints; non-empty strings / lists of non-empty strings)."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("family"), str):
        return f"not a constraint spec {{'family': ..., ...}}: {spec!r}"
    fam = spec["family"]
    if fam not in CHECKERS:
        return f"unknown constraint family {fam!r} (valid: {', '.join(CHECKERS)})"
    want = _PARAMS[fam]
    got = {k for k in spec if k != "family"}
    if got != set(want):
        return f"{fam}: parameters {sorted(got)}, expected {sorted(want)}"
    for k, typ in want.items():
        v = spec[k]
        if typ is int and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return f"{fam}.{k} must be a positive int, got {v!r}"
        if typ is str and not (isinstance(v, str) and v.strip()):
            return f"{fam}.{k} must be a non-empty string, got {v!r}"
        if typ is list and not (isinstance(v, list | tuple) and v
                                and all(isinstance(s, str) and s.strip() for s in v)):
            return f"{fam}.{k} must be a non-empty list of non-empty strings, got {v!r}"
    if fam == "words_between" and spec["lo"] > spec["hi"]:
        return f"words_between: lo={spec['lo']} > hi={spec['hi']}"
    return None


def satisfied(text: str, spec: Mapping[str, Any]) -> bool:
    """Whether ``text`` satisfies the (valid, see :func:`check_spec`) constraint ``spec``."""
    params = {k: v for k, v in spec.items() if k != "family"}
    return CHECKERS[str(spec["family"])](text, **params)
