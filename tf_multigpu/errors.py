"""The exception types for bad user input and for runs that do not fit the devices.

Anything the user can fix (a flag, a mesh, a batch size, a missing data set, a corrupt
checkpoint) raises UsageError with a one-line message naming the problem and the fix; the
entry points print it and exit with status 2 before writing anything. `error_reason` is the
informative line of a runtime error that such a message quotes.
"""

import re


class UsageError(ValueError):
    """Bad input that the user can fix; the message says how."""


class DoesNotFit(UsageError):
    """The run needs more device memory than --device_memory_limit (or the device) has.

    Entry points exit with status 3 for it, so a search over batch sizes can tell "too big"
    from a mistake (2).
    """


def error_reason(e: Exception, limit: int = 240) -> str:
    """An error's first line that says something, without TensorFlow's wrapping (a graph
    error's "Graph execution error:", "N root error(s) found.", "(0) INVALID_ARGUMENT:",
    "Detected at node ..." and stack lines, {{function_node ...}}, [[{{node ...}}]]), shortened
    at a word."""
    for line in str(e).splitlines():
        line = re.sub(r"\{\{[^}]*\}\}|\[\[[^\]]*\]\]", "", line).strip(" \t;:")
        line = re.sub(r"^\(\d+\) [A-Z_]+:\s*", "", line)   # one of several devices' errors: "(0) INVALID_ARGUMENT:"
        if (line and not line.startswith(_WRAPPING) and not line.startswith(("File ", "<"))
                and not _ROOT_ERRORS.match(line)):
            break
    else:
        return type(e).__name__
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


_WRAPPING = ("Graph execution error", "Detected at node", "Detected unsupported operations")
_ROOT_ERRORS = re.compile(r"\d+ root error\(s\) found")
