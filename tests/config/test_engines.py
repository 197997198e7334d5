"""The engine registry (posttrain/config/engines.py): ``rollout.engine`` names an entry or is refused in one line
listing them; what the config and the commands read per engine comes from the entry (hand-written table
below); the dead-settings rules of the engines' own sections come from the entries' ``section``."""

from __future__ import annotations

import pytest

from posttrain.cli import main
from posttrain.config import RunConfig
from posttrain.config.dead_settings import RULES
from posttrain.config.engines import ENGINES, _by_name, engine_entry, engines_description, engines_with
from posttrain.config.rollout import RolloutConfig
from posttrain.config.run import RECORDED
from tests._cli_errors import one_error_line

URL = {"url": "http://127.0.0.1:9"}


def test_an_unknown_engine_is_one_line_listing_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "grpo", "rollout.engine=sglang", "--print-recipe"]) == 2
    line = one_error_line(capsys)
    assert line.endswith("unknown rollout engine 'sglang'; known: builtin, vllm, http"), line
    assert "rollout.engine" in line, line
    with pytest.raises(ValueError, match=r"^unknown rollout engine 'x'; known: builtin, vllm, http$"):
        engine_entry("x")


def test_the_registry_is_the_one_list_of_names() -> None:
    assert list(ENGINES) == ["builtin", "vllm", "http"]
    assert all(name == e.name for name, e in ENGINES.items())
    for name in ENGINES:  # every registered name loads
        assert RolloutConfig.model_validate({"engine": name, "http": URL}).engine == name
        assert engine_entry(name) is ENGINES[name]


def test_the_field_description_is_the_entries_summaries() -> None:
    desc = RolloutConfig.model_fields["engine"].description
    assert desc == engines_description()
    assert desc == ("builtin: the PyTorch engine in this process (bit-exact log-probs); vllm: vLLM (rollout.vllm); "
                    "http: a running posttrain engine server (rollout.http)")


def test_a_name_registered_twice_is_refused() -> None:
    b = ENGINES["builtin"]
    with pytest.raises(ValueError, match="rollout engine 'builtin' is registered twice"):
        _by_name(b, ENGINES["http"], b)


# name -> (section, has_precision_axis, runs_as_server_option, samples_as_builtin, machine check): written by hand.
FACTS = {"builtin": (None, True, True, True, None),
         "vllm": ("vllm", False, False, False, "posttrain.loop.validate:check_vllm_env"),
         "http": ("http", False, False, False, None)}


def test_each_entrys_facts() -> None:
    assert {n: (e.section, e.has_precision_axis, e.runs_as_server_option, e.samples_as_builtin, e.machine_check)
            for n, e in ENGINES.items()} == FACTS
    assert engines_with("has_precision_axis") == engines_with("runs_as_server_option") == "builtin"
    assert {n: e.factory for n, e in ENGINES.items()} == {
        n: f"posttrain.loop.engine_factories:{n}_factory" for n in ENGINES}


def test_the_refusals_read_the_entries() -> None:
    with pytest.raises(ValueError, match=r"rollout.process=server applies to rollout.engine=builtin only \(vllm "
                       r"runs as a server process by rollout.vllm.python\)"):
        RolloutConfig.model_validate({"engine": "vllm", "process": "server"})
    with pytest.raises(ValueError, match=r"rollout.precision=bf16 applies to rollout.engine=builtin only "
                       r"\(rollout.engine=http computes in the server's own model dtype\)"):
        RolloutConfig.model_validate({"engine": "http", "http": URL, "precision": "bf16"})
    with pytest.raises(ValueError, match="rollout.http.url is required with rollout.engine=http"):
        RolloutConfig.model_validate({"engine": "http"})
    with pytest.raises(ValueError, match="rollout.vllm.dtype: vLLM has no float64"):
        RunConfig.model_validate({"rollout": {"engine": "vllm"}, "model": {"dtype": "float64"}})
    RunConfig.model_validate({"rollout": {"engine": "builtin"}, "model": {"dtype": "float64"}})


def test_what_the_commands_read_of_an_entry() -> None:
    # held-out evaluation, posttrain check and rejection sampling sample at rollout.precision only where it applies
    assert RolloutConfig.model_validate({"precision": "fp32"}).builtin_precision() == "fp32"
    assert RolloutConfig.model_validate({"engine": "vllm"}).builtin_precision() == "auto"
    vllm = RolloutConfig.model_validate({"engine": "vllm", "vllm": {"max_model_len": 256}})
    assert ENGINES["vllm"].context_cap(vllm) == 256
    assert ENGINES["builtin"].context_cap(RolloutConfig.model_validate({"vllm": {"max_model_len": 256}})) is None


def test_each_engines_section_is_dead_under_any_other_engine() -> None:
    rules = {r.keys: r.why for r in RULES if r.keys[0].startswith("rollout.")}
    assert rules[("rollout.vllm",)] == "rollout.engine is not vllm"
    assert rules[("rollout.http",)] == "rollout.engine is not http"
    with pytest.raises(ValueError, match=r"rollout.vllm.seed=3 cannot take effect: rollout.engine is not vllm"):
        RunConfig.model_validate({"rollout": {"vllm": {"seed": 3}}})
    cfg = RunConfig.model_validate({"rollout": {"engine": "http", "http": URL}}, context=RECORDED)
    assert cfg.rollout.engine == "http"
