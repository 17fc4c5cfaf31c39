"""One exception family for user mistakes.

Anything a user can get wrong (a config value, a data file, a checkpoint directory,
an HTTP body) raises a subclass of ``AstraiError`` whose message says what was wrong
and what to do. The CLI prints these without a traceback; internal bugs still raise
ordinary exceptions so they stay loud.
"""


class AstraiError(Exception):
    """Base class: a problem with the user's input, explained in the message."""


class ConfigError(AstraiError, ValueError):
    """A configuration field has an invalid value."""


class DataError(AstraiError, ValueError):
    """A data file or record is malformed."""


class CheckpointError(AstraiError):
    """A model or training checkpoint directory is missing, incomplete or tampered with."""


class RequestError(AstraiError, ValueError):
    """An inference request has invalid parameters."""


class OverloadedError(AstraiError):
    """The engine's queue is full; the caller should retry later (HTTP 429/503)."""
