"""The typed models of the registered functions' hyper-parameters (``Registry.kwargs_model``) and the
validation of a recipe's kwargs against them (``Registry.validate_kwargs``)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

import posttrain.algos as A
from posttrain.algos.registry import Registry

_REQUIRED = object()


def _fields(reg: Registry, name: str) -> dict[str, tuple[object, object]]:
    """``{field: (annotation, default)}`` of ``name``'s model; ``_REQUIRED`` for a field without default."""
    return {k: (f.annotation, _REQUIRED if f.is_required() else f.default)
            for k, f in reg.kwargs_model(name).model_fields.items()}


# The signatures, written out by hand: data arguments and framework-supplied keywords are not fields.
@pytest.mark.parametrize(("reg", "name", "fields"), [
    (A.POLICY_LOSSES, "ppo_clip", {"eps_low": (float, 0.2), "eps_high": (float, 0.2), "dual_clip": (float | None, None)}),
    (A.POLICY_LOSSES, "topr", {"cap": (float, 1.0), "level": (str, "sequence"), "ratio_against": (str, "old")}),
    (A.ADVANTAGES, "grpo", {"norm_std": (bool, True), "eps": (float, 1e-6), "min_std": (float, 1e-6)}),
    (A.ADVANTAGES, "gae", {"gamma": (float, 1.0), "lam": (float, 0.95)}),
    (A.ADVANTAGES, "rloo", {}),
    (A.CORRECTIONS, "staleness", {"max_staleness": (int, _REQUIRED)}),  # the versions are the learner's
    (A.CORRECTIONS, "mis", {"threshold": (float, 2.0), "aggregation": (str, "sum"), "lower": (float | None, None)}),
    (A.REDUCTIONS, "token_mean", {"max_len": (int | None, None)}),  # the counts are the learner's
    (A.KL_ESTIMATORS, "k3", {}),
    (A.PREFERENCE_LOSSES, "simpo", {"beta": (float, 2.0), "gamma": (float, 0.5)}),  # lengths are data
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_model_of_a_registered_function_is_its_signature(reg, name, fields):
    assert _fields(reg, name) == fields


def test_the_model_is_built_once_and_dropped_with_its_function():
    reg = Registry("thing")

    @reg.register("f")
    def f(inputs: object, *, a: float = 1.0) -> float:
        return a

    model = reg.kwargs_model("f")
    assert reg.kwargs_model("f") is model
    reg.unregister("f")

    @reg.register("f")
    def g(inputs: object, *, b: int = 0) -> int:
        return b

    assert list(reg.kwargs_model("f").model_fields) == ["b"]


def test_validated_values_are_typed_and_only_the_keys_given():
    typed = A.POLICY_LOSSES.validate_kwargs("ppo_clip", {"eps_high": 1, "eps_low": 0}, key="loss.kwargs")
    assert typed == {"eps_high": 1.0, "eps_low": 0.0} and list(typed) == ["eps_high", "eps_low"]
    assert all(type(v) is float for v in typed.values())  # an int for a float parameter becomes a float
    assert A.POLICY_LOSSES.validate_kwargs("ppo_clip", {}, key="loss.kwargs") == {}  # defaults: the function's
    assert A.POLICY_LOSSES.validate_kwargs("ppo_clip", {"dual_clip": None}, key="loss.kwargs") == {"dual_clip": None}
    assert A.ADVANTAGES.validate_kwargs("grpo", {"norm_std": False}, key="credit.kwargs") == {"norm_std": False}


# (registry, name, kwargs, the whole one-line message)
ERRORS: dict[str, tuple[Registry, str, dict[str, Any], str]] = {
    "unknown_key": (A.POLICY_LOSSES, "ppo_clip", {"eps": 0.1},
                    "loss.kwargs.eps: unknown keyword of policy loss 'ppo_clip' (valid: eps_low, eps_high, dual_clip)"),
    "unknown_key_of_no_kwargs": (A.ADVANTAGES, "rloo", {"norm_std": True},
                                 "credit.kwargs.norm_std: unknown keyword of advantage estimator 'rloo' (valid: none)"),
    "text_for_a_float": (A.POLICY_LOSSES, "ppo_clip", {"eps_low": "high"},
                         "loss.kwargs.eps_low: Input should be a valid number, got 'high' "
                         "(policy loss 'ppo_clip' takes eps_low: float)"),
    "quoted_number": (A.POLICY_LOSSES, "ppo_clip", {"eps_low": "1e-3"},
                      "loss.kwargs.eps_low: Input should be a valid number, got '1e-3' (text, not a number: write it "
                      "unquoted; YAML reads 1e-6 as text, 1.0e-6 as a number) (policy loss 'ppo_clip' takes eps_low: "
                      "float)"),
    "list_for_a_float": (A.POLICY_LOSSES, "ppo_clip", {"eps_low": [1]},
                         "loss.kwargs.eps_low: Input should be a valid number, got [1] "
                         "(policy loss 'ppo_clip' takes eps_low: float)"),
    "bool_for_a_float": (A.POLICY_LOSSES, "ppo_clip", {"eps_high": True},
                         "loss.kwargs.eps_high: Input should be a valid number, got True "
                         "(policy loss 'ppo_clip' takes eps_high: float)"),
    "number_for_a_bool": (A.ADVANTAGES, "grpo", {"norm_std": 1},
                          "credit.kwargs.norm_std: Input should be a valid boolean, got 1 "
                          "(advantage estimator 'grpo' takes norm_std: bool)"),
    "float_for_an_int": (A.CORRECTIONS, "staleness", {"max_staleness": 1.5},
                         "correction.kwargs.max_staleness: Input should be a valid integer, got 1.5 "
                         "(behavior correction 'staleness' takes max_staleness: int)"),
    "text_for_an_optional_float": (A.POLICY_LOSSES, "ppo_clip", {"dual_clip": "x"},
                                   "loss.kwargs.dual_clip: Input should be a valid number, got 'x' "
                                   "(policy loss 'ppo_clip' takes dual_clip: float | None)"),
    "number_for_a_str": (A.POLICY_LOSSES, "topr", {"level": 1},
                         "loss.kwargs.level: Input should be a valid string, got 1 (policy loss 'topr' takes level: str)"),
    "missing": (A.CORRECTIONS, "staleness", {},
                "correction.kwargs: behavior correction 'staleness' needs max_staleness"),
    "supplied_by_the_learner": (A.CORRECTIONS, "staleness", {"current_version": 3, "max_staleness": 1},
                                "correction.kwargs.current_version: unknown keyword of behavior correction "
                                "'staleness' (valid: max_staleness)"),
    "all_at_once": (A.POLICY_LOSSES, "ppo_clip", {"eps_low": "0.1", "bogus": 1, "eps_high": False},
                    "loss.kwargs.bogus: unknown keyword of policy loss 'ppo_clip' (valid: eps_low, eps_high, "
                    "dual_clip); loss.kwargs.eps_low: Input should be a valid number, got '0.1' (text, not a "
                    "number: write it unquoted; YAML reads 1e-6 as text, 1.0e-6 as a number) (policy loss "
                    "'ppo_clip' takes eps_low: float); loss.kwargs.eps_high: Input should be a valid number, got "
                    "False (policy loss 'ppo_clip' takes eps_high: float)"),
}
_KEYS = {"policy loss": "loss.kwargs", "advantage estimator": "credit.kwargs", "behavior correction": "correction.kwargs"}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_a_bad_kwarg_is_one_line_naming_the_key(case):
    reg, name, kwargs, message = ERRORS[case]
    with pytest.raises(ValueError) as e:
        reg.validate_kwargs(name, kwargs, key=_KEYS[reg.kind])
    assert str(e.value) == message


PLUGIN = '''
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from not_installed_anywhere import Schedule


def free(inputs, scale: float = 1.0, window: tuple[int, int] = (0, 1), anything=None,
         schedule: Schedule | None = None, mode: Literal["a", "b"] = "a", **extra):
    """A plug-in: typed, unannotated, type-checking-only and open-ended keywords."""
    return scale


def closed(*tensors, cap: float = 2.0):
    """A plug-in taking its data as ``*tensors``: its keyword-only parameters are its hyper-parameters."""
    return cap
'''


@pytest.fixture
def plugin(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    d = tmp_path_factory.mktemp("plugins")
    (d / "_kw_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(d))
    yield "_kw_plugin"


def test_a_plugin_gets_a_model_from_its_signature(plugin):
    reg = Registry("advantage estimator")  # a registry of this test only: nothing global to clean
    name = reg.resolve(f"{plugin}:free", key="credit.estimator")
    fields = _fields(reg, name)
    assert fields["scale"] == (float, 1.0) and fields["window"] == (tuple[int, int], (0, 1))
    assert fields["anything"] == (Any, None)  # unannotated: any value
    assert fields["schedule"] == (Any, None)  # names what exists only for type checkers: any value
    typed = reg.validate_kwargs(name, {"scale": 2, "window": [3, 4], "anything": "x", "schedule": 5, "mode": "b",
                                       "other": [1]}, key="credit.kwargs")
    assert typed == {"scale": 2.0, "window": (3, 4), "anything": "x", "schedule": 5, "mode": "b", "other": [1]}
    assert type(typed["scale"]) is float  # **extra takes any other key, unchecked
    with pytest.raises(ValueError, match=r"^credit\.kwargs\.scale: Input should be a valid number, got '2' "):
        reg.validate_kwargs(name, {"scale": "2"}, key="credit.kwargs")
    with pytest.raises(ValueError, match=r"^credit\.kwargs\.mode: Input should be 'a' or 'b', got 'c' "):
        reg.validate_kwargs(name, {"mode": "c"}, key="credit.kwargs")


def test_a_plugin_taking_star_args_is_typed_by_its_keyword_only_parameters(plugin):
    reg = Registry("behavior correction", data_args=3)
    name = reg.resolve(f"{plugin}:closed", key="correction.name")
    assert _fields(reg, name) == {"cap": (float, 2.0)}
    with pytest.raises(ValueError, match=r"^correction\.kwargs\.cop: unknown keyword .* \(valid: cap\)$"):
        reg.validate_kwargs(name, {"cop": 1}, key="correction.kwargs")
def test_factory_kwargs_are_validated_against_the_whole_signature():
    """validated_factory_kwargs: every parameter is configurable (no data arguments), cached per factory;
    an unhashable callable is still checked; what has no signature is handed back for its call to refuse."""
    from posttrain.algos.hyperparameters import validated_factory_kwargs

    def make(n: int, scale: float = 1.0) -> None: ...

    assert validated_factory_kwargs(make, {"n": 2, "scale": 3}, key="k", what="f") == {"n": 2, "scale": 3.0}
    with pytest.raises(ValueError, match=r"^k\.n: Input should be a valid integer, got '2' \(text"):
        validated_factory_kwargs(make, {"n": "2"}, key="k", what="f")

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, flag: bool) -> None: ...

    with pytest.raises(ValueError, match=r"^k\.flag: Input should be a valid boolean, got 'no'"):
        validated_factory_kwargs(Unhashable(), {"flag": "no"}, key="k", what="f")
    assert validated_factory_kwargs("/", {"x": 1}, key="k", what="f") == {"x": 1}  # type: ignore[arg-type]
