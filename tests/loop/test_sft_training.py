"""``trainer: sft`` (posttrain/loop/sft_training.py over the learner's primitives and posttrain/loop/lifecycle.py):
packing against padding, no attention across packed rows, micro-batch invariance, padded and packed steps
through ``learner.forward_backward`` equal to a reference loss on the model's own forward, a tiny run whose held-out loss falls and whose
checkpoint loads, SIGINT (in-process, and a real signal to a ``posttrain train`` process) then resume equal to an
uninterrupted run, and the checks before the run directory, down to the command's one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import posttrain.loop.sft_training as sft_training
from posttrain.algos.sft import sft_cross_entropy, token_logprobs
from posttrain.cli import main
from posttrain.config import RECIPES_DIR, ConfigError, RunConfig
from posttrain.errors import UserError
from posttrain.learner.actor import PolicyLearner
from posttrain.learner.checkpoint import complete_checkpoints
from posttrain.learner.microbatch import microbatches
from posttrain.learner.settings import BatchingSettings
from posttrain.loop.builders import build_model, load_model
from posttrain.loop.interrupt import interrupt_flag
from posttrain.loop.sft_training import (
    PROGRAM,
    Layout,
    SFTTokenLoss,
    encode_rows,
    heldout_metrics,
    load_rows,
    packed_batch,
    padded_batch,
    row_losses,
    scored_tokens,
    sft_step,
)
from posttrain.loop.validate import load_run_config
from posttrain.models import build_char_tokenizer, build_tiny_model
from tests._cli_errors import one_error_line
from tests._tolerance import assert_grads_close, shape_rtol, update_rel_diff

DATA = RECIPES_DIR / "data" / "arithmetic_chat.jsonl"
MICRO = ["model.path=builtin:micro", "logging.progress=false", "optim.lr=1e-2", "sft.batch_size=8"]


def _cfg(tmp_path: Path, *overrides: str, run: str = "run") -> RunConfig:
    return load_run_config("sft", [f"run_dir={tmp_path / run}", *MICRO, *overrides])


def _rows(n: int = 12) -> list[sft_training.EncodedRow]:
    cfg = load_run_config("sft", MICRO)
    train, _ = load_rows(cfg)
    return encode_rows(cfg, build_char_tokenizer(), train[:n])


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=1)


def test_packing_gives_each_row_the_loss_padding_gives(model: torch.nn.Module) -> None:
    rows = _rows()
    packed = Layout(True, 128, 4096, 0)
    assert len(packed.units(rows)) < len(rows)  # rows share blocks
    pad = row_losses(model, rows, Layout(False, 128, 4096, 0))
    pack = row_losses(model, rows, packed)
    rtol = shape_rtol(128)
    for (a, n, h), (b, m, k) in zip(pack, pad, strict=True):
        assert (n, h) == (m, k) and n > 0
        assert abs(a - b) <= rtol * abs(b), (a, b)


def test_packed_rows_do_not_attend_to_each_other(model: torch.nn.Module) -> None:
    a, b = _rows(2)
    other = sft_training.EncodedRow(tuple(reversed(a.input_ids)), a.loss_mask, a.source)
    batches = [packed_batch([first, b], 256, 0, torch.device("cpu")) for first in (a, other)]
    assert all(x.shape[0] == 1 for x in batches)  # one block, two rows
    s, e = len(a.input_ids), len(a.input_ids) + len(b.input_ids)

    def b_logprobs(tensors: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """Row b's token log-probs after its first token (which no row trains: it has no context of its own)."""
        mb = microbatches(tensors, [0], None)[0]
        assert int(mb["loss_mask"][0, s]) == 0
        with torch.no_grad():
            return scored_tokens(model, mb)[0][0, s + 1:e]

    same = [b_logprobs(dict(x.tensors)) for x in batches]
    assert float((same[0] - same[1]).abs().max()) <= shape_rtol(256) * float(same[1].abs().max())
    # the same block with one causal mask over both rows (no position ids: no packing mask): row b sees row a
    seen = [b_logprobs({**x.tensors, "position_ids": None}) for x in batches]
    assert float((seen[0] - seen[1]).abs().max()) > 1e-3


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _reference_step(rows: list[sft_training.EncodedRow]) -> tuple[float, dict[str, torch.Tensor]]:
    """The step's token-mean cross-entropy and gradient by hand: each row alone through the model's full logits
    (:func:`~posttrain.algos.sft.token_logprobs`), reduced with the step's target-token count."""
    ref_model = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=1)
    n, total = float(sum(r.targets for r in rows)), 0.0
    for r in rows:
        ids = torch.tensor([r.input_ids])
        loss = sft_cross_entropy(token_logprobs(ref_model(input_ids=ids).logits, ids), torch.tensor([r.loss_mask]), n)
        loss.backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach())
    return total, _grads(ref_model)


@pytest.mark.parametrize("packing", [False, True])
def test_a_step_through_the_primitives_is_the_step_loss_in_any_micro_batches(packing: bool) -> None:
    """``learner.forward_backward(layout.batch(rows), SFTTokenLoss)`` (the primitives' plain forward, padded rows or
    packed blocks micro-batched by the learner, blocks whole) gives the loss and gradient of the step's token-mean
    cross-entropy over each row alone, in any micro-batches; and :func:`sft_step` takes exactly one optimiser step
    through ``learner.forward_backward``."""
    rows = _rows(8)
    ref_loss, g_ref = _reference_step(rows)
    for budget in (100_000, 64):
        model = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=1)
        learner = PolicyLearner(model, batching=BatchingSettings(microbatch_tokens=budget))
        layout = Layout(packing, 128, budget, 0)
        batch = layout.batch(rows, learner.device)
        assert batch.num_tokens == sum(r.targets for r in rows)
        assert batch.shape[0] == len(layout.units(rows)) and (batch.shape[0] < 8) == packing  # packed: rows share
        out = learner.forward_backward(batch, SFTTokenLoss())
        assert out.loss == pytest.approx(ref_loss, rel=shape_rtol(128)), budget
        assert_grads_close(_grads(model), g_ref, shape_rtol(128), f"budget {budget}")
    calls: list[str] = []
    for name in ("forward_backward", "forward_backward_custom", "optim_step"):
        real = getattr(learner, name)
        setattr(learner, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    learner.optimizer.zero_grad(set_to_none=True)
    m = sft_step(learner, rows, Layout(packing, 128, 64, 0))
    assert calls == ["forward_backward", "optim_step"]
    assert m["optimizer_steps"] == 1.0 and learner.optimizer_steps == 1
    assert m["tokens"] == sum(r.targets for r in rows) and m["rows"] == 8.0 and m["lr"] is not None


def test_packed_and_padded_batches_hold_the_same_rows() -> None:
    """:func:`packed_batch` lays each row's ids and loss mask out as :func:`padded_batch` does, in blocks of whole
    rows with position ids restarting at each row (and at the tail padding), attention mask 1 on the tokens."""
    rows = _rows(8)
    cpu = torch.device("cpu")
    pad, packed = padded_batch(rows, 0, cpu).tensors, packed_batch(rows, 128, 0, cpu).tensors
    assert pad["position_ids"] is None and packed["position_ids"] is not None
    units = Layout(True, 128, 1, 0).units(rows)
    for b, u in enumerate(units):
        at = 0
        for i in u:
            n = len(rows[i].input_ids)
            for k in ("input_ids", "loss_mask"):
                assert torch.equal(packed[k][b, at:at + n], pad[k][i, :n]), (b, i, k)
            assert torch.equal(packed["position_ids"][b, at:at + n], torch.arange(n))
            at += n
        assert int(packed["attention_mask"][b].sum()) == at and int(packed["position_ids"][b, at:].sum()) == sum(
            range(packed["input_ids"].shape[1] - at))


def test_tiny_run_lowers_heldout_loss_and_its_checkpoint_loads(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "steps=8", "eval.every=4", "checkpoint_every=4")
    res = PROGRAM.train(cfg, None)
    curve = dict(res.curve)
    assert res.step == 8 and list(curve) == [0, 4, 8] and curve[8] < curve[0] - 0.5, curve
    rows = _metrics(tmp_path / "run")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9)) and steps[-1]["rows_seen"] == 64
    assert {"tokens", "rows", "lr", "step_seconds", "grad_norm"} <= set(steps[0])
    assert [r["step"] for r in rows if "heldout/loss" in r] == [0, 4, 8]
    ckpts = complete_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step_000004", "step_000008"]
    # posttrain eval loads a checkpoint's actor/: the same model, the same held-out loss as the run's last
    tok, loaded = load_model(str(ckpts[-1] / "actor"), "float32", init_seed=0)
    _, held = load_rows(cfg)
    ev = heldout_metrics(loaded, encode_rows(cfg, tok, held), Layout(False, 128, 4096, 0))
    assert ev["heldout/loss"] == pytest.approx(curve[8], rel=shape_rtol(128))


def test_sigint_then_resume_equals_the_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["steps=6", "eval.every=2", "checkpoint_every=2", "sft.packing=true"]
    straight = PROGRAM.train(_cfg(tmp_path, *common, run="straight"), None)

    real = sft_training.data_rows

    def interrupt_in_step_4(n: int, batch_size: int, cursor: int, seed: int) -> list[int]:
        if cursor == 3 * batch_size:  # step 3 logged, checkpoint step_2 the last: a Ctrl-C now
            os.kill(os.getpid(), signal.SIGINT)
        return real(n, batch_size, cursor, seed)

    monkeypatch.setattr(sft_training, "data_rows", interrupt_in_step_4)
    with interrupt_flag(), pytest.raises(KeyboardInterrupt):
        PROGRAM.train(_cfg(tmp_path, *common), None)
    run_dir = tmp_path / "run"
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_000002"]
    assert max(r["step"] for r in _metrics(run_dir)) == 3
    monkeypatch.setattr(sft_training, "data_rows", real)
    resumed = PROGRAM.train(_cfg(tmp_path, *common, "resume=true"), None)
    assert resumed.step == 6
    a, b = _metrics(run_dir), _metrics(tmp_path / "straight")
    assert [(r["step"], sorted(r)) for r in a] == [(r["step"], sorted(r)) for r in b]  # no gap, no duplicate
    for x, y in zip(a, b, strict=True):
        for k in ("loss", "heldout/loss", "grad_norm", "rows_seen"):
            if k in y:
                assert x[k] == pytest.approx(y[k], rel=shape_rtol(128)), (x["step"], k)
    assert [s for s, _ in resumed.curve] == [0, 2, 4, 6]
    assert [v for _, v in resumed.curve] == pytest.approx([v for _, v in straight.curve], rel=shape_rtol(128))


@pytest.mark.parametrize(("overrides", "needle"), [
    (["sft.steps=5"], "sft.steps=5 cannot take effect: trainer=sft"),
    (["sft.lr=0.1"], "sft.lr=0.1 cannot take effect: trainer=sft"),
    (["lora.rank=4"], "lora.rank=4 cannot take effect: trainer=sft"),
    (["optim.gradient_checkpointing=true"], "optim.gradient_checkpointing=True cannot take effect"),
    ([f"sft.heldout_data={DATA}", "sft.heldout_fraction=0.2"], "sft.heldout_fraction=0.2 cannot take effect"),
    (["sft.data=null"], "trainer=sft needs sft.data"),
])
def test_keys_it_never_reads_are_refused_at_load(tmp_path: Path, overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, *overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("overrides", "needle"), [
    # <|user|>What is 97 minus 53?<|assistant|>97 - 53 = 44. The answer is 44.<eos>: 1 + 20 + 1 + 31 + 1 tokens
    (["sft.max_length=40"], "arithmetic_chat.jsonl: row 0: 54 tokens, over sft.max_length=40 (raise sft.max_length"),
    (["sft.heldout_fraction=0.001"], "no held-out rows among 320"),
])
def test_check_refuses_bad_data_before_the_run_dir(tmp_path: Path, overrides: list[str], needle: str) -> None:
    cfg = _cfg(tmp_path, *overrides)
    with pytest.raises(UserError) as e:
        PROGRAM.check(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_cli_trains_the_shipped_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "sft", f"run_dir={tmp_path / 'cli'}", *MICRO, "steps=2", "eval.every=2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "done: 2 steps" in out and "held-out loss by step 0:" in out
    assert main(["train", "sft", f"run_dir={tmp_path / 'bad'}", "sft.data=/no/such.jsonl"]) == 2
    assert "/no/such.jsonl: no such SFT data file" in capsys.readouterr().err


CHILD = """import sys, time
import posttrain.loop.sft_training as S
from posttrain.cli import main
real, pause = S.data_rows, float(sys.argv[1])
def slow(*a):
    time.sleep(pause)  # a step long enough for the test to signal mid-run
    return real(*a)
S.data_rows = slow
sys.exit(main(["train", "sft", *sys.argv[2:], "--no-progress"]))
"""


def _posttrain_train(pause: float, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(pause), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _last_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    actor = complete_checkpoints(run_dir / "checkpoints")[-1] / "actor"
    return {k: v for p in sorted(actor.glob("*.safetensors")) for k, v in load_file(str(p)).items()}


@pytest.mark.timeout(300)
def test_a_real_sigint_to_posttrain_train_then_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Done-when of issue 39: ``posttrain train sft`` (padded: the primitives' path) in its own process gets a
    SIGINT mid-run (after step 3 is logged), exits 130 with its last checkpoint intact, and ``resume=true`` ends
    with the metrics, held-out curve and weights of an uninterrupted run."""
    common = [*MICRO, "steps=6", "eval.every=2", "checkpoint_every=2", "sft.packing=false"]
    straight = PROGRAM.train(_cfg(tmp_path, *common, run="straight"), None)
    run_dir = tmp_path / "run"
    child = _posttrain_train(0.5, f"run_dir={run_dir}", *common)
    deadline = time.monotonic() + 240
    while not ((run_dir / "metrics.jsonl").exists() and any(r["step"] >= 3 for r in _metrics(run_dir))):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()[0]
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    out = child.communicate(timeout=120)[0]
    assert child.returncode == 130, out
    assert "interrupted; the last checkpoint" in out and "resume=true" in out
    stopped_at = max(r["step"] for r in _metrics(run_dir))
    assert 3 <= stopped_at < 6 and complete_checkpoints(run_dir / "checkpoints"), stopped_at
    resumed = _posttrain_train(0.0, f"run_dir={run_dir}", *common, "resume=true")
    out = resumed.communicate(timeout=240)[0]
    assert resumed.returncode == 0, out
    assert "done: 6 steps" in out
    a, b = _metrics(run_dir), _metrics(tmp_path / "straight")
    assert [(r["step"], sorted(r)) for r in a] == [(r["step"], sorted(r)) for r in b]  # no gap, no duplicate
    for x, y in zip(a, b, strict=True):
        for k in ("loss", "heldout/loss", "heldout/token_accuracy", "grad_norm", "lr", "rows_seen", "tokens"):
            if k in y:
                assert x[k] == pytest.approx(y[k], rel=shape_rtol(128)), (x["step"], k)
    assert [v for _, v in straight.curve] == pytest.approx(
        [r["heldout/loss"] for r in a if "heldout/loss" in r], rel=shape_rtol(128))
    start = build_model(_cfg(tmp_path, *common))[1].state_dict()  # the model as the runs built it
    w, ref = _last_weights(run_dir), _last_weights(tmp_path / "straight")
    assert update_rel_diff(w, ref, {k: start[k] for k in ref}) <= 10 * shape_rtol(128)


def _with_bad_row(tmp_path: Path, rec: dict[str, object], at: int = 5) -> Path:
    good = DATA.read_text().splitlines()
    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join([*good[:at], json.dumps(rec), *good[at:40]]) + "\n")
    return f


@pytest.mark.parametrize(("rec", "needle"), [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
     "row 5: field 'messages': message 1: field 'content' is missing"),
    ({"prompt": "2+2"}, "row 5: field 'completion' is missing"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
     "row 5: field 'messages': message 1: empty assistant turn"),
    ({"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]},
     "row 5: 204 tokens, over sft.max_length=128 (raise sft.max_length"),
])
def test_posttrain_train_refuses_a_bad_row_in_one_line_naming_file_row_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rec: dict[str, object], needle: str) -> None:
    f = _with_bad_row(tmp_path, rec)
    assert main(["train", "sft", f"run_dir={tmp_path / 'run'}", *MICRO, f"sft.data={f}", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert f"{f}: {needle}" in line, line
    assert not (tmp_path / "run").exists()


def test_posttrain_train_refuses_a_template_less_tokenizer_naming_file_row_and_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = build_char_tokenizer()
    build_tiny_model("micro", vocab_size=len(tok)).save_pretrained(tmp_path / "nochat")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "nochat")
    capsys.readouterr()
    for chat in ("auto", "false"):
        assert main(["train", "sft", f"run_dir={tmp_path / 'run'}", *MICRO, f"model.path={tmp_path / 'nochat'}",
                     f"task.chat_template={chat}", "--no-progress"]) == 2
        line = one_error_line(capsys)
        assert (f"{DATA.name}: row 0: a chat row, but the tokenizer of model.path={tmp_path / 'nochat'} has no chat "
                "template") in line, line
    assert not (tmp_path / "run").exists()
