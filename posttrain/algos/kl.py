"""KL estimators (registry KL_ESTIMATORS) and the adaptive KL coefficient controller."""

from __future__ import annotations
