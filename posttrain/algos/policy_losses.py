"""Policy losses (registry POLICY_LOSSES)."""

from __future__ import annotations
