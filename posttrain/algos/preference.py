"""Offline preference losses (registry PREFERENCE_LOSSES)."""

from __future__ import annotations
