"""Critic value loss, clipped and unclipped."""

from __future__ import annotations
