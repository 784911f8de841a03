"""The one exception type for bad user input.

Anything the user can fix (a flag, a mesh, a batch size, a missing data set, a corrupt
checkpoint) raises UsageError with a one-line message naming the problem and the fix; the
entry points print it and exit with status 2 before writing anything.
"""


class UsageError(ValueError):
    """Bad input that the user can fix; the message says how."""
