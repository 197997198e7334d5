"""Rejection sampling for expert iteration: sample k answers per training prompt from the policy, keep those the
run's verifier marks ``correct``, and write them as SFT data (``posttrain sample``; docs/sft.md, "Expert
iteration").

This is the data step of STaR (Zelikman et al. 2022, "STaR: Bootstrapping Reasoning With Reasoning") and of
rejection-sampling fine-tuning (Yuan et al. 2023, "Scaling Relationship on Learning Mathematical Reasoning with
Large Language Models", RFT: k samples per problem, the correct ones kept, distinct reasoning paths first): the
kept samples are then trained on with ``trainer: sft`` and RL starts from that checkpoint.

Nothing here samples or judges on its own: the prompts are the RL run's (``task.examples("train", n, seed)`` at
the run's data cursor, :meth:`posttrain.loop.run.Run.next_prompts`), rendered by the run's renderer, sampled by
the recipe's engine and judged by :func:`~posttrain.loop.single_turn.play_once` (the path of held-out evaluation
and ``posttrain check``) under the run's guarded verification (``reward.workers`` / ``timeout_s`` / ``retries``,
learned reward components); only the number of samples per prompt is ``k`` instead of ``sampling.group_size``. A
verifier failure is an ``infra_error`` verdict: counted apart, never a failure, never kept.

**Engine**: ``rollout.engine`` through the engine registry (:data:`posttrain.config.engines.ENGINES`), built as
the RL run's local backend builds it (:func:`posttrain.loop.builders.build_engine` with the output directory as
its work directory): ``builtin`` in this process over a copy of the weights at ``rollout.precision``; ``vllm``
a vLLM server on the policy exported to ``engine_model/`` (removed when the pass ends), its log
``engine_server.log``; ``http`` the running server of ``rollout.http``; ``builtin`` with ``rollout.process:
server`` its own process. It is started only when a step is left to sample, and closed when the pass ends,
fails or is interrupted. Prompts must fit the engine's context (``rollout.vllm.max_model_len`` caps vLLM's).

Output directory::

    ledger/trajectories/step_000001.parquet   every sampled trajectory with its verdict (meta "kept": bool)
    ledger/metrics/step_000001.parquet        per-step counts (samples, kept, status/<name>)
    sft.jsonl                                 {"prompt", "completion", "source": traj_id} per kept sample
    summary.json                              prompts, samples, kept, per-status counts, pass rate, the command
    request.json                              the resolved recipe, its engine and k / prompts / keep_per_prompt
    engine_server.log                         the engine server's log (an engine with a server process)

A step of the ledger is one draw of ``sampling.prompts_per_step`` prompts (the last may be smaller), as an RL
step draws them. ``sft.jsonl`` and ``summary.json`` are written once every step is in the ledger, so a directory
holding ``summary.json`` is a complete pass.

**Resume** (``resume=True``, ``posttrain sample --resume``): a pass stopped part-way (Ctrl-C, a crash) goes on
from the first step whose metrics file is missing (metrics are written after their step's trajectories, so a
step cut between the two is sampled again; its trajectories file is moved to ``ledger/discarded/``, as a resumed
run's later steps are, :meth:`~posttrain.trajectory.Ledger.discard_after`). The steps before it are read back from the
ledger, not sampled again: their kept rows, verdict counts and the texts already kept per prompt (the cap and
the distinctness of :func:`select_kept` run across steps as in one pass). Each step's sampling seed is its own
(``seed * 1_000_003 + step * 101``), so a resumed pass writes what an uninterrupted one writes (the builtin
engine's samples, within float rounding of the thread count; vLLM's as far as its seeded sampling repeats).
Refused in one line: a directory without ``request.json`` that holds a ledger, another engine
(``rollout.engine``; a ``request.json`` without ``engine`` was sampled by the builtin engine, whatever its
recipe said), another recipe (:func:`~posttrain.loop.run_dir.recipe_diff` of the resolved configs: ``steps``,
``run_dir`` and the placement-only keys may differ, ``rollout.process`` among them: the builtin engine's samples
are the same in either process), another ``k`` or ``keep_per_prompt``, or a ``prompts`` that redraws a step
already sampled (more prompts are fine: the pass is extended, provided its last step was full).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.loop.single_turn import play_once
from posttrain.trajectory import Ledger, Status

if TYPE_CHECKING:
    import torch

    from posttrain.config import RunConfig
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.envs.task import Task, TaskExample
    from posttrain.rewards import VerifierPool
    from posttrain.rewards.scoring import ScoringSpec, VerifyBatch
    from posttrain.rollout.engine import RolloutEngine
    from posttrain.trajectory.record import JSONScalar

PROMPT_SEED_STRIDE = 7_919
"""The run's prompt seed is ``seed * PROMPT_SEED_STRIDE + cursor`` (:meth:`posttrain.loop.run.Run.next_prompts`)."""

REQUEST_FILE = "request.json"
"""What a pass was asked (the resolved recipe, its engine and the counts): a resume checks it is asked the same."""

LEGACY_ENGINE = "builtin"
"""The engine that sampled a pass whose ``request.json`` names none (every pass before ``posttrain sample`` sampled
with ``rollout.engine``: the builtin engine in process)."""


@dataclasses.dataclass(frozen=True)
class SampleSummary:
    """What one rejection-sampling pass did (written to ``summary.json``).

    ``pass_rate = correct / (samples - infra_error)``: the share of judged samples that are correct (an
    infra error says nothing about the policy); ``kept <= correct`` (``keep_per_prompt`` caps each prompt,
    and a correct sample whose text is blank cannot be an SFT row: ``blank_correct``). ``wall_s`` is the last
    invocation's; ``resumed_after_step``: the ledger steps it read back instead of sampling (0: none);
    ``engine``: the ``rollout.engine`` that sampled the pass."""

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
    resumed_after_step: int = 0
    engine: str = LEGACY_ENGINE

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


def step_plan(prompts: int, prompts_per_step: int) -> list[tuple[int, int]]:
    """``(cursor, n)`` of each ledger step of a pass over ``prompts`` prompts: ``n = min(prompts_per_step,
    prompts - cursor)`` prompts at data cursor ``cursor = (step - 1) * prompts_per_step``."""
    return [(c, min(prompts_per_step, prompts - c)) for c in range(0, prompts, prompts_per_step)]


def sample_request(cfg: RunConfig, *, k: int, prompts: int, keep_per_prompt: int) -> dict[str, Any]:
    """What a pass is asked, as ``request.json`` holds it: ``{"config": the resolved recipe (JSON), "engine":
    cfg.rollout.engine (the engine that samples it), "k", "prompts", "keep_per_prompt"}`` (the config through a
    JSON round trip, so it compares equal to a read one)."""
    config = json.loads(json.dumps(cfg.model_dump(mode="json")))
    return {"config": config, "engine": cfg.rollout.engine, "k": k, "prompts": prompts,
            "keep_per_prompt": keep_per_prompt}


def _check_engine(out: Path, old: Mapping[str, Any], request: Mapping[str, Any]) -> None:
    """``ValueError`` (one line naming ``rollout.engine``) when the pass in ``out`` (its ``request.json``:
    ``old``) was sampled by another engine than ``request`` samples with: one pass's samples come from one
    engine. A ``request.json`` without ``engine`` was sampled by :data:`LEGACY_ENGINE`."""
    had, now = old.get("engine"), request["engine"]
    if had is None and now != LEGACY_ENGINE:
        raise ValueError(f"--out {out} was sampled by the {LEGACY_ENGINE} engine (its {REQUEST_FILE} names no "
                         f"engine), this command samples with rollout.engine={now}; pass --force to start over")
    if had is not None and had != now:
        raise ValueError(f"--out {out} was sampled with rollout.engine={had}, this command has rollout.engine={now}; "
                         f"resume with rollout.engine={had}, or pass --force to start over")


def resume_point(out: Path, request: Mapping[str, Any], plan: Sequence[tuple[int, int]]) -> int:
    """How many ledger steps of the pass in ``out`` a resume asked ``request`` (:func:`sample_request`, with
    steps ``plan``: :func:`step_plan`) reads back: the longest run ``1..d`` of steps with a metrics file. 0 for a
    directory without a ledger or ``request.json``. ``ValueError`` (one line naming ``out``, the key and both
    values) when a ledger has no ``request.json``, the engine differs (:func:`_check_engine`), the recipe differs
    (:func:`~posttrain.loop.run_dir.recipe_diff`), ``k`` or ``keep_per_prompt`` differ, or ``plan`` draws another
    number of prompts at a step already sampled."""
    from posttrain.loop.run_dir import recipe_diff

    ledger = Ledger(out / "ledger")
    path = out / REQUEST_FILE
    if not path.is_file():
        if ledger.steps() or ledger.steps("metrics"):
            raise ValueError(f"--out {out} holds a ledger but no {REQUEST_FILE} (not a pass this version can resume); "
                             "pass --force to start over")
        return 0
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e}); pass --force to start over") from None
    _check_engine(out, old, request)
    for key, flag in (("k", "--k"), ("keep_per_prompt", "--keep-per-prompt")):
        if old.get(key) != request[key]:
            raise ValueError(f"--out {out} was sampled with {flag} {old.get(key)}, this command has {flag} "
                             f"{request[key]}; resume with the same {flag}, or pass --force to start over")
    diff = recipe_diff(old.get("config") or {}, request["config"])
    if diff:
        shown = "; ".join(diff[:3]) + ("; ..." if len(diff) > 3 else "")
        raise ValueError(f"--out {out} was sampled with another recipe ({shown}); resume with that pass's recipe "
                         "and overrides, or pass --force to start over")
    metrics = {int(m["step"]): m for m in ledger.read_metrics()}
    done = 0
    while done + 1 in metrics:
        done += 1
    if done > len(plan):
        raise ValueError(f"--out {out} holds {done} sampled steps, --prompts {request['prompts']} draws {len(plan)}; "
                         f"resume with --prompts {old.get('prompts')}")
    for step in range(1, done + 1):
        had, n = int(metrics[step]["prompts"]), plan[step - 1][1]
        if had != n:
            raise ValueError(f"--prompts {request['prompts']} draws {n} prompts at step {step}, the ledger of --out "
                             f"{out} holds {had} there (a pass is extended only after a full step); resume with "
                             f"--prompts {old.get('prompts')}")
    return done


@dataclasses.dataclass
class _Tally:
    """A pass so far, sampled now or read back from its ledger: verdict counts, kept SFT rows, the texts kept
    per prompt (for :func:`select_kept`'s ``already``), samples, correct-but-blank samples."""

    statuses: Counter[str] = dataclasses.field(default_factory=Counter)
    kept_texts: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    samples: int = 0
    blank: int = 0

    def add(self, examples: Sequence[TaskExample], texts: Sequence[str], statuses: Sequence[Status],
            keep: Sequence[bool], traj_ids: Sequence[str]) -> Counter[str]:
        """Count one step's samples (``examples[i]`` the prompt of sample ``i``); the step's status counts."""
        for ex, text, kp, tid in zip(examples, texts, keep, traj_ids, strict=True):
            if kp:
                self.kept_texts.setdefault(ex.prompt_id, []).append(text)
                self.rows.append(sft_row(ex, text, tid))
        counts = Counter(x.value for x in statuses)
        self.statuses.update(counts)
        self.blank += sum(x is Status.CORRECT and not t.strip() for x, t in zip(statuses, texts, strict=True))
        self.samples += len(texts)
        return counts

    def progress(self) -> dict[str, int]:
        """The counts a progress line shows."""
        return {"samples": self.samples, "kept": len(self.rows), "correct": self.statuses[Status.CORRECT.value]}


def _read_back(out: Path, cfg: RunConfig, task: Task, plan: Sequence[tuple[int, int]], done: int, k: int) -> _Tally:
    """The :class:`_Tally` of ledger steps ``1..done`` of ``out``: each step's prompts drawn again
    (:func:`train_prompts`, deterministic) and matched by id to its trajectories (``ValueError`` naming the step
    when they are not the same prompts, ``k`` samples each); text = ``meta.response``, kept = ``meta.kept``."""
    tally = _Tally()
    ledger = Ledger(out / "ledger")
    for step in range(1, done + 1):
        exs = train_prompts(cfg, task, plan[step - 1][1], plan[step - 1][0])
        by_id = {ex.prompt_id: ex for ex in exs}
        trajs = ledger.read_trajectories([step])
        statuses = [t.status for t in trajs if t.status is not None]
        if Counter(t.prompt_id for t in trajs) != Counter({pid: k for pid in by_id}) or len(statuses) != len(trajs):
            raise ValueError(f"--out {out}: ledger step {step} holds other prompts than the recipe draws there, or "
                             f"samples without a verdict ({len(trajs)} samples); pass --force to start over")
        tally.add([by_id[t.prompt_id] for t in trajs], [str(t.meta["response"]) for t in trajs], statuses,
                  [bool(t.meta["kept"]) for t in trajs], [t.traj_id for t in trajs])
    return tally


def rejection_sample(cfg: RunConfig, out: Path, *, k: int, prompts: int, keep_per_prompt: int, command: str = "",
                     progress: Callable[[int, int, Mapping[str, int]], None] | None = None,
                     resume: bool = False) -> SampleSummary:
    """Sample ``k`` completions for each of ``prompts`` training prompts of run config ``cfg`` (a single-turn RL
    recipe), judge them with the run's verifier, keep the correct ones (:func:`select_kept`) and write ``out``
    (module docstring). ``resume``: go on with the pass already in ``out`` (module docstring, "Resume";
    :func:`resume_point`). The recipe's engine (module docstring, "Engine") samples, started only when a step is
    left and closed at the end, on an error and on ``KeyboardInterrupt``. ``progress(step, steps, counts)`` after
    each ledger step (and once after the steps read back). ``ValueError`` (one line) for a recipe that samples
    no task, an ``env.name`` (multi-turn) recipe, a prompt that does not fit the engine's context, an engine that
    cannot serve the model, a training prompt found in a held-out set (:func:`refuse_heldout`), or a resume
    :func:`resume_point` refuses."""
    check_sample_request(cfg, k=k, prompts=prompts, keep_per_prompt=keep_per_prompt)
    t0 = time.perf_counter()
    plan = step_plan(prompts, cfg.sampling.prompts_per_step)
    request = sample_request(cfg, k=k, prompts=prompts, keep_per_prompt=keep_per_prompt)
    done = _open_out(out, request, plan, resume)
    sampler = _PassSampler.build(cfg)
    ledger = Ledger(out / "ledger")
    try:
        tally = _read_back(out, cfg, sampler.task, plan, done, k)
        if done and progress is not None:
            progress(done, len(plan), tally.progress())
        if done < len(plan):
            sampler.start_engine(out)
        for step in range(done + 1, len(plan) + 1):
            sampler.sample_step(ledger, step, plan[step - 1], k=k, keep_per_prompt=keep_per_prompt, tally=tally)
            if progress is not None:
                progress(step, len(plan), tally.progress())
    finally:
        sampler.close()
    statuses = tally.statuses
    judged = tally.samples - statuses[Status.INFRA_ERROR.value]
    summary = SampleSummary(
        prompts=prompts, samples=tally.samples, kept=len(tally.rows),
        statuses={x.value: statuses.get(x.value, 0) for x in Status},
        pass_rate=statuses[Status.CORRECT.value] / judged if judged else None,
        prompts_with_kept=len(tally.kept_texts), blank_correct=tally.blank, k=k, keep_per_prompt=keep_per_prompt,
        wall_s=round(time.perf_counter() - t0, 3), command=command, resumed_after_step=done,
        engine=cfg.rollout.engine)
    _write_atomic(out / "sft.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in tally.rows))
    _write_atomic(out / "summary.json", json.dumps(summary.as_json(), indent=2) + "\n")
    return summary


def check_sample_request(cfg: RunConfig, *, k: int, prompts: int, keep_per_prompt: int) -> None:
    """``ValueError`` (one line naming the key) unless ``k``, ``prompts`` and ``keep_per_prompt`` are >= 1 and
    ``cfg`` is a single-turn recipe whose trainer samples a task (no ``env.name``)."""
    from posttrain.config.trainers import trainer_entry

    for name, v in (("k", k), ("prompts", prompts), ("keep_per_prompt", keep_per_prompt)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not trainer_entry(cfg.trainer).samples(cfg):
        raise ValueError(f"trainer={cfg.trainer} samples no task; rejection sampling needs an RL recipe's task")
    if cfg.env.name is not None:
        raise ValueError(f"env.name={cfg.env.name}: multi-turn episodes are not rejection-sampled yet; "
                         "use a single-turn task")


def _open_out(out: Path, request: Mapping[str, Any], plan: Sequence[tuple[int, int]], resume: bool) -> int:
    """Make ``out`` ready for the pass and return the ledger steps to read back (0 unless ``resume``:
    :func:`resume_point`): a step cut between its trajectories and metrics is moved aside, ``request.json``
    written, and, with steps left to sample, ``sft.jsonl`` / ``summary.json`` removed (written again at the end:
    until then the directory says it is not a complete pass)."""
    done = resume_point(out, request, plan) if resume else 0
    out.mkdir(parents=True, exist_ok=True)
    if resume:  # a step cut between its trajectories and its metrics: moved aside (the ledger is append-only)
        Ledger(out / "ledger").discard_after(done)
    _write_atomic(out / REQUEST_FILE, json.dumps(request, indent=1) + "\n")
    if done < len(plan):
        for name in ("sft.jsonl", "summary.json"):
            (out / name).unlink(missing_ok=True)
    return done


@dataclasses.dataclass
class _PassSampler:
    """What a pass samples and judges with, built once from the recipe (:meth:`build`); its engine started by
    :meth:`start_engine`, everything it started stopped by :meth:`close`."""

    cfg: RunConfig
    tok: Any  # build_model's tokenizer (typed as it returns it)
    model: torch.nn.Module
    task: Task
    renderer: PromptRenderer
    heldout: dict[str, tuple[set[str], set[str]]]  # heldout_problems
    pool: VerifierPool  # closed by close()
    verify: VerifyBatch
    spec: ScoringSpec
    engine: RolloutEngine | None = None  # start_engine; closed by close()
    workdir: Path | None = None  # the engine's work directory (its model export is removed by close())

    @classmethod
    def build(cls, cfg: RunConfig) -> _PassSampler:
        """Seed torch with ``cfg.seed``, then build the run's model, task, renderer and held-out sets and the
        run's guarded verification (``reward.workers`` / ``timeout_s`` / ``retries``, learned components); no
        engine yet (:meth:`start_engine`)."""
        import torch

        from posttrain.loop.builders import build_model, build_renderer, build_task
        from posttrain.rewards import VerifierPool
        from posttrain.rewards.learned import build_learned_rewards
        from posttrain.rewards.scoring import ScoringSpec

        torch.manual_seed(cfg.seed)
        tok, model = build_model(cfg)
        task = build_task(cfg)
        renderer = build_renderer(cfg, tok)
        heldout = heldout_problems(cfg, task)
        pool = VerifierPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s, retries=cfg.reward.retries)
        verify = build_learned_rewards(cfg.reward, pool.verify_batch)
        return cls(cfg, tok, model, task, renderer, heldout, pool, verify, ScoringSpec.of(cfg.reward))

    def start_engine(self, workdir: Path) -> None:
        """Start the recipe's engine on the policy: :func:`~posttrain.loop.builders.build_engine` with the run
        config, as the RL run's local backend starts it (module docstring, "Engine"): ``builtin`` in this process
        a :class:`~posttrain.rollout.builtin.BuiltinEngine` over a copy of the weights at ``rollout.precision``,
        any other entry of the engine registry from its factory with ``workdir`` for its files (``engine_model/``,
        ``engine_server.log``), probed with one 1-token request (one-line ``ValueError`` naming the key)."""
        from posttrain.loop.builders import build_engine

        self.workdir = workdir
        self.engine = build_engine(self.model, self.tok, self.cfg, workdir)

    def close(self) -> None:
        """Stop what the pass started, each step even when one before it fails: the engine (``close()``, where it
        has one: a server process), its model export ``workdir/engine_model``, then the verifier pool."""
        try:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
        finally:
            if self.workdir is not None:
                shutil.rmtree(self.workdir / "engine_model", ignore_errors=True)
            self.pool.close()

    def sample_step(self, ledger: Ledger, step: int, cursor_n: tuple[int, int], *, k: int, keep_per_prompt: int,
                    tally: _Tally) -> None:
        """Ledger step ``step``: ``n`` prompts at data cursor ``cursor`` (:func:`train_prompts`; refused when
        held-out or too long for the engine's context), ``k`` samples each by the started engine with seed
        ``seed * 1_000_003 + step * 101`` played and judged by :func:`play_once`, kept by :func:`select_kept`,
        counted into ``tally``, written to ``ledger`` (trajectories, then metrics)."""
        from posttrain.envs.task import check_prompts
        from posttrain.loop.episode_rollout import engine_context
        from posttrain.rollout.sampling import SamplingParams

        cfg, s, task, renderer = self.cfg, self.cfg.sampling, self.task, self.renderer
        cursor, n = cursor_n
        if self.engine is None:
            raise RuntimeError("sample_step before start_engine")
        exs = train_prompts(cfg, task, n, cursor)
        refuse_heldout(exs, self.heldout, cfg.task.name)
        check_prompts(exs, self.tok, max_context=engine_context(cfg, self.model), max_new_tokens=s.max_new_tokens,
                      renderer=renderer)
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, n=k, seed=cfg.seed * 1_000_003 + step * 101)
        played = play_once(self.engine, exs, params, request_ids=[f"s{step}p{i}" for i in range(len(exs))],
                           renderer=renderer, verifier=task.verifier, tokenizer=self.tok, verify_batch=self.verify)
        st = [v.status for v in played.verdicts]
        pids = [ex.prompt_id for ex in played.examples]
        keep = select_kept(st, pids, played.texts, keep_per_prompt, tally.kept_texts)
        metas: list[dict[str, JSONScalar]] = [{**renderer.record(ex), "kept": kp}
                                              for ex, kp in zip(played.examples, keep, strict=True)]
        trajs = played.trajectories(verifier=task.verifier, spec=self.spec, metas=metas)
        step_counts = tally.add(played.examples, played.texts, st, keep, [t.traj_id for t in trajs])
        ledger.write_trajectories(step, trajs)
        ledger.write_metrics(step, {"samples": len(trajs), "kept": sum(keep), "prompts": len(exs),
                                    **{f"status/{x.value}": step_counts.get(x.value, 0) for x in Status}})
