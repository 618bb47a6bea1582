"""Writing a run's files so that a fault of the disk (full, over a quota, read-only, failing)
costs no finished work: each file is written whole or not at all, and the failure is one
`WriteFailed` naming the file, not a traceback from wherever the write happened to be."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# tensorstore (orbax's array writer) reports the errno in its message, not as an OSError.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


class WriteFailed(Exception):
    """A file of the run could not be written: a fault of the machine, not of the run's
    settings. `str()` is one line naming the file and the system's reason."""


def storage_error(e: BaseException) -> str | None:
    """The system's reason, in lower case ("no space left on device"), when `e` or an
    exception it was raised from failed on the file system; None for any other error.

    Orbax raises OSError from its own threads, and tensorstore's ValueError
    ("RESOURCE_EXHAUSTED: ... [os_error_code='28']"), sometimes as the cause of another."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        code = cur.errno if isinstance(cur, OSError) else None
        if code is None and (m := _OS_ERROR_CODE.search(str(cur))):
            code = int(m.group(1))
        if code:
            return os.strerror(code).lower()
        cur = cur.__cause__ or cur.__context__
    return None


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)`, then `tmp` renamed over `path`: a reader (a resumed run) sees the old
    file or the new one, never half of one. A failure of the file system raises WriteFailed
    naming `path`, after removing the half-written `tmp` (on a full disk, its space)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except Exception as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = storage_error(e)
        if why is None:
            raise
        raise WriteFailed(f"cannot write {path}: {why}") from e
    return path


def write_dir(final: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a fresh directory beside `final`, then swapped in for `final`: a
    failure leaves the previous `final` (or none) and no partial one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's is private; what is written here is for reading
        write(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
            final.rename(old / final.name)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))
