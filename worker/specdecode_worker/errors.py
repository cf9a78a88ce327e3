"""Errors a user can cause and fix; the CLI prints them without a traceback (exit code 2)."""


class InputError(ValueError):
    """Bad input: the message names the file and the field, and says what to change."""
