"""``posttrain bench vs-trl --quick``: both sides train from one SFT checkpoint and the JSON has the figures.

A smoke test of the wiring (no timing assertion: benchmarks are never timed tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from posttrain.bench import vs_trl


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
