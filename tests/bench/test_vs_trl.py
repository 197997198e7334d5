"""``posttrain bench vs-trl --quick``: both sides train from one SFT checkpoint and the JSON has the figures.

A smoke test of the wiring (no timing assertion: benchmarks are never timed tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from posttrain.bench import vs_trl
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.config import RunConfig


def test_vs_trl_quick_writes_json_and_both_sides_train(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", dest="json_path", default=None)
    vs_trl.add_arguments(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(["--quick", "--threads", "1", "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    level_before = logging.getLogger("posttrain").level
    assert vs_trl.run(args) == 0
    assert logging.getLogger("posttrain").level == level_before  # the bench quiets the loop only while it runs
    res = json.loads(out.read_text())
    for key in ("speedup_vs_trl", "posttrain_heldout_accuracy", "trl_heldout_accuracy", "sft_heldout_accuracy"):
        assert isinstance(res[key], float) and math.isfinite(res[key]), key
    assert res["speedup_vs_trl"] > 0
    for side in ("posttrain", "trl"):
        d = res[side]
        assert d["steps"] == res["steps"] == vs_trl.QUICK_STEPS
        assert d["weight_delta_l2"] > 0, f"{side}: weights did not change"
        assert d["generated_tokens"] > 0
        assert 0.0 <= d["heldout_accuracy"] <= 1.0
        assert d["heldout"]["n"] == res["heldout_size"]


def test_vs_trl_realistic_shape_wiring_chat_prompts_no_sft(tmp_path: Path) -> None:
    """``--shape realistic`` on a micro model: no SFT (both start from the model itself), chat-rendered
    word problems whose text TRL tokenizes to posttrain's very prompt ids, last-number extraction."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", dest="json_path", default=None)
    vs_trl.add_arguments(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(["--shape", "realistic", "--steps", "2", "--threads", "1", "--work-dir",
                              str(tmp_path / "work"), "--json", str(out), "model.path=builtin:micro",
                              "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=6",
                              "eval.size=4"])
    assert vs_trl.run(args) == 0
    res = json.loads(out.read_text())
    assert res["shape"] == "realistic" and res["recipe"] == vs_trl.REALISTIC_RECIPE and res["task"] == "word_problems"
    assert set(res["speedup_vs_trl_by_shape"]) == {"realistic"} and res["speedup_vs_trl_by_shape"]["realistic"] > 0
    for side in ("posttrain", "trl"):
        # (a random micro model answers no word problem: all-zero groups, so no weight change is expected here;
        # the demo-shape test above checks that both sides train)
        assert res[side]["steps"] == 2 and res[side]["generated_tokens"] > 0


def test_trl_prompt_text_is_posttrains_rendering() -> None:
    from posttrain.loop.builders import build_model, build_renderer, build_task
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config(vs_trl.REALISTIC_RECIPE, ["model.path=builtin:micro"])
    tok, _ = build_model(cfg)
    exs = build_task(cfg).examples("train", 3, seed=0)
    texts = vs_trl._trl_prompt_texts(cfg, tok, exs)
    r = build_renderer(cfg, tok)
    assert r.chat and all(tok(t).input_ids == r.ids(ex) for t, ex in zip(texts, exs, strict=True))
    assert all(ex.prompt in t for t, ex in zip(texts, exs, strict=True))  # the problem, inside the template


# ------------------------------------------------------------------------------------------- --precision
# Cheap: the SFT, the two training runs and the held-out evaluation are stubbed; what is checked is what the
# bench hands each side, what it writes, and what it refuses (a real bf16 run is the smoke in docs/benchmarks.md).
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", dest="json_path", default=None)
    vs_trl.add_arguments(parser)
    return parser


def _flags(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> None:
    """This CPU's flags as the rollout engine's detection reads them (posttrain.rollout.precision.cpu_flags)."""
    from posttrain.rollout import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda *_a, **_k: frozenset(flags))


def _stub_sides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Stub the SFT, both sides and the evaluator; returns what each side was handed."""
    got: dict[str, Any] = {}
    side = {"steps": 3, "step_s": [1.0, 1.0, 1.0], "generated_tokens": 10.0, "step_s_mean": 1.0,
            "gen_tokens_per_s": 10.0, "heldout_accuracy": 0.5,
            "time_split_s": {"time/rollout_s": 0.1, "time/reward_s": 0.1, "time/learner_s": 0.1}}

    def run_posttrain(cfg: RunConfig, sft_dir: Path, work: Path, steps: int) -> dict[str, Any]:
        got["posttrain_cfg"] = cfg
        return dict(side)

    def run_trl(cfg: RunConfig, sft_dir: Path, work: Path, steps: int,
                precision: str = "fp32") -> dict[str, Any]:
        got["trl_cfg"], got["trl_precision"] = cfg, precision
        return dict(side)

    monkeypatch.setattr(vs_trl, "prepare_sft", lambda cfg, work, fresh=False: (tmp_path / "sft", 0.0))
    monkeypatch.setattr(vs_trl, "_load", lambda path: (None, None))
    monkeypatch.setattr(vs_trl, "evaluate_model", lambda model, tok, cfg: {"accuracy": 0.25, "n": cfg.eval.size})
    monkeypatch.setattr(vs_trl, "run_posttrain", run_posttrain)
    monkeypatch.setattr(vs_trl, "run_trl", run_trl)
    return got


def test_precision_flag_parses_default_fp32() -> None:
    assert _parser().parse_args([]).precision == "fp32"
    assert _parser().parse_args(["--precision", "bf16"]).precision == "bf16"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--precision", "fp16"])


def test_bf16_sets_both_posttrain_keys_and_trls_bf16(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _flags(monkeypatch, {"avx512f", "avx512_bf16"})
    got = _stub_sides(monkeypatch, tmp_path)
    args = _parser().parse_args(["--quick", "--precision", "bf16", "--work-dir", str(tmp_path / "work")])
    assert vs_trl.run(args) == 0
    pcfg, tcfg = got["posttrain_cfg"], got["trl_cfg"]
    assert (pcfg.rollout.precision, pcfg.learner.precision) == ("bf16", "bf16")
    # TRL trains the float32 model under its own bf16 flag (the recipe's keys stay float32 on its side)
    assert got["trl_precision"] == "bf16" and (tcfg.rollout.precision, tcfg.learner.precision) == ("auto", "fp32")
    trl_args = vs_trl.trl_config(tcfg, tmp_path / "work", 3, got["trl_precision"])
    assert trl_args.bf16 is True and trl_args.fp16 is False and trl_args.use_cpu is True
    assert trl_args.mixed_precision == "bf16"  # what accelerate turns into torch.autocast("cpu", bfloat16)
    fp32_args = vs_trl.trl_config(tcfg, tmp_path / "work", 3, "fp32")
    assert fp32_args.bf16 is False and fp32_args.mixed_precision == "no"


def test_fp32_default_leaves_posttrain_keys_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    got = _stub_sides(monkeypatch, tmp_path)
    out = tmp_path / "out.json"
    args = _parser().parse_args(["--quick", "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    assert vs_trl.run(args) == 0
    assert got["posttrain_cfg"] is got["trl_cfg"] and got["trl_precision"] == "fp32"
    assert (got["posttrain_cfg"].rollout.precision, got["posttrain_cfg"].learner.precision) == ("auto", "fp32")
    res = json.loads(out.read_text())
    assert (res["posttrain_precision"], res["trl_precision"], res["trl_bf16"]) == ("fp32", "fp32", False)
    assert res["posttrain_precision_overrides"] == [] and set(res["cpu"]) >= {"name", "avx512_bf16", "amx_bf16"}


def test_json_and_table_name_both_precisions_and_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _flags(monkeypatch, {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(vs_trl, "cpu_name", lambda *_a: "Test CPU 9000")
    _stub_sides(monkeypatch, tmp_path)
    out = tmp_path / "out.json"
    args = _parser().parse_args(["--quick", "--precision", "bf16", "--work-dir", str(tmp_path / "work"),
                                 "--json", str(out)])
    assert vs_trl.run(args) == 0
    res = json.loads(out.read_text())
    assert res["precision"] == res["posttrain_precision"] == res["trl_precision"] == "bf16" and res["trl_bf16"] is True
    assert res["posttrain_precision_overrides"] == ["rollout.precision=bf16", "learner.precision=bf16"]
    assert "bf16" in res["precision_detail"]["posttrain"] and "bf16=True" in res["precision_detail"]["trl"]
    assert res["cpu"] == {"name": "Test CPU 9000", "avx512_bf16": True, "amx_bf16": False, "native_bf16": "AVX512_BF16"}
    text = capsys.readouterr().out
    assert "precision bf16: posttrain bf16 (rollout.precision=bf16" in text and "; TRL bf16 (bf16=True" in text
    row = next(line for line in text.splitlines() if line.startswith("precision ") and "same dtype" in line)
    assert row.split()[1:3] == ["bf16", "bf16"]  # the table's columns: posttrain, TRL
    assert "CPU: Test CPU 9000 (avx512_bf16 yes, amx_bf16 no)" in text


def test_cpu_facts_json_is_the_reports_cpu_object_key_for_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """:class:`vs_trl.CpuFacts` serialises to the ``cpu`` object the bench has always written: ``name``, one
    bool per key of ``BF16_CPU_FLAGS`` in sorted order, ``native_bf16`` (a new flag there fails this test)."""
    from posttrain.rollout import precision as rp

    _flags(monkeypatch, {"avx512f", "amx_bf16"})
    monkeypatch.setattr(vs_trl, "cpu_name", lambda *_a: "Test CPU 9000")
    cpu = vs_trl.cpu_facts()
    flags = rp.cpu_flags()
    before = {"name": "Test CPU 9000", **{flag: flag in flags for flag in sorted(rp.BF16_CPU_FLAGS)},
              "native_bf16": rp.native_bf16(flags)}
    assert json.dumps(cpu.as_json(), indent=1) == json.dumps(before, indent=1)
    assert cpu == vs_trl.CpuFacts("Test CPU 9000", amx_bf16=True, avx512_bf16=False, native_bf16="AMX-BF16")
    assert vs_trl._cpu_text(cpu) == "Test CPU 9000 (avx512_bf16 no, amx_bf16 yes)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu.name = "other"  # type: ignore[misc]


def test_bf16_refused_in_one_line_on_a_cpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from posttrain.cli import main

    _flags(monkeypatch, {"avx512f", "avx2"})
    got = _stub_sides(monkeypatch, tmp_path)
    work = tmp_path / "work"
    with pytest.raises(UserError, match=r"--precision bf16: refused on this CPU .*no avx512_bf16, no amx_bf16.*posttrain "
                       r"refuses rollout\.precision=bf16 and learner\.precision=bf16") as e:
        vs_trl.run(_parser().parse_args(["--quick", "--precision", "bf16", "--work-dir", str(work)]))
    assert "\n" not in str(e.value) and not got and not work.exists()  # nothing ran
    capsys.readouterr()
    assert main(["bench", "vs-trl", "--quick", "--precision", "bf16", "--work-dir", str(work)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "avx512_bf16" in err and not got
    assert vs_trl.run(_parser().parse_args(["--quick", "--work-dir", str(work)])) == 0  # fp32 still runs there


def test_precision_keys_as_overrides_are_refused(tmp_path: Path) -> None:
    args = _parser().parse_args(["--quick", "--work-dir", str(tmp_path / "work"), "learner.precision=bf16"])
    with pytest.raises(UserError, match=r"learner\.precision is set by --precision"):
        vs_trl.run(args)


def test_trl_precision_guards_refuse_a_silent_fp32() -> None:
    from types import SimpleNamespace

    vs_trl.check_trl_mixed_precision(SimpleNamespace(mixed_precision="bf16", native_amp=True), "bf16")
    vs_trl.check_trl_mixed_precision(SimpleNamespace(mixed_precision="no", native_amp=False), "fp32")
    with pytest.raises(RuntimeError, match="mixed_precision='no'"):
        vs_trl.check_trl_mixed_precision(SimpleNamespace(mixed_precision="no", native_amp=False), "bf16")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    seen, probe = vs_trl._linear_dtype_probe(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.ones(1, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.ones(1, 4))
    probe.remove()
    assert vs_trl.check_trl_dtypes_seen(seen, model, "bf16") == {
        "no_grad": ["bfloat16"], "grad": ["bfloat16"], "param_dtypes": ["float32"]}
    model(torch.ones(1, 4))  # the probe is gone: nothing more is recorded
    assert seen == {("no_grad", "bfloat16"), ("grad", "bfloat16")}
    with pytest.raises(RuntimeError, match="not bfloat16 throughout"):
        vs_trl.check_trl_dtypes_seen({("no_grad", "float32"), ("grad", "bfloat16")}, model, "bf16")
    with pytest.raises(RuntimeError, match="master weights"):
        vs_trl.check_trl_dtypes_seen(set(), model.to(torch.bfloat16), "bf16")
