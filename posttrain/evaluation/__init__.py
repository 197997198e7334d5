"""Held-out evaluation and run reports."""
