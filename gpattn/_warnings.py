"""gpattn's own warning classes, filtered by class (``warnings.simplefilter("ignore", gpattn.OldVersionWarning)``)."""

from __future__ import annotations

__all__ = ["OldVersionWarning"]


class OldVersionWarning(UserWarning):
    """A run, config or state dict written by an older gpattn was migrated on load; the message names what was
    migrated (gpattn._migrate holds every migration; docs/new_variant.md the rule)."""
