"""Save and restore the whole TrainState with orbax.

Orbax writes each step to a temporary directory and renames it when complete, so a
killed job never leaves a partial checkpoint that `latest_step` would pick up. A save that
fails (a full disk) raises CheckpointWriteFailed and removes its temporary directory; the
previous step stays as it was, and is what a resume starts from. A complete checkpoint can
still be damaged afterwards (a disk or copy fault): `restore_latest` moves such a step aside
and resumes from the one before it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from pdecomp.core import processes as hosts
from pdecomp.core.storage import WriteFailed, storage_error

UNREADABLE = ".unreadable"  # suffix of a step directory moved aside; orbax ignores it


class UnreadableCheckpoint(Exception):
    """A step whose metadata cannot be read."""


class CheckpointWriteFailed(WriteFailed):
    """A checkpoint could not be written (a full disk); the steps saved before it are intact
    and a resume starts from the newest of them. `str()` is one line."""


def is_array_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 2, writer: bool = False,
                 quiet: bool = False):
        """`writer`: this is the run that saves here (not a reader of a run that may be
        saving): it removes the temporary directories that a killed earlier attempt left.
        `quiet` (process-wide, so a front end's to ask for): orbax's own reports of a failed
        write or of the reads it abandons after a failed read are dropped, since the failure
        is reported once, as CheckpointWriteFailed or in the log of a resume."""
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=writer),
            item_handlers=ocp.StandardCheckpointHandler())  # so item_metadata can read steps
        self._saving: int | None = None  # the step of the save in flight
        self._failed = False
        if quiet:  # before any read: an abandoned read can fail while the failed one returns
            _quiet_abandoned_reads()
        if writer and quiet:
            _quiet_failed_writes()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def item_dir(self, step: int) -> Path:
        """Where the arrays of `step` lie."""
        return self.directory / str(step) / ocp.checkpoint_manager.DEFAULT_ITEM_NAME

    def steps_newest_first(self) -> list[int]:
        """Every complete step, newest first: the order a resume tries them in."""
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state: eqx.Module) -> None:
        """Start saving `step` (in the background). Raises CheckpointWriteFailed for this
        step, or for the one still in flight, which is waited for first so that its failure
        is reported as its own."""
        self.wait()
        arrays, _ = eqx.partition(state, eqx.is_array)
        self._saving = step
        with self._writing():
            self.manager.save(step, args=ocp.args.StandardSave(arrays), force=True)

    def restore(self, state_like: eqx.Module, step: int | None = None) -> eqx.Module:
        """Restore into the structure (and shardings) of `state_like` (concrete or abstract)."""
        step = self.latest_step() if step is None else step
        arrays, static = eqx.partition(state_like, is_array_like)

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        # The item's handler reads the arrays; the manager's restore would add a barrier of
        # every process after the read, which a process whose read failed never reaches
        # (FSDP: each process reads only its own shards). restore_latest agrees instead.
        handler = ocp.StandardCheckpointHandler()
        try:
            restored = handler.restore(
                self.item_dir(step), args=ocp.args.StandardRestore(jax.tree.map(abstract, arrays)))
        finally:
            handler.close()
        return eqx.combine(restored, static)

    def restore_fields(self, fields: dict[str, Any], step: int) -> dict[str, Any]:
        """Only the state's top-level `fields` named, each restored into the structure and
        shardings of its abstract tree (`{"components": ..., "ci_fn": ...}`): the rest of
        the checkpoint (optimizer moments, the adversary) is never read."""
        path = self.item_dir(step)
        handler = ocp.PyTreeCheckpointHandler()
        try:
            stored = handler.metadata(path)
            stored = getattr(stored, "tree", stored)  # nested dicts and lists, as saved
            item = {name: _as_stored(tree, stored[name]) for name, tree in fields.items()}
            restored = handler.restore(path, args=ocp.args.PyTreeRestore(
                item=item, partial_restore=True, restore_args=jax.tree.map(
                    lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), item)))
        finally:
            handler.close()
        return {name: jax.tree_util.tree_map_with_path(
            lambda kp, _, n=name: _at(restored[n], kp), tree) for name, tree in fields.items()}

    def restore_latest(self, state_like: eqx.Module, log: Callable[[str], None]
                       ) -> tuple[eqx.Module | None, int | None]:
        """The newest checkpoint that can be read, restored into `state_like`, and its step;
        (None, None) when there is none.

        A step that cannot be read is moved aside to `<step>.unreadable` (kept, and out of
        the way of the step being saved again) and the one before it is tried, so a damaged
        checkpoint costs the steps since the previous one and needs no one at the console
        (a requeued job). Every process of a job takes the same decision.
        """
        for step in self.steps_newest_first():
            try:
                state, why = self.restore(state_like, step), None
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever orbax raises on damaged files
                first = re.split(r"(?<=\.)\s", str(e).strip(), maxsplit=1)[0]
                state, why = None, f"{type(e).__name__}: {textwrap.shorten(first, 160)}"
            failed = hosts.gather(np.atleast_1d(why is not None))
            if not failed.any():
                return state, step
            if why is None:
                why = f"on process {', '.join(str(i) for i in np.flatnonzero(failed))}"
            aside = self.directory / f"{step}{UNREADABLE}"
            n = 1
            while aside.exists():  # an earlier fault's copy of the same step
                n += 1
                aside = self.directory / f"{step}{UNREADABLE}.{n}"
            if hosts.is_main_process():
                (self.directory / str(step)).rename(aside)
            hosts.barrier(f"pdecomp checkpoint {step} aside")
            self.manager.reload()
            log(f"checkpoint at step {step} cannot be read ({why});"
                f" moved to {aside}")
            if not self.manager.all_steps():
                log("no checkpoint can be read: training starts from step 0")
        return None, None

    def mismatch(self, state_like: eqx.Module, step: int,
                 fields: tuple[str, ...] = ()) -> str | None:
        """Why the checkpoint at `step` holds another run's state (other array names,
        shapes or dtypes), in one line; None when it fits. `fields`: only the state's
        top-level fields named (all when empty). Raises UnreadableCheckpoint when its
        metadata cannot be read."""
        try:
            saved = _by_name(self.manager.item_metadata(step))
        except Exception as e:  # noqa: BLE001 - whatever orbax raises on a damaged step
            raise UnreadableCheckpoint(f"{type(e).__name__}: {e}") from None
        wanted = _by_name(eqx.filter(state_like, is_array_like))
        if fields:
            saved = {k: v for k, v in saved.items() if k.split(".")[0] in fields}
            wanted = {k: v for k, v in wanted.items() if k.split(".")[0] in fields}
        if why := _older_layout(saved):
            return why
        for name in sorted(saved.keys() | wanted.keys()):
            there, here = saved.get(name), wanted.get(name)
            if there != here:
                def show(x):
                    return "absent" if x is None else f"{x[1]}{list(x[0])}"
                return (f"holds another run's state: {name} is {show(there)} there, "
                        f"{show(here)} in this run; resume with that run's settings or choose "
                        "a new directory")
        return None

    def older_layout(self, step: int) -> str | None:
        """Why the checkpoint at `step` cannot be read by this pdecomp whatever the run's
        settings (a layout of an earlier version), in one line; None when it can, or when its
        metadata cannot be read (the read that follows says why)."""
        try:
            return _older_layout(_by_name(self.manager.item_metadata(step)))
        except Exception:  # noqa: BLE001 - a damaged step is reported where it is read
            return None

    def wait(self) -> None:
        """Until the save in flight is complete on disk; CheckpointWriteFailed if it failed."""
        with self._writing():
            self.manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        if self._failed:  # closed when it failed
            return
        self.wait()
        self.manager.close()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A failure of the file system under orbax (raised here or from its threads)
        becomes one CheckpointWriteFailed; the failed step's partial files are removed."""
        try:
            yield
        except Exception as e:
            why = storage_error(e)
            if why is None:
                raise
            raise self._abandon(why) from e

    def _abandon(self, why: str) -> CheckpointWriteFailed:
        """Stop the manager's threads, remove the failed step's temporary directory (rank
        0: it holds every process's shards), and say which step a resume starts from."""
        step, self._saving, self._failed = self._saving, None, True
        with contextlib.suppress(Exception):  # orbax raises the stored failure again
            self.manager.close()
        if hosts.is_main_process():
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        kept = complete_steps(self.directory)
        return CheckpointWriteFailed(
            f"cannot write the checkpoint at step {step} in {self.directory}: {why}; " + (
                f"the last complete checkpoint, step {kept[0]}, is intact" if kept
                else "no checkpoint was written before it"))


def complete_steps(directory: Path) -> list[int]:
    """The steps whose checkpoints are complete (finalized) on disk, newest first: read
    afresh, not from a manager's list, which may still hold a step whose save failed."""
    return sorted(ocp.utils.checkpoint_steps(directory), reverse=True)


def _quiet_abandoned_reads() -> None:
    """After a failed read (or save) orbax abandons the step's other reads (writes). Each
    fails again later, when its coroutine is collected or when it completes into the closed
    event loop, and most print a traceback through `sys.unraisablehook` as they do: from now
    on in this process those are dropped (tensorstore prints some itself)."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_abandoned_reads", False):
        return

    def quiet(unraisable) -> None:
        late = isinstance(unraisable.exc_value, RuntimeError) and \
            "Event loop is closed" in str(unraisable.exc_value)
        if not (late or inspect.iscoroutine(unraisable.object)):
            hook(unraisable)

    quiet.quiets_abandoned_reads = True
    sys.unraisablehook = quiet
    printed = sys.excepthook  # tensorstore's callbacks into the closed loop print through it

    def quiet_printed(kind, value, tb) -> None:
        if not (isinstance(value, RuntimeError) and "Event loop is closed" in str(value)):
            printed(kind, value, tb)

    sys.excepthook = quiet_printed
    # ... and some as asyncio's "Task exception was never retrieved", logged with the trace
    logging.getLogger("asyncio").addFilter(
        lambda r: "exception was never retrieved" not in str(r.msg))


def _quiet_failed_writes() -> None:
    """A failed save is reported once, as CheckpointWriteFailed. Before it reaches us orbax
    has logged the failure of each of its writes as an error with a traceback (and asyncio
    its unretrieved tasks); on a full disk a log file's handler then fails on each of those
    records too, and prints a traceback of its own. Those records are dropped."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FailedWriteRecords) for f in logger.filters):
            logger.addFilter(_FailedWriteRecords())


class _FailedWriteRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        raised = [a for a in (record.exc_info or (None, None))[1:2] + args
                  if isinstance(a, BaseException)]
        if any(storage_error(e) for e in raised):
            return False
        return not re.search(r"\[Errno \d+\]|os_error_code=", str(record.msg))


def _older_layout(saved: dict[str, Any]) -> str | None:
    if any(k.startswith("components.sites.") for k in saved):
        return ("holds components per site, as pdecomp wrote them before it stacked the state "
                "by group (Components.groups): analyze and export read it, a resume needs the "
                "pdecomp that wrote it (its commit is in the run's run.json, under "
                "provenance)")
    return None


def _by_name(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """Array leaves by a dotted name that orbax's metadata and the live pytree share."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if leaf is None:
            continue
        name = ".".join(re.findall(r"\w+", jax.tree_util.keystr(path)))
        out[name] = (tuple(leaf.shape), str(leaf.dtype))
    return out


def key_of(k: Any) -> Any:
    """A jax key path entry as orbax stores it: attribute and dict keys by name, sequence
    entries by index."""
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"unknown key path entry {k!r}")


def _at(stored: Any, path: tuple) -> Any:
    for k in path:
        stored = stored[key_of(k)]
    return stored


def _as_stored(tree: Any, stored: Any) -> Any:
    """`tree`'s abstract arrays (with their shardings) laid out as the checkpoint stores
    them (nested dicts and lists), each checked against the stored shape."""
    def put(kp: tuple, x: jax.ShapeDtypeStruct) -> None:
        node = out
        for k in kp[:-1]:
            node = node.setdefault(key_of(k), {})
        if tuple(_at(stored, kp).shape) != tuple(x.shape):
            raise ValueError(f"{jax.tree_util.keystr(kp)}: stored {_at(stored, kp).shape}, "
                             f"expected {x.shape}")
        node[key_of(kp[-1])] = x

    out: dict = {}
    for kp, x in jax.tree_util.tree_leaves_with_path(tree):
        put(kp, x)
    return _lists(out, stored)


def _lists(node: Any, stored: Any) -> Any:
    """Where the checkpoint stores a list, the same entries as a list."""
    if not isinstance(node, dict):
        return node
    if isinstance(stored, (list, tuple)):
        return [_lists(node[i], stored[i]) for i in range(len(stored))]
    return {k: _lists(v, stored[k]) for k, v in node.items()}
