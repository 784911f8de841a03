"""The exception types for bad user input and for runs that do not fit the devices.

Anything the user can fix (a flag, a mesh, a batch size, a missing data set, a corrupt
checkpoint) raises UsageError with a one-line message naming the problem and the fix; the
entry points print it and exit with status 2 before writing anything.
"""


class UsageError(ValueError):
    """Bad input that the user can fix; the message says how."""


class DoesNotFit(UsageError):
    """The run needs more device memory than --device_memory_limit (or the device) has.

    Entry points exit with status 3 for it, so a search over batch sizes can tell "too big"
    from a mistake (2).
    """
