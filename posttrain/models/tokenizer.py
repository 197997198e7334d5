"""A character-level Hugging Face tokenizer built locally (no hub download).

It is a real ``transformers.PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model whose
vocabulary is the printable ASCII characters plus special tokens, so it saves with
``save_pretrained``. It carries a chat template so multi-turn code paths render turns the same way
as for a hub model.

Reload a saved copy with :func:`load_pretrained_tokenizer`, not ``AutoTokenizer.from_pretrained``:
next to a Qwen2 model's ``config.json`` (a checkpoint's ``actor/``) transformers replaces the saved
tokenizer class by ``Qwen2Tokenizer``, whose byte-level pre-tokenizer drops every space of this
vocabulary ("a b" -> the ids of "ab"). ``save_pretrained`` marks the folder
(``tokenizer_config.json`` key :data:`MARKER_KEY`) and the loader rebuilds this class from it.

Text with a character outside that vocabulary is refused with a ``ValueError`` naming the
character, instead of silently becoming ``<unk>`` (a model trained on ``<unk>`` for every accented
letter learns nothing from those prompts, and nobody notices).
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% elif m['role'] == 'assistant' %}<|assistant|>"
    "{% elif m['role'] == 'system' %}<|system|>{% else %}<|tool|>{% endif %}"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


MARKER_KEY = "posttrain_tokenizer"
"""Key of ``tokenizer_config.json`` whose value :data:`MARKER_CHAR` says the folder holds the char tokenizer."""
MARKER_CHAR = "char"

CHARS = "".join(c for c in string.printable if c not in "\x0b\x0c")
"""The vocabulary's characters: printable ASCII minus \\v and \\f (ids 8..105 in this order)."""

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
_UNKNOWN_RE = re.compile(f"[^{re.escape(CHARS)}]")


def unknown_character(text: str) -> tuple[int, str] | None:
    """``(index, char)`` of the first character of ``text`` the char tokenizer cannot encode, or None.

    Special-token strings (``<eos>``, ``<|user|>``...) are whole tokens and are skipped.
    """
    for i, part in _split_specials(text):
        m = _UNKNOWN_RE.search(part)
        if m is not None:
            return i + m.start(), m.group()
    return None


def _split_specials(text: str) -> list[tuple[int, str]]:
    """``(offset, piece)`` of the text between special-token strings."""
    out, pos = [], 0
    for m in _SPECIAL_RE.finditer(text):
        out.append((pos, text[pos:m.start()]))
        pos = m.end()
    out.append((pos, text[pos:]))
    return out


def check_encodable(text: str) -> None:
    """Raise ``ValueError`` naming the first character of ``text`` outside the char vocabulary."""
    bad = unknown_character(text)
    if bad is not None:
        i, c = bad
        raise ValueError(f"character {c!r} (U+{ord(c):04X}) at index {i} cannot be encoded by the builtin char "
                         f"tokenizer (printable ASCII only); text starts {text[:40]!r}")


def _check_input(x: object) -> None:
    if isinstance(x, str):
        check_encodable(x)
    elif isinstance(x, list | tuple):
        for item in x:
            _check_input(item)


class CharTokenizer(PreTrainedTokenizerFast):
    """The char tokenizer: a ``PreTrainedTokenizerFast`` that refuses unencodable text (see module doc).

    Every encoding path (``__call__``, ``encode``, batches, ``apply_chat_template(tokenize=True)``)
    goes through ``_encode_plus``, which checks the text first. A saved copy reloads as this class
    with :func:`load_pretrained_tokenizer`.
    """

    def _encode_plus(self, text: Any, text_pair: Any = None, *args: Any, **kwargs: Any) -> Any:
        _check_input(text)
        _check_input(text_pair)
        return super()._encode_plus(text, text_pair, *args, **kwargs)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """Save as the plain fast tokenizer underneath (transformers does not know this class's name),
        marked as the char tokenizer (:data:`MARKER_KEY`) so :func:`load_pretrained_tokenizer` rebuilds
        this class from the folder."""
        files = super().save_pretrained(save_directory, *args, **kwargs)
        for f in files:
            if Path(f).name.endswith("tokenizer_config.json"):
                cfg = json.loads(Path(f).read_text())
                cfg["tokenizer_class"] = PreTrainedTokenizerFast.__name__
                cfg[MARKER_KEY] = MARKER_CHAR
                Path(f).write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        return files


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0..7 are ``SPECIAL_TOKENS``, then printable ASCII (minus \\v \\f).

    ``pad_token_id = 0``, ``eos_token_id = 1``, ``bos_token_id = 2``; vocab size 8 + 98 = 106.
    Encoding a character outside the vocabulary raises ``ValueError`` (see :class:`CharTokenizer`).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    special = "|".join(s.replace("|", r"\|") for s in SPECIAL_TOKENS)
    # Special tokens stay whole; every other character is its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{special}|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = CharTokenizer(  # type: ignore[no-untyped-call]  # PreTrainedTokenizerFast.__init__ is unannotated
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def is_char_tokenizer_dir(path: str | Path) -> bool:
    """True when ``path`` is a folder whose ``tokenizer_config.json`` carries the char tokenizer's mark
    (written by :meth:`CharTokenizer.save_pretrained`)."""
    cfg = Path(path) / "tokenizer_config.json"
    return cfg.is_file() and json.loads(cfg.read_text()).get(MARKER_KEY) == MARKER_CHAR


def load_pretrained_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``path`` (a model directory, a checkpoint's ``actor/``), encoding exactly as
    the saved one did: a marked char tokenizer folder reloads as :class:`CharTokenizer` from its own
    ``tokenizer.json`` (pad / eos ids, chat template, left padding and the unencodable-text check as
    saved); any other folder through ``AutoTokenizer.from_pretrained``. See the module doc for why the
    char tokenizer cannot go through ``AutoTokenizer``."""
    if is_char_tokenizer_dir(path):
        tok: CharTokenizer = CharTokenizer.from_pretrained(str(path))
        tok.padding_side = "left"  # not saved with the folder
        return tok
    from transformers import AutoTokenizer

    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
    return loaded
