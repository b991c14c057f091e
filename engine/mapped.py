"""Files the engine reads through memory maps, watched for in-place changes while it runs (:class:`MappedFile`).

A mapping of a file that is truncated under it faults when a page past the new end is read: the process dies with
SIGBUS ("Bus error", exit 135), outside the exit-code contract and without naming the file. Replacing the file by
rename does not (the mapping keeps the old inode); truncating or rewriting it in place does. So each mapped file
keeps a descriptor of the inode it mapped and is compared, before every step the engine runs
(:meth:`strata.engine.core.Engine.check_files`), with the size it had at start-up: one ``fstat`` per file per
step (a microsecond or two). A change inside one step still faults; every later step is refused cleanly.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import MappedFileChanged


class MappedFile:
    """``path`` as the engine mapped it: its size at start-up (bytes) and an open descriptor of that inode.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def check(self) -> None:
        """Refuse if the mapped inode's size is no longer its start-up size.

        Raises:
            MappedFileChanged: naming the file and both sizes.
        """
        now = os.fstat(self._fd).st_size
        if now != self.size:
            raise MappedFileChanged(
                f"{self.path}: changed size while the engine runs ({self.size} B at start-up, {now} B now): it was "
                "truncated or rewritten in place; the engine reads it through a memory map and stops here instead "
                "of faulting - restore the file (or rebuild the pack) and start again"
            )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


__all__ = ["MappedFile"]
