"""Single-turn tasks: a prompt source plus a verifier, and the ``TASKS`` registry.

A task hands out :class:`TaskExample` objects deterministically by ``(split, n, seed)``; the
``train`` and ``heldout`` splits are disjoint *by problem* (a hash of the problem's canonical
key decides its split, so no held-out problem is ever trained on, whatever the seed). A task whose
problems come in phrasing families (``word_problems`` with ``phrasings="families"``) also offers
``heldout_unseen``; a task names the held-out sets it offers in an optional ``eval_splits``
attribute (absent: :data:`DEFAULT_EVAL_SPLITS`), each fetched with ``examples(split, n, seed)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from posttrain.algos.registry import Registry
from posttrain.rewards.verifier import Verifier, build_verifier
from posttrain.trajectory.record import JSONScalar

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

TASKS = Registry("task")
"""name -> factory(**kwargs) returning a :class:`Task`."""

SPLITS = ("train", "heldout", "heldout_unseen")
"""Every split name: ``train``; ``heldout``: in-distribution held-out problems (the training
distribution's surface, problems never trained on); ``heldout_unseen``: held-out problems in a surface
never trained on either (e.g. phrasing families held out whole), offered only by tasks that list it in
their ``eval_splits``."""

DEFAULT_EVAL_SPLITS = ("heldout",)
"""The held-out sets of a task without an ``eval_splits`` attribute."""


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """One prompt: ``prompt`` is its text, ``reference`` what the verifier compares against,
    ``meta`` JSON scalars stored in the ledger (difficulty, a model-free reference answer
    ``answer`` for display...).

    ``messages`` (optional): the prompt as a chat, ``[{role, content}, ...]`` with roles
    ``system`` / ``user`` / ``assistant`` (few-shot turns), ending with the ``user`` turn to
    answer; ``prompt`` is then that last user message (for display, splits and reward functions).
    What the model sees is decided by the run's
    :class:`~posttrain.envs.prompt_render.PromptRenderer` (``task.chat_template``)."""

    prompt_id: str
    prompt: str
    reference: Any
    meta: Mapping[str, JSONScalar] = dataclasses.field(default_factory=dict)
    # Where the example came from ("data.jsonl: row 7") so a later check can name the row; not part
    # of the example's identity, and not stored in the ledger.
    source: str = dataclasses.field(default="", compare=False, repr=False)
    messages: tuple[Mapping[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if self.messages is not None:
            from posttrain.envs.prompt_render import check_messages

            object.__setattr__(self, "messages",
                               check_messages(self.messages, self.source or f"prompt {self.prompt_id!r}"))


@runtime_checkable
class Task(Protocol):
    """A prompt source with its verifier (attributes, dataclass fields or properties)."""

    @property
    def name(self) -> str:
        """Task name (prefix of its prompt ids)."""
        ...

    @property
    def verifier(self) -> Verifier:
        """The verifier of this task's responses."""
        ...

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` examples of ``split`` (``"train"`` or one of the task's held-out sets: its optional
        ``eval_splits``, default :data:`DEFAULT_EVAL_SPLITS`); same arguments -> same list."""
        ...


def check_split(split: str, task_name: str = "", eval_splits: tuple[str, ...] = DEFAULT_EVAL_SPLITS) -> str:
    """``split`` if it is one of :data:`SPLITS` and offered by the task (``"train"`` or one of its
    ``eval_splits``), else a ``ValueError`` listing the valid names or naming the task and its held-out sets."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if split != "train" and split not in eval_splits:
        who = f"task {task_name!r}" if task_name else "this task"
        raise ValueError(f"{who} has no split {split!r}: its held-out sets (eval_splits) are {', '.join(eval_splits)}")
    return split


def split_of(key: str, heldout_fraction: float) -> str:
    """Deterministic split of a problem: ``heldout`` iff ``sha256(key) mod 10^6 < f * 10^6``.

    Independent of any seed and of Python's randomised ``hash``, so the split of a problem is the
    same in every run and process.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 1_000_000
    return "heldout" if h < heldout_fraction * 1_000_000 else "train"


def sample_split(
    task_name: str,
    split: str,
    n: int,
    seed: int,
    draw: Callable[[random.Random], tuple[str, TaskExample]],
    heldout_fraction: float,
    rng_tag: str = "",
    max_tries_per_example: int = 200,
) -> list[TaskExample]:
    """Rejection-sample ``n`` examples whose problem key falls in ``split`` (``train`` or ``heldout``).

    ``draw(rng) -> (key, example)`` proposes one problem; its split is
    ``split_of(f"{task_name}|{key}")``, so it depends on the problem only (not on the difficulty
    knobs: a curriculum that widens the difficulty never moves a held-out problem into train). Examples
    are unique by key as in :func:`sample_unique`. The RNG is seeded from ``(task_name, rng_tag, split,
    seed)`` (put the knobs in ``rng_tag``) so the result depends on nothing else. ``heldout_unseen`` is
    refused naming the task (a hash split of problems has no unseen surface).
    """
    check_split(split, task_name)

    def in_split(rng: random.Random) -> tuple[str, TaskExample] | None:
        key, ex = draw(rng)
        return (key, ex) if split_of(f"{task_name}|{key}", heldout_fraction) == split else None

    rng = random.Random(f"{task_name}|{rng_tag}|{split}|{seed}")
    return sample_unique(task_name, split, n, rng, in_split, max_tries_per_example)


def sample_unique(
    task_name: str,
    split: str,
    n: int,
    rng: random.Random,
    draw: Callable[[random.Random], tuple[str, TaskExample] | None],
    max_tries_per_example: int = 200,
) -> list[TaskExample]:
    """``n`` examples from ``draw(rng) -> (key, example)``, or ``None`` for a proposal outside the split.

    Examples are unique by key while the split still has unseen problems (tried up to
    ``max_tries_per_example * n`` draws); after that repeats of the examples found are allowed so a
    small problem space can still fill ``n``; none found raises a ``ValueError`` naming the task and split.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out: list[TaskExample] = []
    seen: set[str] = set()
    in_split: list[TaskExample] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > max_tries_per_example * max(n, 1):
            if not in_split:
                raise ValueError(f"task {task_name!r}: no problem of split {split!r} found; widen the difficulty")
            out.append(in_split[rng.randrange(len(in_split))])
            continue
        proposal = draw(rng)
        if proposal is None:
            continue
        key, ex = proposal
        if key in seen:
            continue
        seen.add(key)
        in_split.append(ex)
        out.append(ex)
    return out


MAX_CHARS_PER_TOKEN = 32
"""Screen before tokenizing: no tokenizer packs more characters than this into one token on real
text, so a prompt longer than this many characters per context position cannot fit (and is not
tokenized at all: a 50 MB row would exhaust memory in the tokenizer)."""


def check_prompts(
    examples: Iterable[TaskExample], tokenizer: Tokenizer, *, max_context: int | None, max_new_tokens: int = 0,
    chars_per_token: int = MAX_CHARS_PER_TOKEN, renderer: Any = None,
) -> None:
    """Raise ``ValueError`` naming the row (``ex.source``, else the prompt id) of the first example
    whose prompt cannot be encoded or does not fit ``max_context`` positions with ``max_new_tokens``.

    The prompt is what ``renderer`` (a :class:`~posttrain.envs.prompt_render.PromptRenderer`;
    default: raw text) renders, chat template and system prompt included. First by length, before
    tokenizing: more than ``chars_per_token * (max_context - max_new_tokens)`` characters is
    refused untokenized. Then the tokenizer's own errors (the builtin char tokenizer refuses
    characters outside its vocabulary) and the exact token count. ``max_context=None`` checks
    encodability only.
    """
    if renderer is None:
        from posttrain.envs.prompt_render import PromptRenderer

        renderer = PromptRenderer(tokenizer)
    budget = None if max_context is None else max_context - max_new_tokens
    if budget is not None and budget < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
                         f"of {max_context} positions")
    for ex in examples:
        where = ex.source or f"prompt {ex.prompt_id!r}"
        msgs = getattr(ex, "messages", None)
        chars = sum(len(m["content"]) for m in msgs) if msgs else len(ex.prompt)
        if budget is not None and chars > chars_per_token * budget:
            raise ValueError(f"{where}: prompt of {chars} characters cannot fit the model's context of "
                             f"{max_context} tokens (with max_new_tokens={max_new_tokens}); not tokenized")
        try:
            text = renderer.text(ex)
            ids = renderer.encode(text)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and unk in ids and tokenizer.unk_token not in text:
            raise ValueError(f"{where}: {_unknown_chars(text, tokenizer)} cannot be encoded by the tokenizer "
                             f"(they would silently become {tokenizer.unk_token})")
        n = len(ids)
        if budget is not None and n > budget:
            raise ValueError(f"{where}: prompt of {n} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"model's context of {max_context} tokens")


def _unknown_chars(text: str, tokenizer: Tokenizer) -> str:
    """The characters of ``text`` that encode to the unknown token, e.g. ``"'é' (U+00E9)"``."""
    bad = [c for c in dict.fromkeys(text) if tokenizer.unk_token_id in tokenizer(c).input_ids]
    return ", ".join(f"{c!r} (U+{ord(c):04X})" for c in bad[:5]) or "some characters"


REFERENCE_CHECK_LIMIT = 256
""":func:`check_references` checks every distinct reference up to this many, else a seeded sample of
this many (a math reference costs up to ~0.1 s of sympy parsing; integers are checked for free)."""


def check_references(examples: Iterable[TaskExample], verifier: Verifier, *, what: str = "reference",
                     limit: int = REFERENCE_CHECK_LIMIT, seed: int = 0) -> int:
    """Raise ``ValueError`` naming the row (``ex.source``, else the prompt id) of the first example whose
    reference ``verifier`` can never read; returns how many distinct references were checked.

    Asks the verifier's optional ``check_reference(reference) -> str | None`` (the reason it cannot
    be read, e.g. malformed LaTeX for ``math``; verifiers without it are not checked): a reference the
    verifier cannot read would make every verification of that prompt an ``infra_error`` (or a silent
    ``wrong``) at run time. Distinct references are checked once each, all of them when there are at most
    ``limit``, else a sample of ``limit`` drawn with ``seed`` (in file order). ``what`` names the
    reference in the message (e.g. ``"field 'answer'"``).
    """
    check = getattr(verifier, "check_reference", None)
    if check is None:
        return 0
    first: dict[str, TaskExample] = {}
    for ex in examples:
        first.setdefault(repr(ex.reference), ex)
    todo = list(first.values())
    if len(todo) > limit:
        keep = set(random.Random(seed).sample(range(len(todo)), limit))
        todo = [ex for i, ex in enumerate(todo) if i in keep]
    for ex in todo:
        why = check(ex.reference)
        if why:
            where = ex.source or f"prompt {ex.prompt_id!r}"
            raise ValueError(f"{where}: {what} {str(ex.reference)[:80]!r} cannot be read by the "
                             f"{getattr(verifier, 'name', 'task')!r} verifier: {why}")
    return len(todo)


def task_rows(task: Any) -> list[TaskExample] | None:
    """Every example of a finite task (one with a ``rows`` mapping, e.g. a file task), else None."""
    rows = getattr(task, "rows", None)
    if not isinstance(rows, Mapping):
        return None
    return [ex for split in rows.values() for ex in split]


def resolve_verifier(spec: Verifier | str | Mapping[str, Any]) -> Verifier:
    """A verifier object from an object, a registry name, or ``{"name": ..., **kwargs}``."""
    if isinstance(spec, str):
        return build_verifier(spec)
    if isinstance(spec, Mapping):
        kw = dict(spec)
        if "name" not in kw:
            raise ValueError(f"verifier spec {spec!r} needs a 'name'")
        return build_verifier(kw.pop("name"), **kw)
    if not isinstance(spec, Verifier):
        raise ValueError(f"not a verifier (needs name, version, verify): {spec!r}")
    return spec
