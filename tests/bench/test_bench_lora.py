"""``posttrain bench lora``: both arms run the recipe's update in their own process; the LoRA arm trains
only adapters, and the optimiser state follows the trainable parameters (AdamW: two fp32 moments each)."""

import json

from posttrain.cli import main


def test_bench_lora_reports_both_arms_and_ratios(tmp_path, capsys):
    out = tmp_path / "lora.json"
    rc = main(["bench", "lora", "--json", str(out), "--recipe", "grpo", "--rows", "4", "--prompt-tokens", "6",
               "--new-tokens", "4", "--updates", "1", "--repeats", "2", "--lora-rank", "4", "--threads", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    full, lora = res["arms"]["full"], res["arms"]["lora"]
    assert len(full["update_s"]) == len(lora["update_s"]) == 2 and res["tokens_per_row"] == 10
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 4
    for arm in (full, lora):
        # exp_avg + exp_avg_sq in float32 per trainable parameter, plus one scalar step per tensor
        assert 8 * arm["trainable_params"] <= arm["optimizer_state_bytes"] <= 8 * arm["trainable_params"] + 8 * 1000
        assert arm["peak_rss_bytes"] > 0 and arm["median_update_s"] > 0
    assert res["step_time_ratio_lora_vs_full"] > 0 and res["peak_rss_ratio_lora_vs_full"] > 0
    assert "LoRA / full: step time" in capsys.readouterr().out


def test_bench_lora_rejects_bad_sizes(capsys):
    assert main(["bench", "lora", "--rows", "0"]) != 0
    assert "--rows must be >= 1" in capsys.readouterr().err
