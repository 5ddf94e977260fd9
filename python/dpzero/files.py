"""Files written whole or not at all: the bytes go to a temporary file beside the target, are
synced, and the temporary file is renamed over the target (a rename within one directory is
atomic on POSIX), so a reader sees the old file or the new one, never a prefix; on a failure the
temporary file is removed and the target is left as it was."""

from __future__ import annotations

import os
import tempfile
from typing import IO, Callable


def write_atomically(path, write: Callable[[IO], None], binary: bool = True) -> None:
    """Calls ``write(f)`` on a temporary file in ``path``'s directory, then renames it over
    ``path``."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".dpzero-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
