"""Errors the engine raises on every rank, each naming the step and what failed."""

from __future__ import annotations


class CommunicationError(RuntimeError):
    """A collective failed or did not complete in time (a rank died, a link went down)."""


class NonFiniteGradientError(FloatingPointError):
    """Some rank produced a NaN/Inf gradient; raised on every rank at the same step."""
