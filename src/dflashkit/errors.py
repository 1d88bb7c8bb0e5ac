"""Errors a user can meet. Each one is a single clear line that says what happened and what to do;
the command line prints it without a traceback (set DFLASHKIT_TRACEBACK=1 to see one)."""

from __future__ import annotations


class DflashkitError(Exception):
    """Base of every user-facing error."""


class ConfigError(DflashkitError):
    """A config file or override is invalid, or two parts of a run disagree."""


class DataError(DflashkitError):
    """An input file is malformed (the message names file and line)."""


class CheckpointError(DflashkitError):
    """A checkpoint is missing, malformed, or belongs to another target."""


class EnvironmentDriftError(DflashkitError):
    """The environment changed in a way that can change compiled behaviour."""


class DeviceError(DflashkitError):
    """A device that the run needs is missing."""


class NonFiniteLossError(DflashkitError):
    """The training loss became NaN or infinite; the optimizer step it would have taken was not applied."""
