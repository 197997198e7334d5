"""``instruction_following``: write about a topic under 1-3 constraints a program checks.

``"Describe how bees make honey. Answer in at most 40 words. Do not use any commas."`` with the
reference ``[{"family": "words_at_most", "n": 40}, {"family": "no_commas"}]``, judged by the
``instructions`` verifier (:mod:`posttrain.rewards.instructions`; per-constraint partial credit,
all satisfied = correct). The constraint families are IFEval's verifiable instructions (Zhou et al.
2023, arXiv:2311.07911), the ones Tulu 3 trains on with RLVR (Lambert et al. 2024, arXiv:2411.15124).

A prompt is composed from a topic, a request wording, and for each constraint a family, its
parameters and one of its wordings (phrasings). Three things are held out, each decided by a hash
of its name (so the same in every run, whatever the seed):

- topics: the quarter of :data:`TOPICS` with the smallest hashes,
- constraint combinations (the sorted set of families): those :func:`~posttrain.envs.task.split_of`
  puts in ``heldout`` at ``combo_heldout_fraction``,
- wordings: for each family (and for the request), the wording with the smallest hash.

Splits: ``train`` = training topics, combinations and wordings; ``heldout`` = the same (in-
distribution) but prompts whose (topic, constraints with parameters) fall in ``heldout`` at
``heldout_fraction``, so never trained on under any wording; ``heldout_unseen`` = held-out topic
*and* held-out combination *and* held-out wordings of the request and every constraint. Prompts
that mix seen and unseen parts are served by no split.

A fourth thing can be held out by name: whole constraint families (``heldout_families``, e.g.
``("json_keys", "all_capitals")``). Then ``train``, ``heldout`` and ``heldout_unseen`` never carry
one of them: they are exactly the splits of ``families`` = the other families (same prompts, ids and
references), so they keep meaning "families seen in training". The split ``heldout_families`` asks
them: every prompt carries at least one held-out family (its first constraint is drawn from them, the
rest from all of ``families``), and everything else is as the in-distribution ``heldout`` split draws
it (training topic, training combination, (topic, constraints) in ``heldout`` at ``heldout_fraction``,
training wordings of the request and of every constraint), so the family is the only part training
never showed; had it been trained, the prompt would be an in-distribution held-out one. (No wording of
a held-out family was trained; drawing its training wordings keeps that counterfactual exact.)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.envs.task import TASKS, TaskExample, split_of
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.rewards.instructions import InstructionsVerifier
from posttrain.rewards.verifier import Verifier

TOPICS = (
    "the water cycle", "a rainy day in a city", "how bees make honey", "the moon", "a walk in the forest",
    "how trains work", "the ocean", "a birthday party", "why we sleep", "volcanoes", "a trip to the market",
    "how plants grow", "the history of bread", "winter mornings", "a lost cat", "how rainbows form",
    "a football match", "the life of a tree", "learning to ride a bike", "the night sky", "a busy kitchen",
    "how a bridge is built", "the desert", "a summer festival", "why leaves change color", "a small village",
    "how computers store data", "the first day of school", "a mountain hike", "the wind", "a library",
    "how fish breathe", "an old lighthouse", "making tea", "a thunderstorm", "how birds migrate",
    "a farm in spring", "the importance of friendship", "a museum visit", "how snow forms", "a quiet beach",
    "the sun", "a city park", "how a letter is delivered", "a street musician", "the life of an ant",
    "a garden at night", "how clocks keep time",
)
"""48 topics; the 12 with the smallest hashes are held out."""

TOPIC_WORDS: Mapping[str, tuple[str, ...]] = {
    "the water cycle": ("water", "cycle", "rain", "evaporation", "clouds"),
    "a rainy day in a city": ("rain", "rainy", "city", "streets", "umbrella", "umbrellas"),
    "how bees make honey": ("bee", "bees", "honey", "nectar", "hive"),
    "the moon": ("moon", "lunar"),
    "a walk in the forest": ("forest", "forests", "walk", "trees", "woods"),
    "how trains work": ("train", "trains", "railway", "rails", "locomotive"),
    "the ocean": ("ocean", "oceans", "sea", "seas", "waves"),
    "a birthday party": ("birthday", "party", "cake", "celebration"),
    "why we sleep": ("sleep", "sleeping", "rest", "dreams", "tired"),
    "volcanoes": ("volcano", "volcanoes", "lava", "magma", "eruption"),
    "a trip to the market": ("market", "markets", "trip", "shopping", "stalls"),
    "how plants grow": ("plant", "plants", "grow", "grows", "growth", "seeds", "roots"),
    "the history of bread": ("bread", "breads", "baking", "wheat", "flour", "history"),
    "winter mornings": ("winter", "morning", "mornings", "snow", "cold", "frost"),
    "a lost cat": ("cat", "cats", "lost", "kitten"),
    "how rainbows form": ("rainbow", "rainbows", "colors", "light"),
    "a football match": ("football", "soccer", "match", "game", "goal", "team"),
    "the life of a tree": ("tree", "trees", "leaves", "roots", "branches"),
    "learning to ride a bike": ("bike", "bicycle", "ride", "riding", "pedal", "pedals"),
    "the night sky": ("night", "sky", "stars", "moon"),
    "a busy kitchen": ("kitchen", "cooking", "chef", "chefs", "cook", "cooks"),
    "how a bridge is built": ("bridge", "bridges", "built", "building", "construction"),
    "the desert": ("desert", "deserts", "sand", "dunes", "cactus"),
    "a summer festival": ("summer", "festival", "festivals", "music"),
    "why leaves change color": ("leaf", "leaves", "color", "colors", "autumn", "fall"),
    "a small village": ("village", "villages", "villagers", "town"),
    "how computers store data": ("computer", "computers", "data", "memory", "storage", "disk"),
    "the first day of school": ("school", "first", "class", "teacher", "students"),
    "a mountain hike": ("mountain", "mountains", "hike", "hiking", "trail", "summit"),
    "the wind": ("wind", "winds", "breeze", "air"),
    "a library": ("library", "libraries", "books", "book", "reading"),
    "how fish breathe": ("fish", "gills", "breathe", "oxygen", "water"),
    "an old lighthouse": ("lighthouse", "lighthouses", "light", "keeper", "ships"),
    "making tea": ("tea", "teas", "kettle", "cup", "brew"),
    "a thunderstorm": ("thunderstorm", "thunderstorms", "thunder", "lightning", "storm", "rain"),
    "how birds migrate": ("bird", "birds", "migrate", "migration", "fly", "flight"),
    "a farm in spring": ("farm", "farms", "farmer", "spring", "animals", "crops"),
    "the importance of friendship": ("friend", "friends", "friendship", "friendships"),
    "a museum visit": ("museum", "museums", "exhibit", "exhibits", "art", "visit"),
    "how snow forms": ("snow", "snowflake", "snowflakes", "ice", "cold"),
    "a quiet beach": ("beach", "beaches", "sand", "waves", "sea", "shore"),
    "the sun": ("sun", "solar", "sunlight", "star"),
    "a city park": ("park", "parks", "city", "trees", "grass"),
    "how a letter is delivered": ("letter", "letters", "mail", "post", "delivered", "delivery", "postman"),
    "a street musician": ("musician", "musicians", "music", "street", "song", "songs", "guitar"),
    "the life of an ant": ("ant", "ants", "colony", "anthill"),
    "a garden at night": ("garden", "gardens", "night", "flowers", "moon"),
    "how clocks keep time": ("clock", "clocks", "time", "hands", "gears", "pendulum"),
}
"""Topic -> words an on-topic answer uses (the topic's own nouns with their inflections, and a few
it cannot be written without); ``on_topic`` requires one of them."""

REQUESTS = ("Write about {topic}.", "Tell me about {topic}.", "Describe {topic}.",
            "Write a short text about {topic}.", "Say something about {topic}.")
"""Request wordings; the one with the smallest hash is held out."""

KEYWORDS = ("nature", "simple", "morning", "light", "friend", "water", "people", "beautiful", "quiet", "time",
            "change", "small")
"""Words a prompt may require (disjoint from :data:`FORBIDDEN`)."""
FORBIDDEN = ("very", "really", "just", "also", "many", "thing", "good", "like")
"""Words a prompt may forbid."""
START_PHRASES = ("Here is", "Once upon a time", "Let me explain", "In short", "Imagine")
END_PHRASES = ("Is there anything else I can help with?", "That is all.", "Thank you for reading.", "The end.")
JSON_KEYS = ("title", "summary", "fact", "reason", "topic", "details")


def _kw(words: Sequence[str]) -> str:
    """``"a"``, ``"a" and "b"``."""
    return " and ".join(f'"{w}"' for w in words)


@dataclasses.dataclass(frozen=True)
class Family:
    """How prompts ask for one constraint family: a parameter sampler and wordings (``str.format``
    templates over the parameters, plus ``{kw}`` = the quoted word list where there is one)."""

    sample: Callable[[random.Random], dict[str, Any]]
    wordings: tuple[str, ...]


FAMILIES: Mapping[str, Family] = {
    "words_at_most": Family(lambda r: {"n": r.choice((30, 40, 50, 60))}, (
        "Answer in at most {n} words.", "Keep your response under {n} words.", "Use no more than {n} words.",
        "Your answer must not be longer than {n} words.", "Limit your reply to {n} words or fewer.")),
    "words_at_least": Family(lambda r: {"n": r.choice((15, 20, 25, 30))}, (
        "Answer in at least {n} words.", "Write no fewer than {n} words.", "Use {n} words or more.",
        "Your response must contain at least {n} words.", "Make your answer {n} words long or longer.")),
    "words_between": Family(lambda r: dict(zip(("lo", "hi"), r.choice(((20, 40), (25, 45), (30, 50), (40, 60))),
                                               strict=True)), (
        "Answer in {lo} to {hi} words.", "Use between {lo} and {hi} words.",
        "Your response should be {lo}-{hi} words long.", "Write at least {lo} and at most {hi} words.")),
    "sentences_at_most": Family(lambda r: {"n": r.choice((2, 3, 4))}, (
        "Answer in at most {n} sentences.", "Use no more than {n} sentences.",
        "Keep it to {n} sentences or fewer.", "Your reply must not have more than {n} sentences.")),
    "paragraph_count": Family(lambda r: {"n": r.choice((2, 3))}, (
        "Write exactly {n} paragraphs separated by a blank line.",
        "Your answer must have {n} paragraphs, with an empty line between them.",
        "Split your response into {n} paragraphs separated by blank lines.",
        "Use {n} paragraphs and put a blank line between paragraphs.")),
    "all_lowercase": Family(lambda r: {}, (
        "Write everything in lowercase letters.", "Do not use any capital letters.",
        "Your entire response must be in lowercase.", "Use only lowercase letters, no capitals at all.")),
    "all_capitals": Family(lambda r: {}, (
        "Write everything in capital letters.", "Your entire response must be in uppercase.",
        "Use only capital letters.", "Answer in all caps, with no lowercase letters.")),
    "include_keywords": Family(lambda r: {"keywords": r.sample(KEYWORDS, r.choice((1, 2)))}, (
        "Include the words {kw}.", "Make sure to use the words {kw}.", "Your answer must contain {kw}.",
        "Mention {kw} somewhere in your answer.")),
    "keyword_frequency": Family(lambda r: {"keyword": r.choice(KEYWORDS), "n": r.choice((2, 3))}, (
        'Use the word "{keyword}" at least {n} times.', 'The word "{keyword}" should appear {n} times or more.',
        'Repeat the word "{keyword}" at least {n} times.', 'Say "{keyword}" no fewer than {n} times.')),
    "forbidden_words": Family(lambda r: {"forbidden": r.sample(FORBIDDEN, r.choice((1, 2)))}, (
        "Do not use the words {kw}.", "Avoid the words {kw}.", "Never write the words {kw}.",
        "Your answer must not contain {kw}.")),
    "start_with": Family(lambda r: {"phrase": r.choice(START_PHRASES)}, (
        'Start your answer with "{phrase}".', 'Begin your response with the words "{phrase}".',
        'The first words of your answer must be "{phrase}".', 'Open your reply with "{phrase}".')),
    "end_with": Family(lambda r: {"phrase": r.choice(END_PHRASES)}, (
        'End your answer with "{phrase}".', 'Finish your response with the exact phrase "{phrase}".',
        'The last words of your answer must be "{phrase}".', 'Close your reply with "{phrase}" and nothing after it.')),
    "bullet_list": Family(lambda r: {"n": r.choice((2, 3, 4))}, (
        "Answer with exactly {n} bullet points, each starting with \"- \".",
        "Use a bullet list of {n} items (lines starting with \"- \").",
        "Give exactly {n} bullet points in markdown, like \"- first point\".",
        "Format your answer as {n} markdown bullets (\"* \" or \"- \").")),
    "numbered_list": Family(lambda r: {"n": r.choice((2, 3, 4))}, (
        "Answer with a numbered list of exactly {n} items (1., 2., ...).",
        "Give {n} numbered points, like \"1. ...\".",
        "Write your answer as a list numbered from 1 to {n}.",
        "Use exactly {n} numbered items.")),
    "json_keys": Family(lambda r: {"keys": r.sample(JSON_KEYS, 2)}, (
        "Answer with a JSON object that has the keys {kw}.", "Format your whole response as JSON with keys {kw}.",
        "Reply only with a JSON object containing the keys {kw}.",
        "Your output must be valid JSON, an object with the fields {kw}.")),
    "quoted": Family(lambda r: {}, (
        "Wrap your entire response in double quotation marks.", "Put your whole answer inside double quotes.",
        "Your response must start and end with a double quote (\").",
        "Enclose everything you write in double quotation marks.")),
    "no_commas": Family(lambda r: {}, (
        "Do not use any commas.", "Your answer must not contain a single comma.", "Write without commas.",
        "Avoid commas completely.")),
    "title": Family(lambda r: {}, (
        "Give your answer a title wrapped in double angular brackets, such as <<my title>>.",
        "Include a title in double angle brackets, like <<title>>.",
        "Start with a title written as <<title>>.", "Add a title surrounded by << and >>.")),
    "placeholders": Family(lambda r: {"n": r.choice((2, 3))}, (
        "Include at least {n} placeholders in square brackets, such as [name].",
        "Use {n} or more placeholders written like [address].",
        "Your answer must contain at least {n} placeholders in square brackets.",
        "Leave at least {n} blanks written as placeholders, for example [date].")),
    "postscript": Family(lambda r: {}, (
        "At the end of your response, add a postscript starting with P.S.",
        "Finish with a postscript that begins with \"P.S.\".", "Add a P.S. at the end.",
        "End your reply with a note starting with P.S.")),
}
"""Family -> parameter sampler and wordings (>= 4 each: one held out)."""

EXCLUSIVE = (
    {"words_at_most", "words_at_least", "words_between"},
    {"all_lowercase", "all_capitals"},
    {"bullet_list", "numbered_list", "json_keys", "paragraph_count", "sentences_at_most"},
    {"quoted", "start_with", "json_keys"},
    {"quoted", "end_with", "postscript", "json_keys"},
    {"json_keys", "title", "placeholders", "no_commas", "all_capitals", "postscript"},
    {"quoted", "bullet_list", "numbered_list"},
    {"all_lowercase", "postscript"},
    {"sentences_at_most", "postscript", "title"},
)
"""At most one family of each set per prompt: the rest could not (or only awkwardly) hold together
(JSON needs commas and its keys' case; a quote before the first word breaks "start with"; "P.S."
is capitals; a title line and a P.S. count as sentences). Word counts (<= 60) leave room for the
lists (<= 4 items); required and forbidden words come from disjoint pools."""


def compatible(families: Sequence[str]) -> bool:
    """No two of ``families`` in one :data:`EXCLUSIVE` set (and no family twice)."""
    return len(set(families)) == len(families) and all(len(group.intersection(families)) <= 1
                                                       for group in EXCLUSIVE)


def can_hold(pool: Sequence[str], k: int, carrying: Sequence[str] = ()) -> bool:
    """Whether some :func:`compatible` set of ``k`` families of ``pool`` includes one of ``carrying``
    (``carrying`` empty: any such set)."""
    return any(compatible(c) and (not carrying or set(c) & set(carrying))
               for c in itertools.combinations(pool, k))


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


@functools.cache
def heldout_topics() -> frozenset[str]:
    """The quarter of :data:`TOPICS` with the smallest hashes."""
    return frozenset(sorted(TOPICS, key=lambda t: _hash(f"instruction_following|topic|{t}"))[:len(TOPICS) // 4])


def heldout_wording(family: str) -> int:
    """Index of the held-out wording of ``family`` (``"request"`` for :data:`REQUESTS`): smallest hash."""
    wordings = REQUESTS if family == "request" else FAMILIES[family].wordings
    return min(range(len(wordings)), key=lambda i: _hash(f"instruction_following|wording|{family}|{wordings[i]}"))


def combo_key(families: Sequence[str]) -> str:
    """The canonical combination key: sorted family names joined by ``+``."""
    return "+".join(sorted(families))


def _render(family: str, spec: Mapping[str, Any], wording: int) -> str:
    params = {k: v for k, v in spec.items() if k != "family"}
    words = params.get("keywords", params.get("forbidden", params.get("keys")))
    return FAMILIES[family].wordings[wording].format(**params, kw=_kw(words) if words else "")


@dataclasses.dataclass(frozen=True)
class InstructionFollowingTask:
    """Prompts of 1..``max_constraints`` constraints (``min_constraints`` at least), uniform count.

    ``families`` restricts the constraint families (default: all of :data:`FAMILIES`).
    ``train_max_constraints`` caps the count of the ``train`` split alone (a curriculum: a policy that
    meets one or two constraints gets a signal from more of its groups), leaving both held-out splits
    exactly as without it; ``None`` = ``max_constraints``.
    ``on_topic`` adds to every prompt's reference (every split) the implicit constraint of its request,
    ``{"family": "mentions_any", "words": TOPIC_WORDS[topic]}``: the answer must mention the topic.
    IFEval checks only the explicit constraints, so an off-topic one-liner ("Sabotage.") meets "no
    commas" and "at most 40 words"; a policy trained on that verdict learns to say nothing. The
    prompts (texts, ids, splits) are the same with and without it; only the references differ.
    ``heldout_families`` (a subset of ``families``) keeps whole families out of ``train``, ``heldout``
    and ``heldout_unseen`` (those become the splits of ``families`` minus them) and offers the split
    ``heldout_families``: prompts carrying at least one of them, otherwise in-distribution (module
    docstring). Empty (the default): every split exactly as without the knob.
    """

    min_constraints: int = 1
    max_constraints: int = 3
    train_max_constraints: int | None = None
    on_topic: bool = False
    families: tuple[str, ...] | list[str] = tuple(FAMILIES)
    heldout_families: tuple[str, ...] | list[str] = ()
    heldout_fraction: float = 0.2
    combo_heldout_fraction: float = 0.25
    verifier: Verifier = dataclasses.field(default_factory=InstructionsVerifier)
    name: str = "instruction_following"
    eval_splits: tuple[str, ...] = ("heldout", "heldout_unseen")

    def __post_init__(self) -> None:
        fams = tuple(self.families)
        object.__setattr__(self, "families", fams)
        bad = [f for f in fams if f not in FAMILIES]
        if not fams or bad or len(set(fams)) != len(fams):
            raise ValueError(f"instruction_following: families must be distinct names of {list(FAMILIES)}, "
                             f"got {list(fams)}")
        held = tuple(self.heldout_families)
        object.__setattr__(self, "heldout_families", held)
        bad = [f for f in held if f not in fams]
        if bad or len(set(held)) != len(held):
            what = f"{bad[0]!r} is not one of" if bad else f"{list(held)} names a family twice; give distinct"
            raise ValueError(f"instruction_following: heldout_families: {what} families {list(fams)}")
        splits = tuple(self.eval_splits)
        object.__setattr__(self, "eval_splits", splits)
        valid = ("heldout", "heldout_unseen", *(("heldout_families",) if held else ()))
        if not splits or not set(splits) <= set(valid):
            need = "" if held else " (heldout_families needs the task kwarg heldout_families)"
            raise ValueError(f"instruction_following: eval_splits must be a non-empty subset of "
                             f"{', '.join(valid)}; got {list(splits)}{need}")
        if not 1 <= self.min_constraints <= self.max_constraints <= 3:
            raise ValueError(f"instruction_following: need 1 <= min_constraints <= max_constraints <= 3, got "
                             f"{self.min_constraints}, {self.max_constraints}")
        if held:
            trained = self._trained()
            if not trained:
                raise ValueError(f"instruction_following: heldout_families {list(held)} hold out every family of "
                                 f"families, leaving the train split none to draw; hold out fewer")
            if not can_hold(trained, self.min_constraints):
                raise ValueError(f"instruction_following: heldout_families {list(held)} leave the train split "
                                 f"only {list(trained)}, which cannot hold min_constraints={self.min_constraints} "
                                 f"together; hold out fewer families")
            alone = [f for f in held if not can_hold(fams, self.min_constraints, (f,))]
            if alone:
                raise ValueError(f"instruction_following: held-out family {alone[0]!r} fits in no compatible "
                                 f"set of min_constraints={self.min_constraints} families of {list(fams)}")
        if self.train_max_constraints is not None and not (
                self.min_constraints <= self.train_max_constraints <= self.max_constraints):
            raise ValueError(f"instruction_following: need min_constraints <= train_max_constraints <= "
                             f"max_constraints, got {self.min_constraints} <= {self.train_max_constraints} <= "
                             f"{self.max_constraints}")
        for name, f in (("heldout_fraction", self.heldout_fraction),
                        ("combo_heldout_fraction", self.combo_heldout_fraction)):
            if not 0.0 < f < 1.0:
                raise ValueError(f"instruction_following: {name} must be in (0, 1), got {f}")

    def _max_count(self, split: str) -> int:
        """The most constraints a prompt of ``split`` carries."""
        if split == "train" and self.train_max_constraints is not None:
            return self.train_max_constraints
        return self.max_constraints

    def _trained(self) -> tuple[str, ...]:
        """The families training sees: ``families`` without ``heldout_families``, in order."""
        return tuple(f for f in self.families if f not in self.heldout_families)

    def _families(self, rng: random.Random, max_count: int, pool: Sequence[str],
                   first: Sequence[str] = ()) -> list[str]:
        """A uniform count in ``[min_constraints, max_count]``, then a family of ``first`` (when given)
        and compatible ones of ``pool`` one at a time; fewer when none fits."""
        k = rng.randint(self.min_constraints, max_count)
        chosen: list[str] = [rng.choice(first)] if first else []
        while len(chosen) < k:
            options = [f for f in pool if compatible([*chosen, f])]
            if not options:
                break
            chosen.append(rng.choice(options))
        return sorted(chosen)

    def _draw(self, rng: random.Random, split: str) -> tuple[str, TaskExample] | None:
        """One proposal: ``(problem key, example)``, or None when it belongs to no part of ``split``."""
        unseen = split == "heldout_unseen"
        if split == "heldout_families":  # a held-out family first, then any; the rest as in ``heldout``
            fams = self._families(rng, self._max_count(split), self.families, self.heldout_families)
            surface = "heldout"
        else:
            fams = self._families(rng, self._max_count(split), self._trained())
            surface = split
        if len(fams) < self.min_constraints:  # the allowed families cannot hold that many together
            return None
        combo = combo_key(fams)
        if (split_of(f"{self.name}|combo|{combo}", self.combo_heldout_fraction) == "heldout") != unseen:
            return None
        held = heldout_topics()
        topic = rng.choice(sorted(held) if unseen else [t for t in TOPICS if t not in held])
        specs = [{"family": f, **FAMILIES[f].sample(rng)} for f in fams]
        key = json.dumps([topic, specs], sort_keys=True)
        if not unseen and split_of(f"{self.name}|{key}", self.heldout_fraction) != surface:
            return None

        def wording(family: str, n: int) -> int:
            out = heldout_wording(family)
            return out if unseen else rng.choice([i for i in range(n) if i != out])

        req = wording("request", len(REQUESTS))
        ids = [wording(f, len(FAMILIES[f].wordings)) for f in fams]
        order = list(range(len(fams)))
        rng.shuffle(order)
        text = " ".join([REQUESTS[req].format(topic=topic), *(_render(fams[i], specs[i], ids[i]) for i in order)])
        implicit = [{"family": "mentions_any", "words": list(TOPIC_WORDS[topic])}] if self.on_topic else []
        reference = json.dumps(specs + implicit, sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        parts = "+".join(f"{fams[i]}.w{ids[i]}" for i in order)
        ex = TaskExample(
            prompt_id=f"{self.name}/t{TOPICS.index(topic):02d}.r{req}/{parts}/{digest}", prompt=text,
            reference=reference,
            meta={"topic": topic, "constraints": reference, "combo": combo, "n_constraints": len(fams)})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` distinct prompts of ``split`` (``train`` | ``heldout`` | ``heldout_unseen`` |
        ``heldout_families`` when listed in ``eval_splits``, module docstring); deterministic in
        ``(split, n, seed)`` and the knobs. ``train``, ``heldout`` and ``heldout_unseen`` under
        ``heldout_families`` are those of ``families`` = the other families (the same stream)."""
        if split not in ("train", *self.eval_splits):
            raise ValueError(f"unknown split {split!r}; valid: train, {', '.join(self.eval_splits)}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        counts = f"{self.min_constraints}:{self.max_constraints}"
        if self._max_count(split) != self.max_constraints:  # only the train split's stream moves with the cap
            counts += f":train{self._max_count(split)}"
        if split == "heldout_families":
            fams = f"{','.join(self.families)}|held:{','.join(self.heldout_families)}"
        else:
            fams = ",".join(self._trained())
        rng = random.Random(f"{self.name}|{counts}:{fams}|{split}|{seed}")
        out: list[TaskExample] = []
        seen: set[str] = set()
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 1000 * max(n, 1):
                raise ValueError(f"task {self.name!r}: only {len(out)} distinct prompts of split {split!r} found "
                                 f"for n={n}; allow more families or constraints")
            got = self._draw(rng, split)
            if got is None or got[0] in seen:
                continue
            seen.add(got[0])
            out.append(got[1])
        return out


@TASKS.register("instruction_following")
def instruction_following(**kwargs: object) -> InstructionFollowingTask:
    """Factory of :class:`InstructionFollowingTask` (kwargs: ``min_constraints``, ``max_constraints``,
    ``train_max_constraints``, ``on_topic``, ``families``, ``heldout_families``, ``heldout_fraction``,
    ``combo_heldout_fraction``, ``eval_splits``)."""
    return build_with_typed_kwargs(InstructionFollowingTask, kwargs, what="task 'instruction_following'")
