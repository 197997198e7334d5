"""Preference optimisation (``preference``): the pairs, the loss and its batches, for ``trainer: preference``
(offline pairs from a file, or online pairs from the run's own sampled groups) and ``trainer: reward_model``
(the same pairs train a Bradley-Terry reward model).

The loss name is one of :data:`PREFERENCE_LOSS_NAMES` (the registry ``posttrain.algos.PREFERENCE_LOSSES``;
its ``kwargs`` are checked against the loss's signature when the run starts). docs/learner.md,
"Preference optimisation".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.section import Section

PreferenceLossName = Literal["dpo", "ipo", "simpo", "orpo", "kto", "odpo"]
PREFERENCE_LOSS_NAMES: tuple[str, ...] = ("dpo", "ipo", "simpo", "orpo", "kto", "odpo")
"""The names of posttrain.algos.PREFERENCE_LOSSES (tests/config/test_preference_config.py keeps them equal)."""

FIELD_ROLES: tuple[str, ...] = ("prompt", "messages", "chosen", "rejected", "id", "score_diff")
"""The keys of ``preference.fields`` (posttrain/envs/preference_data.py reads them)."""


class PreferenceConfig(Section):
    """Preference pairs and the preference loss (docs/learner.md, "Preference optimisation")."""

    data: str | None = Field(default=None, description="a JSONL or Parquet file of preference pairs (prompt or messages, "
                             "chosen, rejected); needed by trainer=preference offline and trainer=reward_model")
    fields: dict[str, str] = Field(default_factory=dict, description="role -> column: prompt, messages, chosen, "
                                   "rejected, id, score_diff (defaults: the columns prompt, chosen, rejected)")
    loss: PreferenceLossName = Field(default="dpo", description="a name in posttrain.algos.PREFERENCE_LOSSES")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the loss (beta, tau, ...)")
    online: bool = Field(default=False, description="trainer=preference: pairs from the run's own sampled groups, "
                         "labelled by the task's verifier (a correct and a wrong response of one prompt), instead of "
                         "preference.data")
    pairs_per_group: Literal["one", "all"] = Field(
        default="one", description="online: from a group with c correct and w wrong responses, one pair (the first "
        "correct vs the first wrong) or all c*w pairs")
    batch_size: int = Field(default=8, ge=1, description="pairs per optimizer step (offline)")
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1, description="pairs held out (by a hash of the prompt) "
                                    "for held-out pair accuracy")
    max_length: int = Field(default=512, ge=2, description="tokens of prompt + response; a longer pair is refused "
                            "at load, naming it")

    @model_validator(mode="after")
    def _check(self) -> PreferenceConfig:
        unknown = sorted(set(self.fields) - set(FIELD_ROLES))
        if unknown:
            raise ValueError(f"preference.fields: unknown key(s) {unknown}; valid: {', '.join(FIELD_ROLES)}")
        if "prompt" in self.fields and "messages" in self.fields:
            raise ValueError("preference.fields: give prompt or messages, not both")
        return self
