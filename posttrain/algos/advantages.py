"""Advantage and return estimators (registry ADVANTAGES)."""

from __future__ import annotations
