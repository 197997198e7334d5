"""Rewards tests: puts this folder on ``sys.path`` so pool worker processes can import the misbehaving test
verifiers of ``_verifiers_for_tests`` by name (``forkserver`` passes ``sys.path`` to workers).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
