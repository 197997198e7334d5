"""Loss reductions over a ragged token batch (registry REDUCTIONS)."""

from __future__ import annotations
