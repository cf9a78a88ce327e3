"""What `plan` and `fetch` leave in Kubernetes' termination log, and how a failure ends them.

Both commands run as pods whose one-line outcome the operator reads from the container's
termination message: the result on success, the error on failure (the hub token masked).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Callable

from .contract import ExitCode
from .errors import InputError
from .flags import asks_for_help
from .planner.hub import HubError, redact

# What a command's work returns: the termination-log text, the exit code, and what shows the result
# once the log is written (or None).
Outcome = tuple[str, int, Callable[[], None] | None]


def log_path_in(argv: list[str]) -> str | None:
    """``--termination-log``'s value, read before parsing so that even a flag error reaches it."""
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--termination-log"), None)


def write(command: str, path: str | None, text: str) -> None:
    if path:
        try:
            Path(path).write_text(text)
        except OSError as exc:
            print(f"specdecode-worker {command}: cannot write --termination-log {path}: {exc.strerror}",
                  file=sys.stderr)


def fail(command: str, exc: Exception, path: str | None) -> int:
    """Report ``exc`` on stderr and in the log; the exit code says whether a retry may help."""
    if isinstance(exc, InputError):
        message = redact(" ".join(str(exc).split()))
        print(message, file=sys.stderr)
        write(command, path, message)
        return ExitCode.HUB_UNAVAILABLE if isinstance(exc, HubError) and exc.retryable else ExitCode.BAD_INPUT
    # A bug, not the user's input: keep the traceback for the report.
    print(redact(traceback.format_exc()), file=sys.stderr, end="")
    write(command, path, redact(f"internal error: {type(exc).__name__}: {exc}"))
    return ExitCode.INTERNAL_ERROR


def run(command: str, parser: Callable[[], argparse.ArgumentParser], argv: list[str] | None,
        work: Callable[[argparse.Namespace], Outcome]) -> int:
    """The frame of a command that reports through the termination log: -h, the flags, then
    ``work``; any failure, a flag error included, ends it through ``fail``."""
    argv = sys.argv[1:] if argv is None else argv
    if asks_for_help(argv):
        parser().print_help()
        return ExitCode.OK
    path = log_path_in(argv)
    try:
        args = parser().parse_args(argv)
        path = args.termination_log
        text, code, show = work(args)
    except Exception as exc:
        return fail(command, exc, path)
    write(command, path, text)
    if show is not None:
        show()
    return code
