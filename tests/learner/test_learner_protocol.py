"""The loop's one learner interface (posttrain/learner/protocol.py): met by the in-process learner and
the learner ranks. The ranks' conformance is checked statically (``build_learner`` returns ``Learner``
for both under ``mypy --strict``); here the runtime check and that it is not vacuous."""

from __future__ import annotations

import inspect

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.protocol import Learner
from posttrain.learner.ranks import LearnerRanks
from posttrain.models import build_char_tokenizer, build_tiny_model


def test_the_in_process_learner_is_a_learner() -> None:
    model = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0)
    learner = PolicyLearner(model, lr=1e-3)
    assert isinstance(learner, Learner)
    learner.close()  # nothing to release, and idempotent
    learner.close()


def test_the_learner_ranks_define_every_method_with_the_protocols_parameters() -> None:
    methods = [n for n, v in vars(Learner).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"compute_logprobs", "forward_backward", "optim_step", "update", "weights_for_rollout", "state_dict",
            "load_state_dict", "close"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(Learner, name)).parameters)
        got = list(inspect.signature(getattr(LearnerRanks, name)).parameters)
        assert got[: len(want)] == want, f"LearnerRanks.{name}{got} does not take {want}"


def test_an_object_missing_a_primitive_is_not_a_learner() -> None:
    model = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0)

    class NoUpdate:
        def __init__(self) -> None:
            self.model, self.version, self.temperature, self.top_k, self.top_p = model, 0, 1.0, 0, 1.0

        def compute_logprobs(self, batch: object) -> None: ...

    assert not isinstance(NoUpdate(), Learner)
