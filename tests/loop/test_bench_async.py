"""``posttrain bench async --quick``: the CLI smoke test (figures are never asserted as timings)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from posttrain.bench import async_modes


@pytest.mark.timeout(180)
def test_bench_async_quick_writes_speedup_per_mode(tmp_path):
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "bench", "async", "--quick", "--steps", "2", "--sft-steps", "5",
                        "--intra-op-threads", "1", "--sync-threads", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["speedup_vs_sync"]) == {"sync", "one_step_off", "async", "partial"}
    assert res["speedup_vs_sync"]["sync"] == 1.0
    for r in res["modes"]:
        assert r["steps"] == 2 and r["generated_tokens"] > 0 and 0 <= r["group_idle_frac"] < 1
        assert sum(r["lag_hist"].values()) == r["samples_trained"]
    lag = {r["mode"]: r["lag_hist"] for r in res["modes"]}
    assert lag["sync"]["1"] == 0 and lag["one_step_off"]["1"] > 0  # the modes really differ
    assert "| mode | tokens/s |" in p.stdout and "(5 SFT steps" in p.stdout
    split = {r["mode"]: r["threads_per_side"] for r in res["modes"]}
    assert split["sync"]["concurrent"] is False and split["async"]["concurrent"] is True
    # --sync-threads: the modes that do not overlap get their own thread count, the overlapping ones one per side
    threads = {r["mode"]: r["torch_threads"] for r in res["modes"]}
    assert threads == {"sync": 2, "partial": 2, "one_step_off": 1, "async": 1}, threads
    assert res["shape"] == "letter_run" and res["threads"] == 1 and res["sync_threads"] == 2
    checks = {r["mode"]: r.get("overlap_check") for r in res["modes"]}
    assert checks["sync"] is None and checks["partial"] is None
    assert checks["one_step_off"]["predicted_step_s"] > 0 and checks["one_step_off"]["measured_step_s"] > 0
    assert "overlap check, one_step_off:" in p.stdout


def test_the_overlap_check_replays_an_overlapped_runs_own_split():
    # one_step_off, 2 steps: call 0 takes 2 s alone (the learner waits), call 1 (2 s) runs beside step 1's 3 s update.
    # By hand: P0 = 2, C0 = 2 + 3 = 5; P1 = 2 + 2 = 4, C1 = max(5, 4) + 3 = 8: 4 s a step, as measured (8 s / 2).
    def row(mode: str, wait: list[float], wall: float) -> dict:
        return {"mode": mode, "process": "in_process", "wall_s": wall,
                "step_split": {"rollout_s": [2.0, 2.0], "learner_s": [3.0, 3.0], "sync_s": [0.0, 0.0], "idle_frac": [],
                               "wait_s": wait}}

    rows = [row("sync", [], 10.0), row("one_step_off", [2.0, 0.0], 8.0)]
    async_modes.predictions(rows)
    assert "overlap_check" not in rows[0]
    assert rows[1]["overlap_check"] == {"predicted_step_s": 4.0, "measured_step_s": 4.0}
    assert rows[1]["model"]["speedup"] == pytest.approx(10.0 / 8.0)  # from the sync split: 2 + 3 a step vs 8 / 2


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    async_modes.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_realistic_shape_is_the_vs_trl_realistic_run_in_each_mode(tmp_path):
    """Every mode of ``--shape realistic`` loads the realistic recipe and shape of ``bench vs-trl``, from the
    pretrained model, with only ``system.*`` / the correction differing between modes."""
    from posttrain.bench.vs_trl import REALISTIC_RECIPE
    from posttrain.loop.validate import load_run_config

    p = async_modes._shape_params(_args("--shape", "realistic"))
    assert async_modes._recipe(p) == REALISTIC_RECIPE and p["sft_steps"] == 0
    cfgs = {m: load_run_config(async_modes._recipe(p), [*async_modes._base(p, 3), f"model.path={p['model']}",
                                                         "steps=4", f"run_dir={tmp_path / m}", *ov])
            for m, ov in async_modes.MODES.items()}
    for cfg in cfgs.values():
        assert (cfg.sampling.prompts_per_step, cfg.sampling.group_size, cfg.sampling.max_new_tokens) == (4, 8, 128)
        assert cfg.model.path == "builtin:smollm2-135m-instruct" and cfg.seed == 3 and cfg.sft.steps == 0
        assert cfg.eval.size == 48 and cfg.eval.sampled_temperature is None and cfg.checkpoint_every == 0
        assert cfg.optim.lr == cfgs["sync"].optim.lr  # the recipe's own rate in every mode
    assert {m: c.system.mode for m, c in cfgs.items()} == {
        "sync": "sync", "one_step_off": "one_step_off", "async": "async", "partial": "sync"}
    assert cfgs["sync"].correction.name is None and cfgs["async"].correction.name == "tis"
    assert async_modes._shape_params(_args("--shape", "realistic", "--lr", "3e-5"))["lr"] == 3e-5


# (--quick where the refusal is of a value: were it accepted, only the micro smoke test would start)
@pytest.mark.parametrize("argv, says", [
    (("--shape", "realistic", "--quick"), "--quick"),
    (("--shape", "realistic", "--sft-steps", "2"), "no warm-up"),
    (("--quick", "--sync-threads", "0"), "--sync-threads must be >= 1"),
    (("--quick", "--steps", "0"), "--steps must be >= 1"),
])
def test_the_bench_refuses_what_cannot_take_effect(argv, says):
    with pytest.raises(SystemExit, match=says):
        async_modes.run(_args(*argv))
