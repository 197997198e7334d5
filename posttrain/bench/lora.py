"""LoRA vs full fine-tuning: learner step time and peak memory on one real model, side by side.

Both arms run the same policy update (the recipe's loss, reduction and optimiser, one optimiser step
per update, pi_old fused from the update's forward) on the same synthetic rollout batch of ``--rows``
rows x (``--prompt-tokens`` + ``--new-tokens``) tokens with random advantages. Each arm runs in its
own fresh process so its peak resident memory (``ru_maxrss``) is its own; the arms alternate for
``--repeats`` rounds so a change in machine load hits both. Reported: median seconds per update,
peak RSS, trainable parameters and optimiser-state bytes, and LoRA / full ratios. LoRA: Hu et al.
2021 (arXiv:2106.09685), through peft.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ARMS = ("full", "lora")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``posttrain bench lora``."""
    parser.add_argument("--recipe", default="smollm2_word_problems", help="recipe giving the model, loss and optimiser")
    parser.add_argument("--rows", type=int, default=32, help="rollout rows per update (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=56)
    parser.add_argument("--new-tokens", type=int, default=72)
    parser.add_argument("--updates", type=int, default=3, help="timed updates per arm and round (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; arms alternate within each round")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-target", default="all-linear", help="lora.target_modules of the LoRA arm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per arm (default: torch's)")
    parser.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # one arm, in a child process


def _arm(args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this process: build the learner, one warm-up update, then ``--updates`` timed ones."""
    import time

    import torch

    from posttrain.loop.builders import build_model, build_policy_learner
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory.collate import collate
    from posttrain.trajectory.record import make_trajectory

    if args.threads:
        torch.set_num_threads(args.threads)
    over = ["lora.rank=0"] if args.arm == "full" else [f"lora.rank={args.lora_rank}",
                                                        f"lora.target_modules={args.lora_target}"]
    cfg = load_run_config(args.recipe, over)
    tok, model = build_model(cfg)
    learner = build_policy_learner(cfg, model)
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    trajs = [make_trajectory(traj_id=f"t{i}", prompt_id=f"p{i // 4}", group_id=f"g{i // 4}",
                             prompt_ids=torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist(),
                             action_ids=torch.randint(3, vocab, (args.new_tokens,), generator=g).tolist(),
                             action_logprobs=[-2.0] * args.new_tokens, action_versions=0, finish="terminal")
             for i in range(args.rows)]
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    adv = torch.randn(args.rows, generator=g, dtype=torch.float64)
    fuse = bool(learner.can_fuse_old_logprob())
    times = []
    for i in range(args.updates + 1):
        t0 = time.perf_counter()
        learner.update(batch, adv, fuse_old=fuse)
        if i:  # the first update pays one-time allocations
            times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    opt_bytes = sum(t.numel() * t.element_size() for st in learner.optimizer.state.values()
                    for t in st.values() if torch.is_tensor(t))
    return {"arm": args.arm, "update_s": times, "trainable_params": trainable, "optimizer_state_bytes": opt_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "tokens_per_update": args.rows * (args.prompt_tokens + args.new_tokens)}


def _child(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "posttrain.cli", "bench", "lora", "--arm", arm, "--recipe", args.recipe,
           "--rows", str(args.rows), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--updates", str(args.updates), "--lora-rank", str(args.lora_rank), "--lora-target", args.lora_target]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if p.returncode != 0:
        raise RuntimeError(f"bench lora: the {arm} arm failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    """Run both arms ``--repeats`` times, alternating; print a table and ratios (``--json`` too)."""
    if args.arm is not None:
        print(json.dumps(_arm(args)))
        return 0
    for key in ("rows", "prompt_tokens", "new_tokens", "updates", "repeats", "lora_rank"):
        if getattr(args, key) < 1:
            raise ValueError(f"bench lora: --{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    res: dict[str, dict[str, Any]] = {a: {"update_s": [], "peak_rss_bytes": 0} for a in ARMS}
    for r in range(args.repeats):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            out = _child(args, arm)
            print(f"round {r + 1}/{args.repeats} {arm}: " + ", ".join(f"{t:.2f}" for t in out["update_s"]) + " s/update",
                  flush=True)
            res[arm]["update_s"] += out["update_s"]
            res[arm]["peak_rss_bytes"] = max(res[arm]["peak_rss_bytes"], out["peak_rss_bytes"])
            res[arm].update({k: out[k] for k in ("trainable_params", "optimizer_state_bytes", "tokens_per_update")})
    for arm in ARMS:
        res[arm]["median_update_s"] = statistics.median(res[arm]["update_s"])
    full, lora = res["full"], res["lora"]
    summary = {"recipe": args.recipe, "rows": args.rows, "tokens_per_row": args.prompt_tokens + args.new_tokens,
               "lora_rank": args.lora_rank, "lora_target": args.lora_target, "loadavg_1m": os.getloadavg()[0],
               "arms": res, "step_time_ratio_lora_vs_full": lora["median_update_s"] / full["median_update_s"],
               "peak_rss_ratio_lora_vs_full": lora["peak_rss_bytes"] / full["peak_rss_bytes"]}
    gib = 1024**3
    print(f"{'arm':<5} {'s/update':>9} {'peak RSS GiB':>13} {'trainable':>12} {'optim state MiB':>16}")
    for arm in ARMS:
        a = res[arm]
        print(f"{arm:<5} {a['median_update_s']:>9.2f} {a['peak_rss_bytes'] / gib:>13.2f} {a['trainable_params']:>12,} "
              f"{a['optimizer_state_bytes'] / 2**20:>16.1f}")
    print(f"LoRA / full: step time {summary['step_time_ratio_lora_vs_full']:.2f}x, "
          f"peak memory {summary['peak_rss_ratio_lora_vs_full']:.2f}x (load average {summary['loadavg_1m']:.1f})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    return 0
