"""Offline preference optimisation (trainer: preference): the loss adapter on hand numbers, sequence log-probs
against a direct computation, the data order, and runs on a tiny model that must learn the toy preference
(the chosen response is the prompt's word in capitals, posttrain/recipes/data/shout_pairs.jsonl)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.cli import main
from posttrain.config import RECIPES_DIR, RunConfig
from posttrain.errors import UserError
from posttrain.loop.lifecycle import data_rows
from posttrain.loop.preference_batch import sequence_logprobs
from posttrain.loop.preference_loss import PairLogprobs, implicit_margin, kto_reference_point, preference_loss
from posttrain.loop.preference_training import train_preference
from posttrain.loop.validate import load_run_config

D = torch.float64
PAIRS = RECIPES_DIR / "data" / "shout_pairs.jsonl"


def _lp(pc: float, pr: float, rc: float | None, rr: float | None, lc: float = 4.0, lr: float = 2.0,
        score: float | None = None) -> PairLogprobs:
    def t(x: float | None) -> torch.Tensor | None:
        return None if x is None else torch.tensor([x], dtype=D)

    s = t(score)
    return PairLogprobs(torch.tensor([pc], dtype=D), torch.tensor([pr], dtype=D), t(rc), t(rr),
                        torch.tensor([lc], dtype=D), torch.tensor([lr], dtype=D), s)


def test_adapter_feeds_each_loss_what_it_needs() -> None:
    # h = (-10 + 11) - (-12 + 11) = 2; DPO beta 0.1: log(1 + e^-0.2)
    loss, diag = preference_loss("dpo", {"beta": 0.1}, _lp(-10.0, -12.0, -11.0, -11.0))
    assert float(loss) == pytest.approx(math.log1p(math.exp(-0.2)), abs=1e-12)
    assert float(diag["reward_margin"]) == pytest.approx(0.2, abs=1e-12)
    # SimPO reads the lengths, no reference: beta 2 (-10/4 - -12/2) - gamma 0.5 = 2 * 3.5 - 0.5 = 6.5
    loss, _ = preference_loss("simpo", {}, _lp(-10.0, -12.0, None, None))
    assert float(loss) == pytest.approx(math.log1p(math.exp(-6.5)), abs=1e-12)
    # ODPO reads score_diff: -log sigma(0.1 * 2 - 1 * 0.5)
    loss, _ = preference_loss("odpo", {}, _lp(-10.0, -12.0, -11.0, -11.0, score=0.5))
    assert float(loss) == pytest.approx(math.log1p(math.exp(0.3)), abs=1e-12)
    with pytest.raises(ValueError, match="score_diff"):
        preference_loss("odpo", {}, _lp(-10.0, -12.0, -11.0, -11.0))
    # KTO: the chosen half desirable, the rejected half not; r = (1, -1), z0 = mean(1, -1) = 0
    lp = _lp(-10.0, -12.0, -11.0, -11.0)
    z0 = kto_reference_point(lp)
    assert float(z0) == 0.0
    loss, _ = preference_loss("kto", {"beta": 0.1}, lp, kl_ref_point=z0)
    sig = 1 / (1 + math.exp(-0.1))
    assert loss.tolist() == pytest.approx([1 - sig, 1 - sig], abs=1e-12)


def test_implicit_margin() -> None:
    assert float(implicit_margin("ipo", _lp(-10.0, -12.0, -11.0, -11.0))) == pytest.approx(2.0)
    assert float(implicit_margin("orpo", _lp(-10.0, -12.0, None, None))) == pytest.approx(-2.5 + 6.0)


def test_sequence_logprobs_sum_the_response_tokens() -> None:
    from posttrain.models import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model("micro", vocab_size=20, seed=0, dtype=D)
    model.train(False)
    rows = [((1, 2, 3), (4, 5)), ((6,), (7, 8, 9))]
    with torch.no_grad():
        got = sequence_logprobs(model, rows, pad_id=0)
    for i, (p, r) in enumerate(rows):
        ids = torch.tensor([list(p + r)])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        want = sum(float(logp[len(p) + j - 1, t]) for j, t in enumerate(r))
        assert float(got[i]) == pytest.approx(want, rel=1e-9)


def test_encode_pair_renders_the_chat_and_appends_eos() -> None:
    from posttrain.envs.preference_data import PreferencePair
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.loop.preference_batch import encode_pair
    from posttrain.models import build_char_tokenizer

    tok = build_char_tokenizer()
    renderer = PromptRenderer(tok, chat=True, system_prompt="Be loud.")
    chat = ({"role": "user", "content": "hi"},)
    enc = encode_pair(PreferencePair("t/0", chat, "HI", "hi", {"source": "f.jsonl: row 0"}), renderer, tok,
                      max_length=64)
    # <|system|>Be loud.<|user|>hi<|assistant|> : the prompt as the engine samples from it
    assert tok.decode(list(enc.prompt)) == "<|system|>Be loud.<|user|>hi<|assistant|>"
    assert enc.chosen == (*tok("HI", add_special_tokens=False).input_ids, tok.eos_token_id)
    assert len(enc.prompt) == 13 and len(enc.rejected) == 3 and enc.source == "f.jsonl: row 0"  # 3 specials + 10 chars
    with pytest.raises(UserError, match=r"f.jsonl: row 0: prompt \+ chosen response is 16 tokens, over "
                       r"preference.max_length=15"):
        encode_pair(PreferencePair("t/0", chat, "HI", "hi", {"source": "f.jsonl: row 0"}), renderer, tok,
                    max_length=15)


def test_data_rows_walk_one_permutation_per_pass() -> None:
    a = data_rows(10, 4, 0, seed=3) + data_rows(10, 4, 4, seed=3) + data_rows(10, 2, 8, seed=3)
    assert sorted(a) == list(range(10))  # one pass: every pair once
    assert data_rows(10, 4, 8, seed=3)[:2] == a[8:]  # a batch spanning two passes starts where the pass ends
    assert data_rows(10, 4, 4, seed=3) == a[4:8]  # the cursor alone decides (resume)


def _cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_run_config("dpo", [f"run_dir={tmp_path / 'run'}", f"preference.data={PAIRS}",
                                   "logging.progress=false", *overrides])


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dpo_learns_the_toy_preference(tmp_path: Path) -> None:
    res = train_preference(_cfg(tmp_path, "steps=12", "eval.every=6"))
    rows = _metrics(tmp_path / "run")
    held = [r for r in rows if "heldout/pair_accuracy" in r]
    train = [r for r in rows if "loss" in r]
    # At step 0 the policy is the reference: every margin is 0, no pair is ranked right.
    assert held[0]["heldout/pair_accuracy"] == 0.0 and held[0]["heldout/margin"] == 0.0
    assert held[-1]["heldout/pair_accuracy"] > 0.5 and held[-1]["heldout/margin"] > 0.0
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # -log sigma(0) before the first step
    assert train[-1]["reward_margin"] > train[0]["reward_margin"] + 0.1
    assert train[-1]["loss"] < train[0]["loss"] - 0.1
    assert res.step == 12 and [s for s, _ in res.curve] == [0, 6, 12]
    assert (tmp_path / "run" / "checkpoints" / "step_000012" / "actor").is_dir()


@pytest.mark.parametrize(("loss", "kwargs"), [("ipo", "{tau: 0.5}"), ("simpo", "{}"), ("orpo", "{}"),
                                              ("kto", "{beta: 0.1}")])
def test_every_loss_learns(tmp_path: Path, loss: str, kwargs: str) -> None:
    cfg = _cfg(tmp_path, "steps=8", "eval.every=8", "model.path=builtin:micro", f"preference.loss={loss}",
               f"preference.kwargs={kwargs}", "optim.lr=3e-3")
    res = train_preference(cfg)
    train = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
    assert res.curve[-1][1] > 0.5, res.curve


def test_odpo_reads_the_score_column(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    data = tmp_path / "scored.jsonl"
    data.write_text("".join(json.dumps({**r, "d": 1.0}) + "\n" for r in rows))
    base = [f"preference.data={data}", "preference.loss=odpo", "steps=2", "model.path=builtin:micro"]
    with pytest.raises(UserError, match="preference.fields.score_diff"):
        train_preference(_cfg(tmp_path, *base))
    assert not (tmp_path / "run").exists()
    res = train_preference(_cfg(tmp_path, *base, "preference.fields={score_diff: d}"))
    assert res.step == 2


def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    common = ["model.path=builtin:micro", "eval.every=2", "checkpoint_every=2"]
    train_preference(_cfg(tmp_path, *common, "steps=4"))
    train_preference(_cfg(tmp_path, *common, "steps=6", "resume=true"))
    resumed = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    straight_dir = tmp_path / "straight"
    train_preference(load_run_config("dpo", [f"run_dir={straight_dir}", f"preference.data={PAIRS}", *common,
                                             "steps=6", "logging.progress=false"]))
    straight = [r for r in _metrics(straight_dir) if "loss" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, straight, strict=True):  # same order of pairs and same weights: same losses
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]


def test_errors_before_the_run_dir(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"shout_pairs.jsonl: row \d+: prompt \+ chosen response is \d+ tokens, over "
                       r"preference.max_length=8"):
        train_preference(_cfg(tmp_path, "preference.max_length=8"))
    with pytest.raises(UserError, match="preference.kwargs"):
        train_preference(_cfg(tmp_path, "preference.kwargs={tau: 0.5}"))  # tau is IPO's, not DPO's
    assert not (tmp_path / "run").exists()


def test_cli_runs_the_shipped_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "dpo", f"run_dir={tmp_path / 'cli'}", f"preference.data={PAIRS}", "steps=4",
                 "eval.every=2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "done: 4 steps" in out and "held-out pair accuracy by step 0:0.000, 2:" in out
    assert main(["train", "dpo", f"run_dir={tmp_path / 'bad'}", "preference.data=/no/such.jsonl"]) == 2
    assert "no such preference file" in capsys.readouterr().err
