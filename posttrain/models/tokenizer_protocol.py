"""The tokenizer as posttrain consumes it: one typed :class:`Tokenizer` Protocol.

Every signature of posttrain that takes a tokenizer (envs, rewards, the loop, the learner's checkpoint)
takes this Protocol. It lives on the models floor (``docs/architecture.md``), below every user, and
imports nothing at run time, so naming it costs no ``transformers`` import.
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    """The subset of Hugging Face ``transformers.PreTrainedTokenizerBase`` that posttrain calls.

    Met structurally by every ``PreTrainedTokenizerBase`` subclass (a hub model's tokenizer, the
    builtin :class:`~posttrain.models.tokenizer.CharTokenizer`): the parameter types are the part
    of transformers' own annotations posttrain passes, the special tokens are read-only here
    (transformers resolves them dynamically, ``None`` when unset). Return values transformers
    annotates as unions over the call's options (``__call__``'s ``BatchEncoding``,
    ``apply_chat_template``'s text / ids / encoding) are ``Any``; callers read ``.input_ids`` or
    take ``str(...)`` of what they asked for.
    """

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The Jinja chat template (named templates: name -> template), or None without one.
        Callers that accept any tokenizer-like object read it with ``getattr(tok, "chat_template", None)``."""
        ...

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token's text."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token's id."""
        ...

    @property
    def pad_token_id(self) -> int | None:
        """The padding token's id (posttrain pads with 0 when it is None)."""
        ...

    @property
    def unk_token(self) -> str | None:
        """The unknown token's text (what an unencodable character silently becomes)."""
        ...

    @property
    def unk_token_id(self) -> int | None:
        """The unknown token's id."""
        ...

    def __call__(self, text: str | list[str], *, add_special_tokens: bool = True, padding: bool = False,
                 truncation: bool = False, max_length: int | None = None,
                 return_tensors: str | None = None) -> Any:
        """Encode ``text`` (a batch: a list); a ``BatchEncoding``: ``.input_ids``, ``.items()``."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]:
        """Text of ``token_ids`` (one sequence: a ``str``)."""
        ...

    def apply_chat_template(self, conversation: list[dict[str, str]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> Any:
        """Render ``conversation`` (``{role, content}`` messages) through the chat template; with
        ``tokenize=False`` the text. ``kwargs``: transformers' others, e.g. ``tools`` (JSON schemas)."""
        ...

    def save_pretrained(self, save_directory: str) -> tuple[str, ...]:
        """Write the tokenizer's files into ``save_directory``; their paths."""
        ...
