"""One job per checkpoint_dir: a lock that the root rank holds while its job trains there.

Leaf module: imports the standard library and files.py; the package's ``__init__`` (which the
trainer uses) imports it. Two jobs in one checkpoint_dir would remove each other's saves under
way (a save's commit removes every ``.tmp-step-N`` it finds, cut off by a crash as it assumes)
and overwrite each other's ``latest``; the second job is refused at its start instead.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import TextIO

from meta_dist.checkpoint.files import CheckpointError

LOCK = ".lock"


class DirectoryInUse(CheckpointError):
    """Another process holds a checkpoint_dir's lock; ``holder`` says which ("pid N on host H")."""

    def __init__(self, directory: Path, holder: str) -> None:
        self.directory, self.holder = directory, holder
        super().__init__(f"checkpoint: {directory} is in use by another job ({holder} holds "
                         f"{directory / LOCK})")


def hold(directory: str | Path) -> TextIO | None:
    """Lock checkpoint_dir ``directory`` (created) for this process; rank 0 only.

    flock, not a file's mere presence: the kernel drops the lock when the process ends, however
    it ends, so a job killed mid-run leaves no stale lock (the file stays, unlocked). Released
    when the returned file is closed. A second open of the lock in this same process is refused
    like another job's (flock locks an open file, not a process).

    Returns:
        The open lock file, or None where the filesystem has no flock (then nothing is locked:
        the job runs as it did before the lock existed).

    Raises:
        DirectoryInUse: another process holds it.
        OSError: the lock file cannot be made there.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # not "w": that would empty a holder's line; bytes not UTF-8 (a damaged file) name it anyway
    stream = (directory / LOCK).open("a+", errors="replace")
    try:
        fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never waits: a refusal is at once
    except OSError as error:
        stream.seek(0)
        holder = stream.read().strip() or "a process"
        stream.close()
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DirectoryInUse(directory, holder) from None
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise
    stream.truncate(0)  # a killed holder's line, if any, is replaced
    stream.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    stream.flush()
    return stream
