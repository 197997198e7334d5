"""The builtin char tokenizer meets the :class:`~posttrain.models.tokenizer_protocol.Tokenizer` Protocol.

mypy checks the Protocol's methods against transformers' annotations; the special tokens reach a
``PreTrainedTokenizerBase`` through its ``__getattr__`` (typed ``Any``), so their values are checked
here, with every member the Protocol declares exercised."""

from pathlib import Path

from posttrain.models import build_char_tokenizer
from posttrain.models.tokenizer_protocol import Tokenizer

EXERCISED = {"chat_template", "eos_token", "eos_token_id", "pad_token_id", "unk_token", "unk_token_id",
             "__call__", "decode", "apply_chat_template", "save_pretrained"}


def test_the_protocol_declares_the_exercised_members() -> None:
    declared = {n for n in vars(Tokenizer) if not n.startswith("_") or n == "__call__"}
    assert declared == EXERCISED


def test_char_tokenizer_meets_the_protocol(tmp_path: Path) -> None:
    tok: Tokenizer = build_char_tokenizer()
    assert isinstance(tok.chat_template, str)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<eos>", 1, 0)
    assert (tok.unk_token, tok.unk_token_id) == ("<unk>", 3)
    ids = list(tok("a b", add_special_tokens=False).input_ids)
    assert tok.decode(ids) == "a b"
    assert tok.decode([*ids, 1], skip_special_tokens=True) == "a b"
    batch = tok(["ab", "a"], padding=True, truncation=True, max_length=8, return_tensors="pt")
    assert tuple(batch["input_ids"].shape) == (2, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>hi<|assistant|>"
    files = tok.save_pretrained(str(tmp_path))
    assert all(isinstance(f, str) and Path(f).is_file() for f in files)
