"""Rejection sampling for expert iteration: sample k answers per training prompt from the policy, keep those the
run's verifier marks ``correct``, and write them as SFT data (``posttrain sample``; docs/sft.md, "Expert
iteration").

This is the data step of STaR (Zelikman et al. 2022, "STaR: Bootstrapping Reasoning With Reasoning") and of
rejection-sampling fine-tuning (Yuan et al. 2023, "Scaling Relationship on Learning Mathematical Reasoning with
Large Language Models", RFT: k samples per problem, the correct ones kept, distinct reasoning paths first): the
kept samples are then trained on with ``trainer: sft`` and RL starts from that checkpoint.

Nothing here samples or judges on its own: the prompts are the RL run's (``task.examples("train", n, seed)`` at
the run's data cursor, :meth:`posttrain.loop.run.Run.next_prompts`), rendered by the run's renderer and sampled
and judged by :func:`~posttrain.loop.single_turn.play_once` (the path of held-out evaluation and ``posttrain
check``) under the run's guarded verification (``reward.workers`` / ``timeout_s`` / ``retries``, learned reward
components); only the number of samples per prompt is ``k`` instead of ``sampling.group_size``. A verifier
failure is an ``infra_error`` verdict: counted apart, never a failure, never kept.

Output directory::

    ledger/trajectories/step_000001.parquet   every sampled trajectory with its verdict (meta "kept": bool)
    ledger/metrics/step_000001.parquet        per-step counts (samples, kept, status/<name>)
    sft.jsonl                                 {"prompt", "completion", "source": traj_id} per kept sample
    summary.json                              prompts, samples, kept, per-status counts, pass rate, the command

A step of the ledger is one draw of ``sampling.prompts_per_step`` prompts (the last may be smaller), as an RL
step draws them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.loop.single_turn import play_once
from posttrain.trajectory import Ledger, Status

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.envs.task import Task, TaskExample
    from posttrain.trajectory.record import JSONScalar

PROMPT_SEED_STRIDE = 7_919
"""The run's prompt seed is ``seed * PROMPT_SEED_STRIDE + cursor`` (:meth:`posttrain.loop.run.Run.next_prompts`)."""


@dataclasses.dataclass(frozen=True)
class SampleSummary:
    """What one rejection-sampling pass did (written to ``summary.json``).

    ``pass_rate = correct / (samples - infra_error)``: the share of judged samples that are correct (an
    infra error says nothing about the policy); ``kept <= correct`` (``keep_per_prompt`` caps each prompt,
    and a correct sample whose text is blank cannot be an SFT row: ``blank_correct``)."""

    prompts: int
    samples: int
    kept: int
    statuses: dict[str, int]
    pass_rate: float | None
    prompts_with_kept: int
    blank_correct: int
    k: int
    keep_per_prompt: int
    wall_s: float
    command: str

    def as_json(self) -> dict[str, Any]:
        """The summary as a JSON object (``summary.json``)."""
        return dataclasses.asdict(self)


def select_kept(statuses: Sequence[Status], prompt_ids: Sequence[str], texts: Sequence[str],
                keep_per_prompt: int, already: Mapping[str, Sequence[str]] | None = None) -> list[bool]:
    """Which samples to keep: sample ``i`` qualifies iff ``statuses[i] is Status.CORRECT`` and ``texts[i]`` is not
    blank; of a prompt's qualifying samples (in sample order) at most ``keep_per_prompt`` are kept, the distinct
    texts first (RFT's distinct paths, Yuan et al. 2023), then repeats in sample order to fill the cap.
    ``already``: the texts kept for a prompt by earlier steps (a prompt drawn again): they count toward its cap
    and toward distinctness. ``infra_error`` (no verdict) and every other status are never kept."""
    if keep_per_prompt < 1:
        raise ValueError(f"keep_per_prompt must be >= 1, got {keep_per_prompt}")
    keep = [False] * len(statuses)
    by_prompt: dict[str, list[int]] = {}
    for i, (s, pid, text) in enumerate(zip(statuses, prompt_ids, texts, strict=True)):
        if s is Status.CORRECT and text.strip():
            by_prompt.setdefault(pid, []).append(i)
    for pid, idx in by_prompt.items():
        seen = set((already or {}).get(pid, ()))
        room = keep_per_prompt - len((already or {}).get(pid, ()))
        firsts = []
        for i in idx:
            if texts[i] not in seen:
                seen.add(texts[i])
                firsts.append(i)
        repeats = [i for i in idx if i not in set(firsts)]
        for i in (firsts + repeats)[:max(room, 0)]:
            keep[i] = True
    return keep


def train_prompts(cfg: RunConfig, task: Task, n: int, cursor: int) -> list[TaskExample]:
    """``n`` training prompts at data cursor ``cursor``, drawn as the RL run draws them:
    ``task.examples("train", n, seed=cfg.seed * PROMPT_SEED_STRIDE + cursor)``."""
    return list(task.examples("train", n, seed=cfg.seed * PROMPT_SEED_STRIDE + cursor))


def heldout_problems(cfg: RunConfig, task: Task) -> dict[str, tuple[set[str], set[str]]]:
    """Every held-out set the run would evaluate (``eval_splits``, ``eval.size`` prompts at
    ``eval.heldout_seed``, else ``seed``): ``{split: (prompt ids, prompt texts)}``."""
    from posttrain.loop.heldout import eval_splits

    seed = cfg.eval.heldout_seed_of(cfg.seed)
    out = {}
    for split in eval_splits(task):
        exs = task.examples(split, cfg.eval.size, seed=seed)
        out[split] = ({e.prompt_id for e in exs}, {e.prompt for e in exs})
    return out


def refuse_heldout(examples: Sequence[TaskExample], heldout: Mapping[str, tuple[set[str], set[str]]],
                   task_name: str) -> None:
    """``ValueError`` naming the prompt and the set when a training prompt is a held-out one (same prompt id or
    same text): the train split is disjoint by construction (envs/task.py), so this is a task's bug, and
    training on the held-out set would void every figure measured on it."""
    for ex in examples:
        for split, (ids, texts) in heldout.items():
            if ex.prompt_id in ids or ex.prompt in texts:
                raise ValueError(f"task {task_name!r}: training prompt {ex.prompt_id!r} is in the {split} set the "
                                 "run evaluates on; refusing to sample it (train and held-out splits must be disjoint)")


def sft_row(example: TaskExample, text: str, traj_id: str) -> dict[str, Any]:
    """The SFT row of a kept sample: ``{"prompt": example.prompt, "completion": text, "source": traj_id}`` (the
    string layout of docs/sft.md, rendered as the run renders ``example``); a chat prompt (``example.messages``)
    keeps its turns: ``{"prompt": [messages], "completion": [{"role": "assistant", "content": text}]}``."""
    if example.messages is not None:
        return {"prompt": [dict(m) for m in example.messages],
                "completion": [{"role": "assistant", "content": text}], "source": traj_id}
    return {"prompt": example.prompt, "completion": text, "source": traj_id}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def rejection_sample(cfg: RunConfig, out: Path, *, k: int, prompts: int, keep_per_prompt: int, command: str = "",
                     progress: Callable[[int, int, Mapping[str, int]], None] | None = None) -> SampleSummary:
    """Sample ``k`` completions for each of ``prompts`` training prompts of run config ``cfg`` (a single-turn RL
    recipe), judge them with the run's verifier, keep the correct ones (:func:`select_kept`) and write ``out``
    (module docstring). ``progress(step, steps, counts)`` after each ledger step. ``ValueError`` (one line) for a
    recipe that samples no task, an ``env.name`` (multi-turn) recipe, a prompt that does not fit the model, or a
    training prompt found in a held-out set (:func:`refuse_heldout`)."""
    import torch

    from posttrain.config.trainers import trainer_entry
    from posttrain.envs.task import check_prompts
    from posttrain.loop.builders import build_engine, build_model, build_renderer, build_task
    from posttrain.rewards import VerifierPool
    from posttrain.rewards.learned import build_learned_rewards
    from posttrain.rewards.scoring import ScoringSpec
    from posttrain.rollout.precision import engine_copy
    from posttrain.rollout.sampling import SamplingParams

    for name, v in (("k", k), ("prompts", prompts), ("keep_per_prompt", keep_per_prompt)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not trainer_entry(cfg.trainer).samples(cfg):
        raise ValueError(f"trainer={cfg.trainer} samples no task; rejection sampling needs an RL recipe's task")
    if cfg.env.name is not None:
        raise ValueError(f"env.name={cfg.env.name}: multi-turn episodes are not rejection-sampled yet; "
                         "use a single-turn task")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tok, model = build_model(cfg)
    task = build_task(cfg)
    renderer = build_renderer(cfg, tok)
    heldout = heldout_problems(cfg, task)
    s = cfg.sampling
    # the builtin engine in this process, computing as the run's builtin engine does (as `posttrain eval`)
    precision = cfg.rollout.precision if cfg.rollout.engine == "builtin" else "auto"
    engine = build_engine(engine_copy(model, precision), tok)
    pool = VerifierPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s, retries=cfg.reward.retries)
    verify = build_learned_rewards(cfg.reward, pool.verify_batch)
    spec = ScoringSpec.of(cfg.reward)
    ledger = Ledger(out / "ledger")
    statuses: Counter[str] = Counter()
    kept_texts: dict[str, list[str]] = {}
    rows: list[dict[str, Any]] = []
    samples = blank = 0
    steps = -(-prompts // s.prompts_per_step)
    try:
        for step in range(1, steps + 1):
            cursor = (step - 1) * s.prompts_per_step
            exs = train_prompts(cfg, task, min(s.prompts_per_step, prompts - cursor), cursor)
            refuse_heldout(exs, heldout, cfg.task.name)
            check_prompts(exs, tok, max_context=getattr(model.config, "max_position_embeddings", None),
                          max_new_tokens=s.max_new_tokens, renderer=renderer)
            params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_new_tokens=s.max_new_tokens, n=k, seed=cfg.seed * 1_000_003 + step * 101)
            played = play_once(engine, exs, params, request_ids=[f"s{step}p{i}" for i in range(len(exs))],
                               renderer=renderer, verifier=task.verifier, tokenizer=tok, verify_batch=verify)
            st = [v.status for v in played.verdicts]
            pids = [ex.prompt_id for ex in played.examples]
            keep = select_kept(st, pids, played.texts, keep_per_prompt, kept_texts)
            metas: list[dict[str, JSONScalar]] = [{**renderer.record(ex), "kept": kp}
                                                  for ex, kp in zip(played.examples, keep, strict=True)]
            trajs = played.trajectories(verifier=task.verifier, spec=spec, metas=metas)
            for t, ex, text, kp in zip(trajs, played.examples, played.texts, keep, strict=True):
                if kp:
                    kept_texts.setdefault(ex.prompt_id, []).append(text)
                    rows.append(sft_row(ex, text, t.traj_id))
            step_counts = Counter(x.value for x in st)
            blank += sum(x is Status.CORRECT and not text.strip() for x, text in zip(st, played.texts, strict=True))
            statuses.update(step_counts)
            samples += len(trajs)
            ledger.write_trajectories(step, trajs)
            ledger.write_metrics(step, {"samples": len(trajs), "kept": sum(keep), "prompts": len(exs),
                                        **{f"status/{x.value}": step_counts.get(x.value, 0) for x in Status}})
            if progress is not None:
                progress(step, steps, {"samples": samples, "kept": len(rows), "correct": statuses["correct"]})
    finally:
        pool.close()
    judged = samples - statuses[Status.INFRA_ERROR.value]
    summary = SampleSummary(
        prompts=prompts, samples=samples, kept=len(rows), statuses={x.value: statuses.get(x.value, 0) for x in Status},
        pass_rate=statuses[Status.CORRECT.value] / judged if judged else None,
        prompts_with_kept=len(kept_texts), blank_correct=blank, k=k, keep_per_prompt=keep_per_prompt,
        wall_s=round(time.perf_counter() - t0, 3), command=command)
    _write_atomic(out / "sft.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    _write_atomic(out / "summary.json", json.dumps(summary.as_json(), indent=2) + "\n")
    return summary
