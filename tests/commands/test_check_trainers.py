"""`posttrain check` on the preference, reward-model and distillation recipes: each passes, and a broken
setup fails the check that guards it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from posttrain.commands.check import run_checks
from posttrain.commands.check_result import all_passed
from posttrain.loop.validate import load_run_config

ONLINE = ["sampling.group_size=4", "sampling.max_new_tokens=4", "sft.steps=0"]

EXPECTED = {
    "dpo": ([], ["pairs_load", "reference_equals_policy", "mask_invariance", "microbatch_split", "save_resume"]),
    "dpo_online": (ONLINE, ["behavior_vs_old", "reference_equals_policy", "mask_invariance", "microbatch_split",
                            "save_resume"]),
    "reward_model": ([], ["pairs_load", "microbatch_split", "padding_invariance", "save_load"]),
    "distill": ([], ["ratio_is_one", "mask_invariance", "behavior_vs_old", "microbatch_split", "save_resume"]),
}


@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_each_new_recipe_passes_its_trainers_checks(recipe: str) -> None:
    overrides, names = EXPECTED[recipe]
    results = run_checks(load_run_config(recipe, overrides), prompts=3)
    assert [n for n, _, _ in results] == names
    assert all(ok is True for _, ok, _ in results), results


def test_zero_margin_loss_is_the_hand_value_per_loss() -> None:
    from posttrain.commands.check_preference import zero_margin_loss

    assert zero_margin_loss("dpo", {"beta": 0.5, "label_smoothing": 0.2}) == pytest.approx(math.log(2))
    assert zero_margin_loss("ipo", {"tau": 0.25}) == pytest.approx(4.0)  # (1 / (2 * 0.25))^2
    assert zero_margin_loss("kto", {"lambda_d": 1.0, "lambda_u": 3.0}) == pytest.approx(1.0)  # (1/2 + 3/2) / 2
    assert zero_margin_loss("odpo", {}) is None


def test_ipo_recipe_checks_its_own_zero_margin_value_and_simpo_has_no_reference() -> None:
    res = {n: (ok, d) for n, ok, d in run_checks(load_run_config("dpo", ["preference.loss=ipo",
                                                                         "preference.kwargs={tau: 0.25}"]), 2)}
    assert res["reference_equals_policy"][0] is True
    assert "at zero margin 4.000000" in res["reference_equals_policy"][1]
    res = {n: (ok, d) for n, ok, d in run_checks(load_run_config("dpo", ["preference.loss=simpo",
                                                                         "preference.kwargs={}"]), 2)}
    ok, detail = res["reference_equals_policy"]
    assert ok is None and "reference-free" in detail
    assert all_passed(list((n, o, d) for n, (o, d) in res.items()))


def _offline_setup():
    from posttrain.loop.builders import build_model, build_renderer
    from posttrain.loop.preference_batch import encode_pair
    from posttrain.loop.preference_training import load_pairs

    cfg = load_run_config("dpo", [])
    train, _ = load_pairs(cfg)
    torch.manual_seed(cfg.seed)
    tok, model = build_model(cfg)
    model.eval()
    renderer = build_renderer(cfg, tok)
    pairs = [encode_pair(p, renderer, tok, max_length=cfg.preference.max_length) for p in train[:4]]
    return cfg, model, pairs, int(tok.pad_token_id or 0)


def test_a_reference_that_differs_from_the_policy_fails_reference_equals_policy() -> None:
    from posttrain.commands.check_preference import check_reference_equals_policy

    cfg, model, pairs, pad = _offline_setup()
    ref = copy.deepcopy(model)
    assert check_reference_equals_policy(model, ref, pairs, cfg, pad)[1] is True
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0), dtype=p.dtype))
    name, ok, detail = check_reference_equals_policy(model, ref, pairs, cfg, pad)
    assert name == "reference_equals_policy" and ok is False, detail


def test_a_loss_that_reads_the_padding_fails_mask_invariance(monkeypatch: pytest.MonkeyPatch) -> None:
    import posttrain.loop.preference_batch as pb
    from posttrain.commands.check_preference import check_mask_invariance, reference_batch

    cfg, model, pairs, pad = _offline_setup()
    assert len({len(p.prompt) + len(p.chosen) for p in pairs} | {len(p.prompt) + len(p.rejected) for p in pairs}) > 1
    batch = reference_batch(copy.deepcopy(model), pairs, cfg, pad)
    assert check_mask_invariance(model, batch, cfg, pad)[1] is True
    real = pb._padded

    def response_runs_into_the_padding(rows, pad_id):  # the padding read as response tokens (both masks ignored)
        ids, attn, resp = real(rows, pad_id)
        for i, (p, _) in enumerate(rows):
            resp[i, len(p):] = True
        return ids, torch.ones_like(attn), resp

    monkeypatch.setattr(pb, "_padded", response_runs_into_the_padding)
    name, ok, detail = check_mask_invariance(model, batch, cfg, pad)
    assert ok is False, detail


def test_a_per_microbatch_mean_fails_microbatch_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import posttrain.loop.preference_step as ps
    from posttrain.commands.check_preference import check_microbatch_split, reference_batch

    cfg, model, pairs, pad = _offline_setup()
    batch = reference_batch(copy.deepcopy(model), pairs, cfg, pad)
    assert check_microbatch_split(model, batch, cfg, pad)[1] is True
    real = ps.preference_loss

    def own_mean(*a, **k):  # each micro-batch normalised by its own size: the classic split bug
        loss, diag = real(*a, **k)
        return loss / loss.numel(), diag

    monkeypatch.setattr(ps, "preference_loss", own_mean)
    assert check_microbatch_split(model, batch, cfg, pad)[1] is False


def test_a_reward_head_reading_the_padding_fails_padding_invariance() -> None:
    from posttrain.commands.check_reward_model import check_padding_invariance
    from posttrain.loop.preference_training import load_pairs
    from posttrain.loop.reward_model_training import build_reward_model, render_pairs

    cfg = load_run_config("reward_model", [])
    train, _ = load_pairs(cfg)
    tok, model = build_reward_model(cfg)
    pairs = render_pairs(train[:4], tok, use_chat_template=False, max_length=cfg.preference.max_length)
    assert check_padding_invariance(model, tok, pairs, cfg.preference.max_length)[1] is True
    tok.padding_side = "right"  # the head still finds each row's last non-pad token
    assert check_padding_invariance(model, tok, pairs, cfg.preference.max_length)[1] is True
    model.config.pad_token_id = (tok.pad_token_id + 1) % model.config.vocab_size  # now it scores a pad column
    name, ok, detail = check_padding_invariance(model, tok, pairs, cfg.preference.max_length)
    assert ok is False, detail


def test_a_bad_pairs_file_fails_pairs_load_naming_it(tmp_path) -> None:
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"prompt": "a", "chosen": "x", "rejected": "y"}\n')
    results = run_checks(load_run_config("dpo", [f"preference.data={f}"]), 2)
    assert [(n, ok) for n, ok, _ in results] == [("pairs_load", False)]
    assert str(f) in results[0][2]


def test_sampled_pairs_take_the_first_two_responses_of_each_group_whatever_their_verdicts() -> None:
    from posttrain.commands.check_online_preference import sampled_pairs
    from tests.diagnostics.synthetic import traj

    trajs = [traj("a", "g1", "wrong", 0.0, [-0.5, -1.0], None), traj("b", "g1", "wrong", 0.0, [-2.0], None),
             traj("c", "g1", "correct", 1.0, [-2.0], None), traj("d", "g2", "wrong", 0.0, [-1.0], None)]
    (pair,) = sampled_pairs(trajs)  # g2 has one response: no pair
    assert (pair.pair_id, pair.prompt, pair.chosen, pair.rejected) == ("a>b", (1, 2), (10, 11), (10,))


def test_online_preference_checks_run_on_the_verifiers_pairs_when_groups_mix_verdicts() -> None:
    from pathlib import Path

    import posttrain

    teacher = Path(posttrain.__file__).parent / "recipes" / "data" / "distill_teacher_micro"  # 0.92 held-out
    results = run_checks(load_run_config("dpo_online", [*ONLINE, f"model.path={teacher}"]), prompts=3)
    by_name = {n: (ok, d) for n, ok, d in results}
    for name in ("reference_equals_policy", "mask_invariance", "microbatch_split"):
        ok, detail = by_name[name]
        assert ok is True and "(correct, wrong) pairs of the sampled groups" in detail, detail
    untrained = {n: d for n, _, d in run_checks(load_run_config("dpo_online", ONLINE), prompts=3)}
    assert "no group mixed correct and wrong" in untrained["microbatch_split"]


def test_an_rl_recipe_with_a_reward_model_component_is_checked_on_its_composed_rewards(tmp_path) -> None:
    from posttrain.commands import train
    from tests.diagnostics.test_commands import parse

    args = parse(train, ["train", "reward_model", "steps=1", f"run_dir={tmp_path / 'rm'}", "--no-progress"])
    assert args.func(args) == 0
    cfg = load_run_config("grpo", ["model.path=builtin:tiny", "task.name=arithmetic", "task.kwargs={}", "sft.steps=0",
                                   "sampling.group_size=2", f"reward.model.path={tmp_path / 'rm' / 'reward_model'}",
                                   "reward.model.weight=0.5"])
    results = run_checks(cfg, prompts=2)  # reward.weights.rm composes: the verdicts carry the rm component
    assert [n for n, _, _ in results][0] == "ratio_is_one" and all(ok is True for _, ok, _ in results), results
