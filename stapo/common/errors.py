"""The configuration error every layer raises (a config key with a bad value), defined below them all."""
from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""
