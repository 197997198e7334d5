"""Moved to :mod:`posttrain.config.ray` (issue 23); this re-export goes once no module imports it here."""

from posttrain.config.ray import RayBackendConfig  # noqa: F401
