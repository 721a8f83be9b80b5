"""The error a sweep raises when it cannot run as asked."""

from __future__ import annotations


class SweepError(RuntimeError):
    """A sweep cannot run as asked (bad model list, unknown registry, Ray unavailable, workers that cannot start)."""
