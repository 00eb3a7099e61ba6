"""The error every layer raises for options that cannot work; kept apart so that the planner and
the sharding layer can raise it without importing the options module."""


class ConfigError(ValueError):
    """The options given cannot work for this model (e.g. an in-flight budget below a bucket).

    Raised even without ``strict=True``: falling back to the eager runtime would run the
    model, but hide a setting the user has to change.
    """
