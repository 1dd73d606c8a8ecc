"""The error a user's mistake raises, so that a job shows it as one message, not a traceback.

Leaf module: imports nothing. Raised where meta_dist reads what a user gives it (a config key
or value, a command-line word, a data file, a checkpoint, the environment); ``failfast`` prints
it once for the whole job and every rank exits with ``USAGE_EXIT``.
"""

USAGE_EXIT = 2  # the exit code of a job ended by a user's mistake (argparse's, for usage errors)


class UsageError(ValueError):
    """A mistake in what the user gave, with a message that says what, where from, and what to do.

    The message names the thing that is wrong, where it came from (a file, a key, a flag, an
    environment variable) and what to do. Under an MPI launcher (``failfast``) the lowest rank
    that sees it prints it once, prefixed with the script's name; the traceback is shown only
    with ``META_DIST_DEBUG=1``. A ValueError, so code that catches those catches it too.
    """
