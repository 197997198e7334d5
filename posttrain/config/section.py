"""``Section``: the base of every recipe section (unknown keys are errors; assignments are validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A recipe section: ``extra="forbid"`` (an unknown key is an error naming it) and
    ``validate_assignment`` (a value set after load is validated like a loaded one)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
