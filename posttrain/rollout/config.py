"""Moved to :mod:`posttrain.config.rollout` (issue 23); this re-export goes once no module imports it here."""

from posttrain.config.rollout import HTTPSettings, RolloutConfig, VLLMSettings  # noqa: F401
