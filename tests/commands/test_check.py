"""`posttrain check` runs the verification list on a tiny setup, and can fail."""

from posttrain.commands.check import run_checks
from posttrain.config import load_config

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.group_size=4",
        "sampling.max_new_tokens=3"]


def test_all_checks_pass_on_the_builtin_engine():
    results = run_checks(load_config("grpo", TINY), prompts=3)
    assert [name for name, _, _ in results] == [
        "ratio_is_one", "mask_invariance", "behavior_vs_old", "microbatch_split", "save_resume"]
    failed = [(n, d) for n, ok, d in results if not ok]
    assert not failed, failed


def test_mismatch_check_fails_when_the_limit_is_below_the_measured_kappa():
    results = dict((n, (ok, d)) for n, ok, d in run_checks(load_config("grpo", [*TINY, "guards.max_abs_log_kappa=1e-15"]), 2))
    ok, detail = results["behavior_vs_old"]
    assert not ok and "limit 1e-15" in detail
