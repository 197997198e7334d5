"""On-policy distillation token losses."""

from __future__ import annotations
