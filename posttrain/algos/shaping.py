"""Reward shaping: DAPO soft overlong punishment and the effort/budget penalty."""

from __future__ import annotations
