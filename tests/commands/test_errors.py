"""Errors a user meets at run time are one line naming the file / row / character, never a traceback.

Data-file errors, prompts that cannot be encoded or do not fit the model's context, and the
command line's catch-all for everything else (exit 1, one line) and Ctrl-C (exit 130).
"""

import json
import sys
from pathlib import Path

import pytest

import posttrain.commands.train as train_cmd
from posttrain.cli import main
from posttrain.envs import TASKS
from posttrain.envs.files import iter_jsonl
from posttrain.models.tokenizer import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cli_errors import one_error_line  # noqa: E402

# A micro model and a run that ends at once: a case that slipped through would cost seconds, not minutes.
QUICK = ["model.path=builtin:micro", "sampling.group_size=2", "sampling.prompts_per_step=1",
         "sampling.max_new_tokens=3", "steps=0", "eval.size=1", "sft.steps=0", "optim.num_minibatches=1",
         "--no-progress"]
CHECK = ["model.path=builtin:micro", "sampling.group_size=2", "sampling.max_new_tokens=3"]




def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl_task(path, **kw) -> list[str]:
    kwargs = {"path": str(path), "verifier": "exact", **kw}
    return ["task.name=jsonl", f"task.kwargs={json.dumps(kwargs)}"]


ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": f"q{i}"} for i in range(12)]


# ---------------------------------------------------------------------------------- data files


def test_non_utf8_row_names_file_and_row(capsys, tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "x"}\n')
    assert main(["train", "grpo", *QUICK, f"run_dir={tmp_path / 'run'}", *jsonl_task(p)]) == 2
    line = one_error_line(capsys)
    assert f"{p}: row 1: not UTF-8" in line


def test_duplicate_ids_name_the_file_and_both_rows(capsys, tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS[:5], {**ROWS[5], "id": "q2"}, *ROWS[6:]])
    assert main(["train", "grpo", *QUICK, f"run_dir={tmp_path / 'run'}", *jsonl_task(p, id_field="id")]) == 2
    line = one_error_line(capsys)
    assert f"{p}: rows 2 and 5: duplicate id 'q2'" in line


def test_duplicate_ids_across_split_files(tmp_path):
    tr = write_jsonl(tmp_path / "train.jsonl", ROWS[:6])
    he = write_jsonl(tmp_path / "heldout.jsonl", [ROWS[6], ROWS[3]])
    with pytest.raises(ValueError, match=rf"{tr}: row 3 and {he}: row 1: duplicate id 'train/q3'"):
        TASKS["jsonl"](splits={"train": str(tr), "heldout": str(he)}, id_field="id")


def test_a_giant_row_is_refused_while_reading_not_tokenized(tmp_path):
    # 20 MB on one line: over the default max_row_bytes, refused after reading 16 MiB of it.
    p = tmp_path / "big.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "x" * 20_000_000, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=rf"{p}: row 1: longer than max_row_bytes=16777216"):
        list(iter_jsonl(p))


def test_row_byte_limit_is_one_line_through_the_cli(capsys, tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "y" * 5000, "answer": "1"}])
    task = jsonl_task(p, reader_kwargs={"max_row_bytes": 1000})
    assert main(["train", "grpo", *QUICK, f"run_dir={tmp_path / 'run'}", *task]) == 2
    assert f"{p}: row 12: longer than max_row_bytes=1000" in one_error_line(capsys)


def test_prompt_far_over_the_context_is_refused_before_tokenizing(capsys, tmp_path, monkeypatch):
    # 40k characters >> 32 chars/token x 512 positions of the micro model: refused by length alone.
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "7" * 40_000, "answer": "1"}])
    calls = []
    real = build_char_tokenizer()
    monkeypatch.setattr("posttrain.models.build_char_tokenizer", lambda: _Spy(real, calls))
    assert main(["check", "grpo", *CHECK, *jsonl_task(p)]) == 2
    line = one_error_line(capsys)
    assert f"{p}: row 12: prompt of 40000 characters cannot fit the model's context of 512" in line
    assert all(len(t) < 1000 for t in calls)  # the giant prompt never reached the tokenizer


def test_prompt_over_the_context_by_tokens(capsys, tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "8" * 600, "answer": "1"}])
    assert main(["check", "grpo", *CHECK, *jsonl_task(p)]) == 2
    line = one_error_line(capsys)
    assert f"{p}: row 12: prompt of 600 tokens + max_new_tokens=3 exceeds the model's context of 512" in line


# ------------------------------------------------------------------------ unencodable characters


def test_char_tokenizer_refuses_unknown_characters_instead_of_unk():
    tok = build_char_tokenizer()
    assert tok("1+1=<eos>").input_ids[-1] == tok.eos_token_id  # special tokens are still whole tokens
    with pytest.raises(ValueError, match=r"character 'é' \(U\+00E9\) at index 3"):
        tok("caf\u00e9")
    with pytest.raises(ValueError, match=r"'\\u2212' \(U\+2212\)|'−' \(U\+2212\)"):
        tok.apply_chat_template([{"role": "user", "content": "3\u22121"}], tokenize=True)


def test_unencodable_prompt_names_file_row_and_character(capsys, tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "2\u00d73=", "answer": "6"}])
    assert main(["check", "grpo", *CHECK, *jsonl_task(p)]) == 2
    line = one_error_line(capsys)
    assert f"{p}: row 12:" in line and "'×' (U+00D7)" in line


def test_unencodable_prompt_stops_training_with_one_line(capsys, tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [{**r, "prompt": r["prompt"] + "\u00e9"} for r in ROWS])
    assert main(["train", "grpo", *QUICK, f"run_dir={tmp_path / 'run'}", *jsonl_task(p)]) == 2
    assert "'é' (U+00E9)" in one_error_line(capsys)


def test_saved_char_tokenizer_reloads_as_the_same_fast_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    # The saved files name the class they always named: the refusing subclass is not saved.
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert type(again).__name__ == "TokenizersBackend"  # not the model type's Qwen2Tokenizer
    assert again("1+1= <eos>").input_ids == build_char_tokenizer()("1+1= <eos>").input_ids == [9, 80, 9, 88, 102, 1]
    assert again.chat_template


def test_check_prompts_names_the_row_a_plain_tokenizer_maps_to_unk(tmp_path):
    # A saved char tokenizer reloads as a plain fast tokenizer (no refusal built in): the prompt
    # check still finds the characters that became <unk> and names the row.
    from transformers import AutoTokenizer

    from posttrain.envs.task import check_prompts, task_rows

    build_char_tokenizer().save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "caf\u00e9=", "answer": "1"}])
    task = TASKS["jsonl"](path=str(p))
    with pytest.raises(ValueError, match=rf"{p}: row 12: 'é' \(U\+00E9\) cannot be encoded by the tokenizer"):
        check_prompts(task_rows(task), tok, max_context=512, max_new_tokens=3)


# ----------------------------------------------------------------------- the command line itself


def _raising(exc):
    def run(args):
        raise exc

    return run


def test_unexpected_exception_is_one_line_exit_1(capsys, monkeypatch):
    monkeypatch.setattr(train_cmd, "run", _raising(RuntimeError("engine exploded\nsecond line")))
    assert main(["train", "grpo"]) == 1
    line = one_error_line(capsys)
    assert line.startswith("posttrain train: error: RuntimeError: engine exploded | second line")
    assert "--traceback" in line


def test_traceback_flag_re_raises(monkeypatch):
    monkeypatch.setattr(train_cmd, "run", _raising(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        main(["train", "grpo", "--traceback"])


def test_keyboard_interrupt_is_one_line_exit_130(capsys, monkeypatch):
    monkeypatch.setattr(train_cmd, "run", _raising(KeyboardInterrupt()))
    assert main(["train", "grpo"]) == 130
    assert one_error_line(capsys) == "posttrain train: interrupted"


def test_system_exit_is_not_swallowed(monkeypatch):
    monkeypatch.setattr(train_cmd, "run", _raising(SystemExit(3)))
    with pytest.raises(SystemExit) as e:
        main(["train", "grpo"])
    assert e.value.code == 3


def test_an_os_error_without_message_is_still_one_line(capsys, monkeypatch):
    monkeypatch.setattr(train_cmd, "run", _raising(OSError()))
    assert main(["train", "grpo"]) == 1
    assert "OSError: (no message)" in one_error_line(capsys)


class _Spy:
    """A tokenizer proxy that records the texts it is asked to encode."""

    def __init__(self, tok, calls):
        self._tok, self._calls = tok, calls

    def __call__(self, text, *a, **kw):
        self._calls.append(text)
        return self._tok(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def test_train_refuses_a_prompt_over_the_context_before_any_rollout_and_leaves_no_run_dir(capsys, tmp_path):
    """The train path runs the same prompt check as check/eval (file and row named), and a run that
    never started leaves no run directory behind."""
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "7" * 40_000, "answer": "1"}])
    run_dir = tmp_path / "run"
    assert main(["train", "grpo", *QUICK, f"run_dir={run_dir}", *jsonl_task(p)]) == 2
    line = one_error_line(capsys)
    assert f"{p}: row 12: prompt of 40000 characters cannot fit the model's context of 512" in line
    assert not run_dir.exists()


def test_train_names_the_row_of_an_unencodable_prompt(capsys, tmp_path):
    p = write_jsonl(tmp_path / "data.jsonl", [*ROWS, {"prompt": "2\u00d73=", "answer": "6"}])
    assert main(["train", "grpo", *QUICK, f"run_dir={tmp_path / 'run'}", *jsonl_task(p)]) == 2
    line = one_error_line(capsys)
    assert f"{p}: row 12:" in line and "'×' (U+00D7)" in line
