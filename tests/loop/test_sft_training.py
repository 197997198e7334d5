"""``trainer: sft`` (posttrain/loop/sft_training.py over posttrain/loop/lifecycle.py): packing against padding,
no attention across packed rows, micro-batch invariance, a tiny run whose held-out loss falls and whose checkpoint
loads, SIGINT then resume equal to an uninterrupted run, and the checks before the run directory."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import posttrain.loop.sft_training as sft_training
from posttrain.cli import main
from posttrain.config import RECIPES_DIR, ConfigError, RunConfig
from posttrain.errors import UserError
from posttrain.learner.checkpoint import complete_checkpoints
from posttrain.loop.builders import load_model
from posttrain.loop.interrupt import interrupt_flag
from posttrain.loop.sft_training import (
    PROGRAM,
    Layout,
    Microbatch,
    SFTStepLoss,
    encode_rows,
    forward_logprobs,
    heldout_metrics,
    load_rows,
    row_losses,
)
from posttrain.loop.validate import load_run_config
from posttrain.models import build_char_tokenizer, build_tiny_model
from tests._tolerance import assert_grads_close, shape_rtol

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
    assert len(packed.split(rows)[0].input_ids) < len(rows)  # rows share blocks
    pad = row_losses(model, rows, Layout(False, 128, 4096, 0))
    pack = row_losses(model, rows, packed)
    rtol = shape_rtol(128)
    for (a, n, h), (b, m, k) in zip(pack, pad, strict=True):
        assert (n, h) == (m, k) and n > 0
        assert abs(a - b) <= rtol * abs(b), (a, b)


def test_packed_rows_do_not_attend_to_each_other(model: torch.nn.Module) -> None:
    a, b = _rows(2)
    other = sft_training.EncodedRow(tuple(reversed(a.input_ids)), a.loss_mask, a.source)
    layout = Layout(True, 256, 4096, 0)
    mbs = [layout.split([first, b])[0] for first in (a, other)]
    assert all(len(mb.spans) == 2 and mb.input_ids.shape[0] == 1 for mb in mbs)  # one block, two rows

    def b_logprobs(mb: Microbatch) -> torch.Tensor:
        """Row b's token log-probs after its first token (which no row trains: it has no context of its own)."""
        _, bb, s, e = mb.spans[1] if mb.spans[1][0] == 1 else mb.spans[0]
        assert int(mb.loss_mask[bb, s]) == 0
        with torch.no_grad():
            return forward_logprobs(model, mb)[0][bb, s + 1:e]

    same = b_logprobs(mbs[0]), b_logprobs(mbs[1])
    assert float((same[0] - same[1]).abs().max()) <= shape_rtol(256) * float(same[1].abs().max())
    # the same block with one causal mask over both rows (no packing mask): row b sees row a, and it shows
    naive = [Microbatch(mb.input_ids, mb.loss_mask, torch.ones_like(mb.input_ids), None, mb.spans) for mb in mbs]
    seen = b_logprobs(naive[0]), b_logprobs(naive[1])
    assert float((seen[0] - seen[1]).abs().max()) > 1e-3


def test_step_loss_is_the_same_in_any_micro_batches(model: torch.nn.Module) -> None:
    rows = _rows(8)
    grads = []
    for layout in (Layout(False, 128, 100_000, 0), Layout(False, 128, 64, 0), Layout(True, 128, 128, 0)):
        model.zero_grad()
        loss = SFTStepLoss(model, rows, layout)
        loss.backward(range(8), loss.normaliser(range(8)))
        grads.append(({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, loss.metrics))
    model.zero_grad()
    (g0, m0), *rest = grads
    for g, m in rest:
        assert_grads_close(g, g0, shape_rtol(128))
        assert m["loss"] == pytest.approx(m0["loss"], rel=shape_rtol(128)) and m["tokens"] == m0["tokens"]


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
