"""The format warm-up of ``smollm2_tool_calc_warm`` alone, measured per seed before any RL (issue 43).

    python scripts/tool_warmup_probe.py TAG SEEDS [KEY=VALUE ...]       # e.g. shipped 0,1,2

For each seed: the recipe's SFT warm-up (:func:`posttrain.loop.warmup.sft_warmup`, with the overrides), then the
held-out problems played as a run's evaluation plays them, greedy and at the training temperature
(``sampling.temperature``). Prints one JSON line per seed: the share of held-out episodes with at least one tool
call (``*_called_frac``), the share solved (``*_success``), the first three episodes' text from the first action
on, the warm-up's last SFT loss and the wall time. The sampled share is what RL's first groups see: a seed whose
warm-up leaves it near 0 gives RL no call that pays (docs/models.md, "the warm-up is a coin flip").
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from posttrain.loop.episode_rollout import EpisodeRollout, context_limit, run_episodes, turn_seed
from posttrain.loop.parts import Parts
from posttrain.loop.rollout_stage import RolloutStage
from posttrain.loop.run import open_run
from posttrain.loop.validate import load_run_config
from posttrain.loop.warmup import sft_warmup
from posttrain.trajectory import Role

RECIPE = "smollm2_tool_calc_warm"
BASE_OVERRIDES = ["steps=0", "logging.progress=false", "eval.size=50", "eval.heldout_seed=0"]


def play_heldout(parts: Parts, temperature: float) -> tuple[float, float, list[str]]:
    """``(share of held-out episodes with a tool call, share solved, first 3 episodes' texts)`` of the engine's
    weights at ``temperature`` (0 = greedy), each episode seeded as a run's evaluation seeds it."""
    cfg = parts.cfg
    ro = EpisodeRollout(cfg, parts, RolloutStage.from_config(cfg))
    eps = [ro.new_episode(ex, traj_id=f"h{i}", group_id=f"h{i}") for i, ex in enumerate(parts.heldout)]
    run_episodes(parts.engine, eps, ro.sampling(temperature=temperature), context=context_limit(parts),
                 seed_of=lambda e: turn_seed(cfg.seed, "t", e.traj_id, e.turns))
    trajs = [e.trajectory() for e in eps]
    called = sum(float(t.reward.components.get("tool_calls", 0.0)) > 0 for t in trajs) / len(trajs)
    solved = sum(t.status is not None and t.status.value == "correct" for t in trajs) / len(trajs)
    texts = []
    for t in trajs[:3]:
        start = t.roles.index(Role.ACTION) if Role.ACTION in t.roles else len(t.roles)
        texts.append(str(parts.tokenizer.decode(list(t.token_ids[start:])))[:200])
    return called, solved, texts


def probe(seed: int, overrides: list[str]) -> dict[str, object]:
    """The warm-up of ``seed`` with ``overrides``, then :func:`play_heldout` greedy and sampled."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        cfg = load_run_config(RECIPE, [f"run_dir={d}/run", *BASE_OVERRIDES, f"seed={seed}", *overrides])
        run = open_run(cfg)
        try:
            sft_warmup(run.parts, run.dir)
            losses = json.loads((run.dir / "sft_losses.json").read_text())
            g_called, g_solved, g_texts = play_heldout(run.parts, 0.0)
            s_called, s_solved, s_texts = play_heldout(run.parts, cfg.sampling.temperature)
        finally:
            run.close()
    return {"seed": seed, "greedy_called_frac": g_called, "greedy_success": g_solved,
            "sampled_called_frac": s_called, "sampled_success": s_solved, "loss_last": round(losses[-1], 3),
            "wall_s": round(time.time() - t0), "greedy_texts": g_texts, "sampled_texts": s_texts}


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    tag, seeds, overrides = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3:]
    for seed in seeds:
        print(json.dumps({"tag": tag, **probe(seed, overrides)}), flush=True)


if __name__ == "__main__":
    main()
