"""`posttrain check` runs the verification list on a tiny setup, and can fail."""

from posttrain.commands.check import run_checks
from posttrain.loop.validate import load_run_config

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.group_size=4",
        "sampling.max_new_tokens=3"]


def test_all_checks_pass_on_the_builtin_engine():
    results = run_checks(load_run_config("grpo", TINY), prompts=3)
    assert [name for name, _, _ in results] == [
        "ratio_is_one", "mask_invariance", "behavior_vs_old", "microbatch_split", "save_resume"]
    failed = [(n, d) for n, ok, d in results if not ok]
    assert not failed, failed


def test_mismatch_check_fails_when_the_limit_is_below_the_measured_kappa():
    results = dict((n, (ok, d)) for n, ok, d in run_checks(load_run_config("grpo", [*TINY, "guards.max_abs_log_kappa=1e-15"]), 2))
    ok, detail = results["behavior_vs_old"]
    assert not ok and "limit 1e-15" in detail


EPISODES = ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none", "env.max_turns=3",
            "env.max_tokens=120", "env.stop_strings=['e', 'o']", "sampling.group_size=2",
            "sampling.max_new_tokens=12", "seed=3"]


def test_checks_run_on_multi_turn_episodes_with_observations_between_turns():
    from posttrain.commands.check_rollout import _episode_trajectories
    from posttrain.loop.builders import build_engine, build_learner, build_model, build_task
    from posttrain.trajectory import Role

    cfg = load_run_config(None, EPISODES)
    tok, model = build_model(cfg)
    learner = build_learner(cfg, model)
    trajs = _episode_trajectories(cfg, 3, tok, model, build_task(cfg), build_engine(learner.model, tok))
    assert len(trajs) == 6
    # the batch the checks see has observation tokens after an action turn (not only a prompt)
    assert any(Role.OBSERVATION in t.roles and t.roles.index(Role.OBSERVATION) > t.roles.index(Role.ACTION)
               for t in trajs)
    results = run_checks(cfg, prompts=3)
    assert [n for n, _, _ in results] == ["ratio_is_one", "mask_invariance", "behavior_vs_old", "microbatch_split",
                                          "save_resume"]
    assert all(ok for _, ok, _ in results), results


def test_too_few_prompts_for_the_minibatches_is_one_line_naming_the_flag():
    """`posttrain check ppo --prompts 2` (group size 1, 4 mini-batches) failed deep in the learner's schedule with
    'num_minibatches must be in [1, 2]'; too few rows are refused before the model loads, naming --prompts."""
    import pytest

    cfg = load_run_config("grpo", [*TINY, "sampling.group_size=3", "optim.num_minibatches=8"])
    with pytest.raises(ValueError, match=r"^check: --prompts 2 x sampling.group_size 3 = 6 rows, fewer than "
                       r"optim.num_minibatches=8; pass --prompts 3 or more$"):
        run_checks(cfg, prompts=2)


def test_checks_run_with_a_kl_term_in_the_loss():
    """`posttrain check RECIPE loss.kl_estimator=k3 loss.kl_coef=0.1` stopped with "kl_estimator='k3' needs
    ref_logprob" while `posttrain train` ran the same config: the check's batch had no pi_ref. It carries the
    starting policy's log-probs as a run's first step does, and every check passes with the KL term."""
    for kl in (["loss.kl_estimator=k3", "loss.kl_coef=0.1"],
               ["loss.kl_estimator=k1", "loss.kl_coef=0.05", "credit.kl_in_reward=true"]):
        results = run_checks(load_run_config("grpo", [*TINY, *kl]), prompts=3)
        assert [n for n, _, _ in results] == ["ratio_is_one", "mask_invariance", "behavior_vs_old",
                                              "microbatch_split", "save_resume"]
        assert all(ok for _, ok, _ in results), (kl, results)
