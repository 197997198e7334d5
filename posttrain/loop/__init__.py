"""Drivers: the audited RL iteration (synchronous barrier)."""
