"""Writing a run's files so that a fault of the disk (full, over a quota, read-only, failing)
costs no finished work: each file is written whole or not at all, and the failure is one
`WriteFailed` naming the file, not a traceback from wherever the write happened to be."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdecomp.core.exits import Refused

# tensorstore (orbax's array writer) and safetensors (Rust's io::Error) report the errno in
# their message, not as an OSError.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)|\(os error (\d+)\)")


class DamagedFile(Refused):
    """A file a command reads is not what pdecomp wrote there (cut short, edited by hand, of
    another format): `str()` is one line naming it and what is wrong."""


def read_json(path: Path, missing_ok: bool = True) -> Any:
    """A JSON file's value; None where there is no file (when `missing_ok`). DamagedFile,
    naming the file, for one that is not JSON or cannot be read."""
    if missing_ok and not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise DamagedFile(f"{path}: damaged, not JSON ({_first_line(e)}); restore it or "
                          "remove it") from None
    except OSError as e:
        raise DamagedFile(f"{path}: cannot be read ({e.strerror})") from None


def read_yaml(path: Path) -> Any:
    """A YAML file's value; DamagedFile, naming the file, for one that is not YAML."""
    import yaml

    try:
        return yaml.safe_load(path.read_bytes().decode("utf-8"))
    except (ValueError, yaml.YAMLError) as e:
        raise DamagedFile(f"{path}: damaged, not YAML ({_first_line(e)}); restore it") from None
    except OSError as e:
        raise DamagedFile(f"{path}: cannot be read ({e.strerror})") from None


def read_tokenizer(path: Path) -> Any:
    """A Hugging Face `tokenizer.json` as a `tokenizers.Tokenizer`; DamagedFile, naming the
    file, for one the tokenizers package cannot read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises bare Exceptions
        raise DamagedFile(f"{path}: not a tokenizer the tokenizers package reads "
                          f"({_first_line(e)}); restore it") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
            code = int(m.group(1) or m.group(2))
        if code:
            return os.strerror(code).lower()
        cur = cur.__cause__ or cur.__context__
    return None


def unwritable(path: Path) -> str | None:
    """Why `path` (a directory, there or to be made) cannot be made and written in, or None.
    Found for real: a directory is made (and removed) where the first missing part of
    `path` would go, so a read-only file system, missing permissions and a file in the way
    are all caught."""
    existing = path
    while not (existing.exists() or existing.is_symlink()):
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pdecomp-", dir=existing))
    except OSError as e:
        return f"cannot make a directory in {existing}: {e.strerror}"
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and (why := storage_error(e)):
            raise WriteFailed(f"cannot write {final}: {why}") from e
        raise
    return final


def replace_files(final: Path, names: tuple[str, ...], write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a fresh directory inside `final`, then each of `names` renamed over
    its own in `final`: every other file of `final` is left as it was, and a failed write
    leaves all of `names` as they were."""
    tmp = final / ".write-failed"
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".write-", dir=final))
        write(tmp)
        for name in names:
            (tmp / name).replace(final / name)
    except Exception as e:
        why = storage_error(e)
        if why is None:
            raise
        raise WriteFailed(f"cannot write {final}: {why}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))
