"""Peak memory of one learner update: full-vocabulary logits (before) vs the chunked LM head (after).

For each recipe (its model, loss and optimiser) and each micro-batch size in ``--tokens``, one policy
update runs on a synthetic rollout batch of ``tokens / (prompt + new tokens)`` rows, all in one
micro-batch (``optim.microbatch_tokens = tokens``), pi_old fused from the update's forward, one
optimiser step; ``--batch-tokens`` makes the update hold that many tokens, split into micro-batches of
``--tokens`` (step time at equal work across micro-batch sizes), ``--updates`` times several updates per
child (``steady_update_s``: the median after the first). Two paths: ``full`` runs the model's own forward to ``[tokens x vocab]`` logits
(:class:`posttrain.learner.logprobs.FullLogits`, the path before the chunked head), ``chunked`` the
backbone plus :mod:`posttrain.learner.chunked_head` (Wijmans et al. 2024, arXiv:2411.09009); ``+ckpt``
(only when asked) adds activation checkpointing of the decoder layers
(``ComputeSettings.gradient_checkpointing``; Chen et al. 2016, arXiv:1604.06174). Each
measurement runs in a fresh process, so its peak resident memory (``ru_maxrss``) is its own; a child
whose RSS passes ``--rss-limit-gb`` stops itself and is reported as over the limit (a shared machine
is never pushed into swap or the OOM killer). Memory is not timing: the figures hold under load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TypedDict

PATHS = ("full", "chunked", "full+ckpt", "chunked+ckpt")
EXIT_OVER_LIMIT = 3


class Measurement(TypedDict, total=False):
    """One child's report (``over_limit``: it stopped itself at ``rss_limit_bytes``)."""

    recipe: str
    model: str
    path: str
    tokens: int
    rows: int
    vocab: int
    rss_before_update_bytes: int
    peak_rss_bytes: int
    update_s: float
    batch_tokens: int
    update_s_runs: list[float]
    steady_update_s: float
    over_limit: bool
    rss_limit_bytes: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``posttrain bench memory``."""
    parser.add_argument("--recipes", default="smollm2_word_problems,grpo",
                        help="comma-separated recipes giving model, loss and optimiser (default: SmolLM2 and tiny)")
    parser.add_argument("--tokens", default="1024,4096,8192", help="tokens per micro-batch, comma-separated")
    parser.add_argument("--paths", default="full,chunked",
                        help="comma-separated from full (logits), chunked (LM head), full+ckpt, chunked+ckpt "
                             "(+ activation checkpointing); default full,chunked")
    parser.add_argument("--prompt-tokens", type=int, default=56)
    parser.add_argument("--new-tokens", type=int, default=72)
    parser.add_argument("--rss-limit-gb", type=float, default=None,
                        help="a child stops itself past this RSS (default: 80%% of the memory available now)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per child (default: torch's)")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tokens per update, split into micro-batches of --tokens (default: one micro-batch); "
                             "compares step time at equal work across micro-batch sizes")
    parser.add_argument("--updates", type=int, default=1,
                        help="updates per child (default 1); with more, steady_update_s is the median of all "
                             "but the first")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # RECIPE:TOKENS:PATH, in a child process


def _rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("bench memory: /proc/meminfo has no MemAvailable")


def _watch_rss(limit: int, report: Measurement) -> None:
    """A daemon thread: past ``limit`` bytes of RSS, print ``report`` marked over the limit and exit."""
    def watch() -> None:
        while True:
            if _rss_bytes() > limit:
                report["over_limit"], report["rss_limit_bytes"] = True, limit
                print(json.dumps(report), flush=True)
                os._exit(EXIT_OVER_LIMIT)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def _measure(args: argparse.Namespace) -> Measurement:
    """One measurement in this process: build the recipe's learner on the chosen path, one update."""
    import torch

    from posttrain.learner.actor import PolicyLearner
    from posttrain.learner.logprobs import FullLogits
    from posttrain.loop.builders import build_kl_coef, build_model, policy_settings
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory.collate import collate
    from posttrain.trajectory.record import make_trajectory

    recipe, tokens_s, path = args.one.split(":")
    tokens = int(tokens_s)
    if args.threads:
        torch.set_num_threads(args.threads)
    row = args.prompt_tokens + args.new_tokens
    micro_rows = max(1, tokens // row)
    rows = max(micro_rows, (args.batch_tokens or tokens) // row)
    # one optimiser step per update over micro-batches of micro_rows rows; full fine-tuning (FullLogits is
    # no peft model)
    cfg = load_run_config(recipe, [f"optim.microbatch_tokens={micro_rows * row}", "optim.num_minibatches=1",
                                   "optim.ppo_epochs=1", "lora.rank=0"])
    tok, model = build_model(cfg)
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    report: Measurement = {"recipe": recipe, "model": cfg.model.path, "path": path, "tokens": micro_rows * row,
                           "rows": rows, "batch_tokens": rows * row, "vocab": vocab}
    _watch_rss(int(args.rss_limit_gb * 1024**3), report)
    s = policy_settings(cfg)
    head, _, ckpt = path.partition("+")
    learner = PolicyLearner(FullLogits(model) if head == "full" else model, optim=s.optim, batching=s.batching,
                            loss=s.loss, sampler=s.sampler, lora=s.lora, kl_coef=build_kl_coef(cfg),
                            compute=dataclasses.replace(s.compute, gradient_checkpointing=ckpt == "ckpt"))
    g = torch.Generator().manual_seed(0)
    trajs = [make_trajectory(traj_id=f"t{i}", prompt_id=f"p{i // 4}", group_id=f"g{i // 4}",
                             prompt_ids=torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist(),
                             action_ids=torch.randint(3, vocab, (args.new_tokens,), generator=g).tolist(),
                             action_logprobs=[-2.0] * args.new_tokens, action_versions=0, finish="terminal")
             for i in range(rows)]
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    report["rss_before_update_bytes"] = _rss_bytes()
    runs: list[float] = []
    for _ in range(max(1, args.updates)):
        t0 = time.perf_counter()
        learner.update(batch, adv, fuse_old=bool(learner.can_fuse_old_logprob()))
        runs.append(time.perf_counter() - t0)
    report["update_s"], report["update_s_runs"] = runs[0], runs
    if len(runs) > 1:
        report["steady_update_s"] = statistics.median(runs[1:])
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["over_limit"] = False
    return report


def _child(args: argparse.Namespace, recipe: str, tokens: int, path: str) -> Measurement:
    cmd = [sys.executable, "-m", "posttrain.cli", "bench", "memory", "--one", f"{recipe}:{tokens}:{path}",
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--rss-limit-gb", str(args.rss_limit_gb), "--updates", str(args.updates)]
    if args.batch_tokens:
        cmd += ["--batch-tokens", str(args.batch_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if p.returncode not in (0, EXIT_OVER_LIMIT):
        raise RuntimeError(f"bench memory: {recipe} at {tokens} tokens ({path}) failed (exit {p.returncode}): "
                           f"{p.stderr.strip()[-2000:]}")
    out: Measurement = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _csv(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"bench memory: --{what} is empty")
    return items


def run(args: argparse.Namespace) -> int:
    """Every recipe x tokens x path in its own process; print a table of peak RSS (``--json`` too)."""
    if args.rss_limit_gb is None:
        args.rss_limit_gb = round(0.8 * _available_bytes() / 1024**3, 2)
    if args.one is not None:
        print(json.dumps(_measure(args)))
        return 0
    tokens = [int(t) for t in _csv(args.tokens, "tokens")]
    paths = _csv(args.paths, "paths")
    bad = [p for p in paths if p not in PATHS]
    if (bad or min(tokens) < 1 or args.prompt_tokens < 1 or args.new_tokens < 1 or not args.rss_limit_gb > 0
            or args.updates < 1 or (args.batch_tokens is not None and args.batch_tokens < max(tokens))):
        raise ValueError(f"bench memory: need --paths from {', '.join(PATHS)} (got {bad or paths}), --tokens, "
                         f"--prompt-tokens, --new-tokens, --updates >= 1, --batch-tokens >= every --tokens "
                         f"and --rss-limit-gb > 0")
    gib = 1024**3
    load_before = os.getloadavg()[0]
    results: list[Measurement] = []
    print(f"{'recipe':<24} {'tokens':>6} {'path':<12} {'before update GiB':>17} {'peak RSS GiB':>13} "
          f"{'update s':>9}", flush=True)
    for recipe in _csv(args.recipes, "recipes"):
        for n in tokens:
            for path in paths:
                m = _child(args, recipe, n, path)
                results.append(m)
                peak = f"> {args.rss_limit_gb:.2f}" if m["over_limit"] else f"{m['peak_rss_bytes'] / gib:.2f}"
                before = m.get("rss_before_update_bytes")
                secs = m.get("steady_update_s", m.get("update_s", float("nan")))
                print(f"{recipe:<24} {m['tokens']:>6} {path:<12} "
                      f"{(before / gib if before else float('nan')):>17.2f} {peak:>13} {secs:>9.2f}", flush=True)
    load = os.getloadavg()[0]
    print(f"(load average {load:.1f}; each row a fresh process; limit {args.rss_limit_gb:.2f} GiB)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"loadavg_1m": load, "loadavg_1m_before": load_before,
                                                    "rss_limit_gb": args.rss_limit_gb,
                                                    "batch_tokens": args.batch_tokens, "updates": args.updates,
                                                    "prompt_tokens": args.prompt_tokens,
                                                    "new_tokens": args.new_tokens, "results": results}, indent=2))
    return 0
