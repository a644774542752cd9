"""One way to say what went wrong on one line: :func:`schemas.errors.one_line`, re-exported here
for the services (it lives in ``schemas`` so that the trainer, rollout and envs packages, which
import ``schemas`` only, use the same function)."""

from __future__ import annotations

from schemas.errors import one_line

__all__ = ["one_line"]
