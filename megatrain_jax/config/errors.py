"""The one error of the configuration, below the modules that raise it (schema, ranges, load,
hf), so that none of them imports another to raise it."""


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message says which and what would be right."""
