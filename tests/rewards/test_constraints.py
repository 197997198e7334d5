"""Every constraint checker of posttrain/rewards/constraints.py on hand cases, edges included
(empty response, trailing whitespace, unicode punctuation, markdown fences), and the verifier."""

from __future__ import annotations

import json

import pytest

from posttrain.rewards import build_verifier
from posttrain.rewards import constraints as c
from posttrain.rewards.instructions import InstructionsVerifier
from posttrain.trajectory import Status


@pytest.mark.parametrize(("text", "n"), [
    ("", 0), ("   \n ", 0), ("Hello, world!", 2), ("don't stop — well-known l'eau", 4), ("e-mail: a@b.c", 4),
    ("Café naïve 42 times", 4), ("- one\n- two", 2), ("**bold** _it_", 2), ("«Bonjour», dit-il…", 2),
])
def test_words_counts_letters_and_digits_with_inner_apostrophes_and_hyphens(text: str, n: int) -> None:
    assert len(c.words(text)) == n


def test_word_count_families() -> None:
    five = "one two three four five  \n"
    assert c.words_at_most(five, 5) and not c.words_at_most(five, 4)
    assert c.words_at_least(five, 5) and not c.words_at_least(five, 6)
    assert c.words_between(five, 5, 5) and c.words_between(five, 2, 9) and not c.words_between(five, 6, 9)
    assert c.words_at_most("", 3) and not c.words_at_least("", 1)


@pytest.mark.parametrize(("text", "n"), [
    ("", 0), ("One. Two! Three?", 3), ("Wait... what?!", 2), ("No end mark", 1), ("Pi is 3.14 exactly.", 1),
    ("Line one\nLine two\n\nLine three.", 3), ("Unicode ellipsis… next。", 2), ("P.S. Hi.", 2), ("...", 0),
    ("Trailing space.   ", 1), ("- item one\n- item two", 2),
])
def test_count_sentences(text: str, n: int) -> None:
    assert c.count_sentences(text) == n


def test_sentences_at_most_needs_one_sentence() -> None:
    assert c.sentences_at_most("A. B. C.", 3) and not c.sentences_at_most("A. B. C. D.", 3)
    assert not c.sentences_at_most("", 3)


@pytest.mark.parametrize(("text", "n"), [
    ("", 0), ("one block\nstill one", 1), ("a\n\nb", 2), ("a\n   \n\n\tb\n\n", 2), ("\n\na\n\nb\n\nc\n", 3),
    ("a\r\n\r\nb", 2),
])
def test_count_paragraphs(text: str, n: int) -> None:
    assert c.count_paragraphs(text) == n
    assert c.paragraph_count(text, n) and not c.paragraph_count(text, n + 1)


def test_case_families() -> None:
    assert c.all_lowercase("hello, world 42!") and not c.all_lowercase("Hello")
    assert c.all_lowercase("été à paris") and not c.all_lowercase("ÉTÉ")
    assert not c.all_lowercase("") and not c.all_lowercase("123 ...")
    assert c.all_capitals("HELLO, WORLD 42!") and not c.all_capitals("HELLo")
    assert not c.all_capitals("") and not c.all_capitals("42")


def test_keywords_whole_words_any_case() -> None:
    text = "The Light was light; lights were lit. Morning-light too."
    assert c.include_keywords(text, ["light"]) and c.include_keywords(text, ["LIGHT", "morning"])
    assert not c.include_keywords(text, ["lit", "dark"]) and not c.include_keywords("lights", ["light"])
    assert c.keyword_frequency(text, "light", 3) and not c.keyword_frequency(text, "light", 4)
    assert c.include_keywords("a  quiet\nmorning", ["quiet morning"])


def test_mentions_any_one_of_the_words() -> None:
    assert c.mentions_any("Bees fly from flower to flower.", ["bee", "bees", "honey"])
    assert c.mentions_any("It is sweet HONEY.", ["bees", "honey"])
    assert not c.mentions_any("Sabotage.", ["festival", "summer"])
    assert not c.mentions_any("beehives hum", ["bee", "bees"])  # whole words only
    assert c.check_spec({"family": "mentions_any", "words": ["moon"]}) is None
    assert "non-empty list" in str(c.check_spec({"family": "mentions_any", "words": []}))


def test_forbidden_words() -> None:
    assert c.forbidden_words("It is quite nice.", ["very", "really"])
    assert not c.forbidden_words("It is VERY nice.", ["very"])
    assert c.forbidden_words("everyone justly", ["very", "just"])  # inside other words: allowed
    assert c.forbidden_words("", ["very"])  # vacuous (the verifier refuses empty responses)


def test_start_and_end_with() -> None:
    assert c.start_with("  once upon  a time, a cat.", "Once upon a time")
    assert not c.start_with("Once upon a timeless cat.", "Once upon a time")
    assert not c.start_with('"Once upon a time"', "Once upon a time")
    assert c.end_with("Bees make honey. That is all.  \n", "That is all.")
    assert not c.end_with("That is all. Bye.", "That is all.")
    assert not c.end_with("That is all", "That is all.")
    assert c.end_with("Call the end.", "The end.")  # the phrase starts a word: ok
    assert not c.end_with("Legend.", "end.")
    assert not c.start_with("", "Here is") and not c.end_with("", "The end.")


def test_lists() -> None:
    bullets = "Intro:\n- one\n* two\n  - nested three\n-not a bullet\n**bold** line\n- "
    assert c.bullet_list(bullets, 3) and not c.bullet_list(bullets, 4)
    numbered = "1. a\n2) b\n 3. c\n4.no space\n10. d"
    assert c.numbered_list(numbered, 4) and not c.numbered_list(numbered, 5)
    assert c.bullet_list("", 0) is True and not c.numbered_list("", 1)


def test_json_keys() -> None:
    assert c.json_keys('{"title": "x", "fact": 1, "more": null}', ["title", "fact"])
    assert c.json_keys('```json\n{"title": "x", "fact": 1}\n```\n', ["title", "fact"])
    assert c.json_keys('```\n{"title": "x"}\n```', ["title"])
    assert not c.json_keys('{"title": "x"}', ["title", "fact"])
    assert not c.json_keys('Here: {"title": "x"}', ["title"])
    assert not c.json_keys('["title"]', ["title"]) and not c.json_keys("", ["title"])
    assert not c.json_keys('{"title": "x",}', ["title"])


def test_quoted() -> None:
    assert c.quoted('  "Bees make honey."\n') and c.quoted("\u201cBees make honey.\u201d")
    assert not c.quoted('"Bees" make honey.') and not c.quoted('""') and not c.quoted('"  "')
    assert not c.quoted("") and not c.quoted('"')


def test_no_commas() -> None:
    assert c.no_commas("No commas here. None!") and c.no_commas("")
    for comma in (",", "\uff0c", "\u3001", "\u060c"):
        assert not c.no_commas(f"a{comma} b")


def test_title_placeholders_postscript() -> None:
    assert c.title("<<The Sea>>\nWaves.") and not c.title("<< >>") and not c.title("<<a\nb>>")
    assert not c.title("<The Sea>") and not c.title("")
    assert c.placeholders("Dear [name], at [address].", 2) and not c.placeholders("Dear [name], [ ].", 2)
    assert not c.placeholders("[a\nb] [c]", 2) and not c.placeholders("", 1)
    assert c.postscript("Hi.\n\nP.S. Bye.") and c.postscript("Hi.\n  P.S. Bye.")
    assert not c.postscript("Hi. P.S. Bye.") and not c.postscript("Hi.\np.s. bye") and not c.postscript("")


def test_check_spec() -> None:
    assert c.check_spec({"family": "words_at_most", "n": 40}) is None
    assert c.check_spec({"family": "no_commas"}) is None
    assert "unknown constraint family" in str(c.check_spec({"family": "haiku"}))
    assert "parameters" in str(c.check_spec({"family": "words_at_most"}))
    assert "positive int" in str(c.check_spec({"family": "words_at_most", "n": 0}))
    assert "positive int" in str(c.check_spec({"family": "bullet_list", "n": True}))
    assert "non-empty list" in str(c.check_spec({"family": "include_keywords", "keywords": []}))
    assert "lo=5 > hi=3" in str(c.check_spec({"family": "words_between", "lo": 5, "hi": 3}))
    assert "not a constraint spec" in str(c.check_spec(["words_at_most"]))
    assert c.satisfied("a b c", {"family": "words_between", "lo": 2, "hi": 3})


def _ref(*specs: dict[str, object]) -> str:
    return json.dumps(list(specs))


def test_verifier_partial_credit_and_verdict() -> None:
    v = build_verifier("instructions")
    ref = _ref({"family": "all_lowercase"}, {"family": "no_commas"}, {"family": "words_at_most", "n": 4})
    ok = v.verify("bees make honey.", ref)
    assert ok.status is Status.CORRECT
    assert ok.components == {"task": 1.0, "ifc_mean": 1.0, "ifc/all_lowercase": 1.0, "ifc/no_commas": 1.0,
                             "ifc/words_at_most": 1.0}
    two = v.verify("Bees, they do make honey.", ref)
    assert two.status is Status.WRONG
    assert two.components == {"task": 0.0, "ifc_mean": 0.0, "ifc/all_lowercase": 0.0, "ifc/no_commas": 0.0,
                              "ifc/words_at_most": 0.0}
    one = v.verify("bees, make honey.", ref)
    assert one.components["ifc_mean"] == pytest.approx(2 / 3) and one.components["ifc/no_commas"] == 0.0
    assert "failed: no_commas" in one.explanation


def test_verifier_empty_response_is_invalid_with_zeros() -> None:
    v = build_verifier("instructions")
    got = v.verify("  \n", _ref({"family": "no_commas"}))
    assert got.status is Status.INVALID
    assert got.components == {"task": 0.0, "ifc_mean": 0.0, "ifc/no_commas": 0.0}


def test_verifier_reference_is_checked() -> None:
    v = InstructionsVerifier()
    assert v.check_reference(_ref({"family": "quoted"})) is None
    assert v.check_reference([{"family": "quoted"}]) is None
    assert "non-empty list" in str(v.check_reference("[]"))
    assert "twice" in str(v.check_reference(_ref({"family": "quoted"}, {"family": "quoted"})))
    assert "unknown constraint family" in str(v.check_reference(_ref({"family": "sonnet"})))
    assert v.check_reference("not json") is not None
    with pytest.raises(ValueError, match="unknown constraint family"):
        v.verify("text", _ref({"family": "sonnet"}))
