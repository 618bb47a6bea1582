"""The process-wide switches a `pdecomp` job sets on its CPU host, each once, in the job
(`launcher/job.py`): a library caller's process is left as it was. Why and what they cost,
measured: docs/cli.md, "CPU hosts"."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import jax

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt params


@functools.cache
def keep_freed_blocks() -> bool:
    """Let glibc keep freed blocks for reuse instead of handing them back to the kernel.

    XLA:CPU allocates each step's temporaries with malloc. glibc serves blocks over its mmap
    threshold with fresh mappings and unmaps them on free, so every step page-faults its
    temporaries in again: with TMS 5-2 at batch 4096 that was 40% of the step (19.9 ms →
    11.9 ms with blocks reused). The process's resident memory stays at its peak instead.
    Blocks over 64 MiB that XLA allocates on its own threads are out of its reach: each
    thread's arena is at most that, so they are fresh mappings every step; a program run
    inline allocates its temporaries on the caller's thread (`run_programs_inline`).
    Returns False where the C library is not glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (AttributeError elsewhere)
    except (OSError, AttributeError, TypeError):
        return False
    # A fixed threshold also stops glibc from adapting it back down; at its largest (an int),
    # since at 1 GiB the mlp CI function's SmolLM2 step (1-2 GiB of temporaries) still
    # mapped them anew every step (2.6 against 2.24 s).
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, (1 << 31) - 1), (_M_TRIM_THRESHOLD, (1 << 31) - 1),
        (_M_TOP_PAD, 64 << 20)))


def run_programs_inline() -> None:
    """Before JAX starts its CPU backend: run each CPU program on the thread that calls it.

    By default XLA:CPU runs a program on a worker thread of its client, and allocates the
    program's temporaries there. glibc gives such a thread an arena of at most 64 MiB, so
    a larger block is a fresh mapping, unmapped again when the program ends, whatever
    `keep_freed_blocks` asks: a SmolLM2 step (a 968 MB block of temporaries) faulted
    287,000 pages in anew every step. Run inline, the block comes from the main arena,
    which keeps it: 49,000 faults and 2.25 -> 1.98 s per step (bench/RESULTS.md). The cost
    is that Python no longer runs ahead of the host's computation, which a training step
    that waits on nothing between steps does not use. And in some processes the heap
    holds a few extra copies of such a block: glibc before its 2023 mend (bug 30723) keeps
    the pieces it trims off XLA's 64-byte-aligned blocks in its per-thread cache, unmerged,
    so a freed block falls a few bytes short of the next identical request (docs/cli.md:
    the figures, and the remedy for a job at the edge of host memory). No effect once the
    backend exists, nor on an accelerator's programs.
    """
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def keep_freed_blocks_on_cpu() -> None:
    """After the frozen target is loaded (kept from the start, the loader's freed host
    copies stayed resident for the whole run): `keep_freed_blocks` on a CPU backend."""
    if jax.default_backend() == "cpu":
        keep_freed_blocks()
