"""Behavior corrections for train/inference mismatch and staleness (registry CORRECTIONS)."""

from __future__ import annotations
