"""The errors every floor may raise: the ground floor of the package (it imports nothing of posttrain).

- :class:`UserError`: caused by the user's input (a run directory, a resume, a judged-nothing run);
  the command line prints it as one line and exits with code 2 (:func:`posttrain.cli.main`).
- :class:`ConfigError`: a recipe or an override is invalid; the message names the key (and the
  file). A ``ValueError``, which the command line prints as one line with exit code 2 too.
"""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit code 2."""


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key (and file)."""
