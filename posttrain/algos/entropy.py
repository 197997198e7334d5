"""Token entropy from logits, chunked over the vocabulary."""

from __future__ import annotations
