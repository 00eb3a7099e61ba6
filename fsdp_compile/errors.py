"""Errors that name a user's mistake rather than a limitation of a pass."""

from __future__ import annotations


class ConfigError(ValueError):
    """The options given cannot work for this model (e.g. an in-flight budget below a bucket).

    Raised even without ``strict=True``: falling back to the eager runtime would run the
    model, but hide a setting the user has to change.
    """
