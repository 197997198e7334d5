"""Rejection sampling for expert iteration (posttrain/loop/rejection_sampling.py): with hand-built verdicts the kept
rows are exactly the correct ones (distinct texts first, capped per prompt; wrong, invalid, timeout, env_failure and
infra_error never kept, infra errors counted apart), the SFT data equals the ledger's kept rows (as written and as
the SFT loader reads it back) and renders to the prompt ids the RL engine sampled after, the prompts are the RL
run's, a held-out prompt is refused, ``trainer: sft`` trains on the output, and a pass cut between a step's
trajectories and its metrics resumes to what an uninterrupted pass writes."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path
from typing import Any

import pytest

import posttrain.loop.rejection_sampling as rs
from posttrain.cli import main
from posttrain.envs.sft_data import load_sft_rows
from posttrain.envs.task import TaskExample
from posttrain.loop.builders import build_model, build_task
from posttrain.loop.run import Run
from posttrain.loop.sft_training import encode_rows, load_rows
from posttrain.loop.validate import load_run_config
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.trajectory import Ledger, Status

C, W, INFRA = Status.CORRECT, Status.WRONG, Status.INFRA_ERROR
INV, TIME, ENV = Status.INVALID, Status.TIMEOUT, Status.ENV_FAILURE
# The tiny model on chain sums, 3 prompts per ledger step, 6 samples per prompt.
BASE = ["model.path=builtin:micro", "task.name=chain_sum", "sampling.prompts_per_step=3", "sampling.max_new_tokens=4",
        "eval.size=20", "logging.progress=false"]
# Sample j of each prompt: even j correct, j = 1 an infra error, j = 3, 5 wrong. Texts: j = 0 and 2 the same.
STATUS = {0: C, 1: INFRA, 2: C, 3: W, 4: C, 5: W}
TEXT = {0: "12", 1: "9", 2: "12", 3: "8", 4: "7", 5: "6"}


def test_select_kept_keeps_correct_distinct_first_capped() -> None:
    st = [C, C, C, W, INFRA, C, C]
    pid = ["a", "a", "a", "a", "a", "b", "b"]
    tx = ["x", "x", "y", "z", "w", " ", "q"]
    # a: correct 0 (x), 1 (x again), 2 (y); b: 5 blank (no SFT row), 6
    assert rs.select_kept(st, pid, tx, 1) == [True, False, False, False, False, False, True]
    assert rs.select_kept(st, pid, tx, 2) == [True, False, True, False, False, False, True]  # y before the repeat
    assert rs.select_kept(st, pid, tx, 3) == [True, True, True, False, False, False, True]
    # a prompt drawn again: its earlier kept texts count toward the cap and toward distinctness
    assert rs.select_kept(st, pid, tx, 2, {"a": ["y"]}) == [True, False, False, False, False, False, True]
    assert rs.select_kept(st, pid, tx, 1, {"a": ["y"]}) == [False, False, False, False, False, False, True]
    with pytest.raises(ValueError, match="keep_per_prompt must be >= 1"):
        rs.select_kept(st, pid, tx, 0)


# (statuses, prompt ids, texts, keep_per_prompt, already, kept): hand-built verdicts, one case per rule
SELECT_CASES = {
    "only_correct_kept": ([W, C, INV, TIME, ENV, INFRA], ["a"] * 6, ["1", "2", "3", "4", "5", "6"], 6, None,
                          [False, True, False, False, False, False]),
    "no_verdict_is_never_kept": ([INFRA, INFRA], ["a", "b"], ["1", "2"], 3, None, [False, False]),
    "all_wrong_keeps_nothing": ([W, W, W], ["a", "a", "b"], ["1", "2", "3"], 3, None, [False, False, False]),
    "duplicates_kept_once_under_the_cap": ([C, C, C], ["a"] * 3, ["x", "x", "x"], 1, None, [True, False, False]),
    "repeats_fill_the_cap_in_sample_order": ([C, C, C, C], ["a"] * 4, ["x", "x", "y", "x"], 3, None,
                                             [True, True, True, False]),
    "distinct_first_whatever_the_order": ([C, C, C, C], ["a"] * 4, ["x", "x", "x", "y"], 2, None,
                                          [True, False, False, True]),
    "cap_per_prompt_interleaved": ([C, C, C, C, C, C], ["a", "b", "a", "b", "a", "b"], ["1", "2", "3", "4", "5", "6"],
                                   2, None, [True, True, True, True, False, False]),
    "blank_correct_is_no_row": ([C, C, C], ["a"] * 3, ["", " \n", "z"], 3, None, [False, False, True]),
    "earlier_steps_fill_the_cap": ([C, C], ["a", "b"], ["1", "2"], 1, {"a": ["0"]}, [False, True]),
    "earlier_text_is_a_repeat": ([C, C], ["a", "a"], ["0", "1"], 2, {"a": ["0"]}, [False, True]),
}


@pytest.mark.parametrize("case", list(SELECT_CASES))
def test_select_kept_hand_built_verdicts(case: str) -> None:
    statuses, pids, texts, cap, already, kept = SELECT_CASES[case]
    assert rs.select_kept(statuses, pids, texts, cap, already) == kept


def _hand_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """play_once as in the run, then its verdicts and texts replaced by STATUS / TEXT of each sample's index."""
    real = rs.play_once

    def play(*a: Any, **kw: Any) -> Any:
        played = real(*a, **kw)
        idx = [c.sample_index for c in played.completions]
        verdicts = [infra_error("hand-built") if STATUS[j] is INFRA else
                    Verdict(STATUS[j], {"task": float(STATUS[j] is C)}) for j in idx]
        return dataclasses.replace(played, verdicts=verdicts, texts=[TEXT[j] for j in idx])

    monkeypatch.setattr(rs, "play_once", play)


def _sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: int = 2) -> tuple[Any, rs.SampleSummary, Path]:
    _hand_judged(monkeypatch)
    cfg = load_run_config("grpo", BASE)
    out = tmp_path / "rs"
    return cfg, rs.rejection_sample(cfg, out, k=6, prompts=5, keep_per_prompt=keep, command="cmd"), out


def test_kept_rows_are_exactly_the_correct_ones_and_match_the_ledger(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, summary, out = _sample(tmp_path, monkeypatch)
    # 5 prompts (steps of 3 + 2) x 6 samples: 3 correct, 1 infra error, 2 wrong each; 2 kept each (j = 0, 4)
    assert (summary.prompts, summary.samples, summary.kept) == (5, 30, 10)
    assert summary.statuses == {"correct": 15, "wrong": 10, "invalid": 0, "timeout": 0, "env_failure": 0,
                                "infra_error": 5}
    assert summary.pass_rate == pytest.approx(15 / 25)  # infra errors are not failures
    assert json.loads((out / "summary.json").read_text())["kept"] == 10
    led = Ledger(out / "ledger")
    assert led.steps() == [1, 2] and [m["kept"] for m in led.read_metrics()] == [6, 4]
    trajs = led.read_trajectories()
    assert len(trajs) == 30
    kept = [t for t in trajs if t.meta["kept"]]
    assert [t.traj_id.rsplit("/", 1)[1] for t in kept] == ["0", "4"] * 5  # distinct first: not j = 2
    assert all(t.status is Status.CORRECT for t in kept)
    assert all(not t.meta["kept"] for t in trajs if t.status is Status.INFRA_ERROR)
    rows = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    # the SFT stage's data is the ledger's kept rows: same trajectories, same texts, their prompts
    prompts = {ex.prompt_id: ex.prompt for s, n in ((0, 3), (3, 2))
               for ex in rs.train_prompts(cfg, build_task(cfg), n, s)}
    assert [(r["source"], r["completion"], r["prompt"]) for r in rows] == [
        (t.traj_id, t.meta["response"], prompts[t.prompt_id]) for t in kept]
    # ... rendered by trainer: sft to the very prompt ids the engine sampled after
    sft_cfg = load_run_config("sft", ["model.path=builtin:micro", f"sft.data={out / 'sft.jsonl'}",
                                      f"sft.heldout_data={out / 'sft.jsonl'}"])
    tok, _ = build_model(sft_cfg)
    train, _ = load_rows(sft_cfg)
    by_src = {r["source"]: i for i, r in enumerate(rows)}
    encoded = {e.source: e for e in encode_rows(sft_cfg, tok, train)}
    for t in kept:
        e = encoded[f"{out / 'sft.jsonl'}: row {by_src[t.traj_id]}"]
        first, n_prompt = e.loss_mask.index(1), int(t.action_mask.argmax())
        assert list(e.input_ids[:first]) == [int(x) for x in t.token_ids[:n_prompt]]


def test_prompts_are_the_rl_runs_and_heldout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_run_config("grpo", BASE)
    task = build_task(cfg)
    fake = types.SimpleNamespace(cfg=cfg, task=task, state=types.SimpleNamespace(cursor=0), step_examples={})
    first, second = Run.next_prompts(fake, task, 3), Run.next_prompts(fake, task, 2)  # type: ignore[arg-type]
    assert rs.train_prompts(cfg, task, 3, 0) == first and rs.train_prompts(cfg, task, 2, 3) == second
    held = rs.heldout_problems(cfg, task)
    assert list(held) == ["heldout"] and len(held["heldout"][0]) == 20
    rs.refuse_heldout(first, held, "chain_sum")  # disjoint by construction
    leak = task.examples("heldout", 20, seed=cfg.eval.heldout_seed_of(cfg.seed))[3]
    with pytest.raises(ValueError, match=re.escape(f"training prompt '{leak.prompt_id}' is in the heldout set")):
        rs.refuse_heldout([*first, leak], held, "chain_sum")
    same_text = TaskExample(prompt_id="other", prompt=leak.prompt, reference=0)
    with pytest.raises(ValueError, match="is in the heldout set"):
        rs.refuse_heldout([same_text], held, "chain_sum")


def test_sft_trains_on_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, summary, out = _sample(tmp_path, monkeypatch, keep=3)
    assert summary.kept == 15
    data = out / "sft.jsonl"
    assert main(["train", "sft", f"sft.data={data}", f"sft.heldout_data={data}", "model.path=builtin:micro",
                 "task.chat_template=auto", "steps=2", "eval.every=2", f"run_dir={tmp_path / 'sft'}",
                 "--no-progress"]) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    assert (tmp_path / "sft" / "checkpoints" / "step_000002" / "actor" / "config.json").is_file()


def test_refuses_what_it_cannot_sample(tmp_path: Path) -> None:
    for recipe, overrides, needle in (("sft", ["model.path=builtin:micro"], "trainer=sft samples no task"),
                                      ("grpo", [*BASE, "env.name=calculator_tool"], "multi-turn episodes")):
        with pytest.raises(ValueError, match=needle):
            rs.rejection_sample(load_run_config(recipe, overrides), tmp_path, k=2, prompts=2, keep_per_prompt=1)


def test_the_sft_loader_reads_back_exactly_the_ledgers_kept_rows(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``trainer: sft`` loads (posttrain/envs/sft_data.py) is the ledger's kept samples, in ledger order: each
    row's user turn is the prompt of its trajectory, its one trained turn the sampled text, nothing else."""
    cfg, summary, out = _sample(tmp_path, monkeypatch, keep=3)
    kept = [t for t in Ledger(out / "ledger").read_trajectories() if t.meta["kept"]]
    assert len(kept) == summary.kept == 15  # j = 0, 2, 4 of each of 5 prompts (j = 2 repeats j = 0's text)
    prompts = {ex.prompt_id: ex.prompt for s, n in ((0, 3), (3, 2)) for ex in rs.train_prompts(cfg, build_task(cfg), n, s)}
    rows = load_sft_rows(out / "sft.jsonl")
    assert [(r.messages, r.trained, r.text) for r in rows] == [
        (({"role": "user", "content": prompts[t.prompt_id]}, {"role": "assistant", "content": t.meta["response"]}),
         (False, True), True) for t in kept]


def test_a_pass_cut_between_a_steps_trajectories_and_metrics_resumes_to_the_same_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _hand_judged(monkeypatch)
    cfg = load_run_config("grpo", BASE)
    straight = rs.rejection_sample(cfg, tmp_path / "straight", k=6, prompts=5, keep_per_prompt=2)
    out = tmp_path / "rs"
    real = Ledger.write_metrics

    def crash_at_step_2(self: Ledger, step: int, metrics: Any) -> Path:
        if step == 2:
            raise RuntimeError("killed")
        return real(self, step, metrics)

    monkeypatch.setattr(Ledger, "write_metrics", crash_at_step_2)
    with pytest.raises(RuntimeError, match="killed"):
        rs.rejection_sample(cfg, out, k=6, prompts=5, keep_per_prompt=2)
    led = Ledger(out / "ledger")
    assert (led.steps(), led.steps("metrics")) == ([1, 2], [1])  # step 2's samples written, its metrics not
    assert not (out / "sft.jsonl").exists() and not (out / "summary.json").exists()
    monkeypatch.setattr(Ledger, "write_metrics", real)
    resumed = rs.rejection_sample(cfg, out, k=6, prompts=5, keep_per_prompt=2, resume=True)
    assert resumed.resumed_after_step == 1
    assert [f.name.split(".")[0] for f in (out / "ledger" / "discarded" / "trajectories").iterdir()] == ["step_000002"]
    assert dataclasses.replace(resumed, wall_s=0, resumed_after_step=0) == dataclasses.replace(straight, wall_s=0)
    assert (out / "sft.jsonl").read_text() == (tmp_path / "straight" / "sft.jsonl").read_text()
    a, b = led.read_trajectories(), Ledger(tmp_path / "straight" / "ledger").read_trajectories()
    assert [(t.traj_id, t.token_ids.tolist(), t.status, t.meta["kept"]) for t in a] == [
        (t.traj_id, t.token_ids.tolist(), t.status, t.meta["kept"]) for t in b]
    assert led.read_metrics() == Ledger(tmp_path / "straight" / "ledger").read_metrics()
    # the request is checked: another recipe is refused before anything is built or written
    with pytest.raises(ValueError, match=r"was sampled with another recipe \(sampling\.temperature: 1\.0 -> 0\.5\)"):
        rs.rejection_sample(load_run_config("grpo", [*BASE, "sampling.temperature=0.5"]), out, k=6, prompts=5,
                            keep_per_prompt=2, resume=True)
    (out / rs.REQUEST_FILE).unlink()
    with pytest.raises(ValueError, match="holds a ledger but no request.json"):
        rs.rejection_sample(cfg, out, k=6, prompts=5, keep_per_prompt=2, resume=True)
