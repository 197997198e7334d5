"""``posttrain check`` for ``trainer: sft`` (posttrain/commands/check_sft.py): the four checks pass on the shipped
recipe, and each fails on the bug it is about."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from posttrain.commands import check_sft as C
from posttrain.commands.check import run_checks
from posttrain.loop import sft_training as S
from posttrain.loop.builders import build_model
from posttrain.loop.validate import load_run_config

TINY = ["model.path=builtin:tiny"]


@pytest.fixture(scope="module")
def parts() -> tuple[object, ...]:
    cfg = load_run_config("sft", TINY)
    train, _ = S.load_rows(cfg)
    rows = train[:4]
    torch.manual_seed(0)
    tok, model = build_model(cfg)
    model.eval()
    return cfg, rows, tok, model, S.encode_rows(cfg, tok, rows)


def test_the_shipped_recipe_passes_every_check() -> None:
    results = run_checks(load_run_config("sft", TINY), 4)
    assert [n for n, _, _ in results] == ["data_loads", "loss_mask", "packing_invariance", "microbatch_split"]
    assert all(ok is True for _, ok, _ in results), results


def test_a_bad_row_fails_data_loads_naming_file_and_row(tmp_path: Path) -> None:
    f = tmp_path / "chats.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                 '{"messages": [{"role": "user", "content": "hi"}]}\n')
    (name, ok, detail), = run_checks(load_run_config("sft", [*TINY, f"sft.data={f}"]), 4)
    assert (name, ok) == ("data_loads", False) and f"{f}: row 1" in detail  # rows count from 0, as every data file's


def test_loss_mask_fails_when_a_prompt_token_carries_loss(parts: tuple[object, ...]) -> None:
    _, rows, tok, _, enc = parts
    assert C.check_loss_mask(rows, enc, tok)[1] is True
    leaky = [dataclasses.replace(e, loss_mask=(1,) * len(e.loss_mask)) for e in enc]  # the whole row trained
    name, ok, detail = C.check_loss_mask(rows, leaky, tok)
    assert ok is False and "is not assistant text" in detail


def test_packing_invariance_catches_attention_across_rows(parts: tuple[object, ...],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, tok, model, enc = parts
    pad = int(tok.pad_token_id or 0)
    assert C.check_packing_invariance(model, enc, cfg, pad)[1] is True
    real = S.plain_logits

    def no_position_restart(m: torch.nn.Module, ids: torch.Tensor, am: torch.Tensor,
                            pos: torch.Tensor | None = None) -> torch.Tensor:
        return real(m, ids, am)  # the attention mask, no position ids: one causal sequence per block, rows see rows

    monkeypatch.setattr(S, "plain_logits", no_position_restart)
    name, ok, detail = C.check_packing_invariance(model, enc, cfg, pad)
    assert ok is False, detail


def test_microbatch_split_catches_a_micro_batch_local_mean(parts: tuple[object, ...],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, tok, model, enc = parts
    pad = int(tok.pad_token_id or 0)
    assert C.check_microbatch_split(model, enc, cfg, pad)[1] is True
    real = S.sft_cross_entropy
    monkeypatch.setattr(S, "sft_cross_entropy", lambda lp, m, n=None: real(lp, m, None))  # local token count
    name, ok, detail = C.check_microbatch_split(model, enc, cfg, pad)
    assert ok is False, detail


def test_microbatch_split_runs_padded_and_packed_through_the_learner(parts: tuple[object, ...],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's forwards are the learner's ``forward_backward`` (the path a training step runs): a padded
    and a packed batch of at least two blocks, each whole and in one-row micro-batches."""
    from posttrain.learner.actor import PolicyLearner

    cfg, _, tok, model, enc = parts
    seen: list[tuple[bool, int, int | None]] = []
    real = PolicyLearner.forward_backward

    def spy(self: PolicyLearner, batch: object, loss: object) -> object:
        tensors = batch.tensors  # type: ignore[attr-defined]
        seen.append((tensors["position_ids"] is not None, int(tensors["input_ids"].shape[0]), self.microbatch_tokens))
        return real(self, batch, loss)  # type: ignore[arg-type]

    monkeypatch.setattr(PolicyLearner, "forward_backward", spy)
    assert C.check_microbatch_split(model, enc, cfg, int(tok.pad_token_id or 0))[1] is True
    assert [(p, b) for p, _, b in seen] == [(False, 10**9), (False, 1), (True, 10**9), (True, 1)]
    assert [n for p, n, _ in seen if not p] == [len(enc)] * 2  # padded: a batch row per row
    assert all(2 <= n <= len(enc) for p, n, _ in seen if p)  # packed: at least two blocks
