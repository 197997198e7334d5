"""A character-level Hugging Face tokenizer built locally (no hub download).

It is a real ``transformers.PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model whose
vocabulary is the printable ASCII characters plus special tokens, so it saves with
``save_pretrained`` and loads with ``AutoTokenizer.from_pretrained``. It carries a chat template
so multi-turn code paths render turns the same way as for a hub model.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% elif m['role'] == 'assistant' %}<|assistant|>"
    "{% elif m['role'] == 'system' %}<|system|>{% else %}<|tool|>{% endif %}"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0..7 are ``SPECIAL_TOKENS``, then printable ASCII (minus \\v \\f).

    ``pad_token_id = 0``, ``eos_token_id = 1``, ``bos_token_id = 2``; vocab size 8 + 98 = 106.
    """
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    special = "|".join(s.replace("|", r"\|") for s in SPECIAL_TOKENS)
    # Special tokens stay whole; every other character is its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{special}|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
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
