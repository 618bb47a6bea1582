"""Inside a SLURM job: this task's rank, `jax.distributed`, and the signals SLURM sends
before it stops a job.

Every task of a job runs the whole task function; this module is what makes them one run:
one coordinator that every rank can reach, one global set of devices, and one agreed step at
which all of them checkpoint when the job is about to be preempted or to hit its time limit.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Self

from pdecomp.core.exits import EXIT_BAD_CONFIG, EXIT_INTERRUPTED


@dataclass(frozen=True)
class Ranks:
    process_id: int = 0
    num_processes: int = 1
    node: int = 0
    num_nodes: int = 1


def in_slurm_job() -> bool:
    """Under submitit's SLURM executor (not its local one, not a plain process)."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_JOB_ID" in os.environ


def job_ranks() -> Ranks:
    if not in_slurm_job():
        return Ranks()
    import submitit

    env = submitit.JobEnvironment()
    return Ranks(env.global_rank, env.num_tasks, env.node, env.num_nodes)


def split_cpu_devices() -> None:
    """`$PDECOMP_CPU_DEVICES=N`: N simulated XLA CPU devices in this process (to try a data
    axis or FSDP on a laptop); set before JAX starts its backend. Without it a process has
    XLA's one CPU device, which already spreads each op over every core, and which the toys
    run faster on (bench/RESULTS.md). An `XLA_FLAGS` device count of the user's own wins.
    sbatch passes the submitting environment on, so every task of a job gets the same."""
    flags = os.environ.get("XLA_FLAGS", "")
    n = os.environ.get("PDECOMP_CPU_DEVICES", "")
    if not n or "xla_force_host_platform_device_count" in flags:
        return
    if not n.isdigit() or int(n) < 1:  # XLA would abort at start-up on it
        print(f"config error: PDECOMP_CPU_DEVICES={n!r}: give a whole number of CPU devices, "
              f"1 or more", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("NPROC", cpu_device_threads(int(n)))


def cpu_device_threads(n: int) -> str:
    """XLA:CPU's thread-pool size (`$NPROC`, read when its client starts) for `n` simulated
    devices: two threads per device, at least the machine's cores. The pools are sized to the
    cores by default; on two cores, with 8 devices, two devices blocked in different
    collectives while the rest waited for a thread, and XLA ended the process after 40 s
    (an all-gather that only 4 of 8 devices reached)."""
    return str(max(2 * n, os.cpu_count() or 1))


def coordinator_address() -> str:
    """host:port of rank 0's process, the same on every rank.

    The host is the first node of the job as SLURM addresses it (`NodeAddr`): node names
    need not resolve (emulated nodes, clusters with a private naming scheme), and JAX's own
    SLURM detection would then wait out its timeout and abort. The port is derived from the
    job id and the restart count, so two jobs on one node, or a requeued job whose old
    coordinator port is still in TIME_WAIT, do not collide.
    """
    first = _scontrol(["show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).split()[0]
    fields = dict(kv.split("=", 1) for kv in _scontrol(["show", "node", first, "-o"]).split()
                  if "=" in kv)
    host = fields.get("NodeAddr") or first
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass  # let the coordinator client report it, with the timeout below
    job = int(os.environ["SLURM_JOB_ID"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    # Below 32768, where Linux starts handing out ephemeral ports.
    return f"{host}:{20000 + (job * 7 + restart) % 12000}"


def _scontrol(args: list[str]) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True,
                          timeout=60).stdout


def init_distributed(ranks: Ranks, timeout_s: int, address: str | None = None) -> None:
    """Join the job's processes into one JAX runtime.

    A rank that cannot reach the coordinator within `timeout_s` is ended by XLA itself
    (SIGABRT, "DEADLINE_EXCEEDED"), not by an exception; the line logged first says what it
    was waiting for, and srun's --kill-on-bad-exit then ends the job's other ranks.
    """
    if ranks.num_processes == 1:
        return
    import jax

    address = address or coordinator_address()
    say(ranks, f"joining jax.distributed at {address} (waits up to {timeout_s}s: "
               "mesh.init_timeout_s)")
    # JAX's own SLURM detection would give each process only GPU number SLURM_LOCALID, also
    # when one process per node is meant to drive all of the node's GPUs.
    jax.distributed.initialize(address, num_processes=ranks.num_processes,
                               process_id=ranks.process_id,
                               local_device_ids=local_device_ids(),
                               cluster_detection_method="deactivate",
                               initialization_timeout=timeout_s)


def local_device_ids() -> list[int] | None:
    """The GPUs (ordinals among those visible) this process drives: all it sees (None),
    unless several tasks on this node see the same GPUs, which they then split evenly."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    per_node = int(re.match(r"\d+", os.environ.get("SLURM_TASKS_PER_NODE", "1")).group())
    if len(visible) <= 1 or per_node <= 1 or len(visible) % per_node:
        return None
    k, local = len(visible) // per_node, int(os.environ.get("SLURM_LOCALID", "0"))
    return list(range(local * k, (local + 1) * k))


@dataclass
class StopSignals:
    """Signals that stop training at the next step boundary, with a checkpoint; installed
    for the length of a `with` block, the handlers that were there before put back after.

    In a SLURM job: the warning signal SLURM sends before a time limit or preemption
    (submitit asks for USR2) means checkpoint and requeue; SIGTERM (scancel, or a requeue
    someone else started) means checkpoint and stop. Anywhere else: SIGTERM and Ctrl-C
    (SIGINT) mean checkpoint and stop, exiting 128 + the signal's number as a shell would
    (143, 130); a second Ctrl-C stops at once, without waiting for the step to end.
    """

    in_slurm: bool = False
    received: list[str] = field(default_factory=list)
    _before: dict[signal.Signals, object] = field(default_factory=dict)

    def install(self) -> None:
        """From now on (again: a no-op)."""
        self._usr = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
        for sig in (self._usr, signal.SIGTERM) if self.in_slurm else (signal.SIGTERM,
                                                                        signal.SIGINT):
            if sig not in self._before:
                self._before[sig] = signal.signal(sig, self._on_signal)

    def __enter__(self) -> Self:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._before.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT":
            if name in self.received:
                interrupted(signum, frame)
            print("Ctrl-C: stopping at the next step boundary, with a checkpoint "
                  "(Ctrl-C again stops at once, without one)", file=sys.stderr, flush=True)
        self.received.append(name)

    def stop_requested(self) -> bool:
        return bool(self.received)

    def requeue_requested(self) -> bool:
        return self.in_slurm and self._usr.name in self.received

    def exit_code(self) -> int:
        """What a shell reports for the first stop signal: 128 + its number."""
        return 128 + signal.Signals[self.received[0]].value


def interrupted(signum: int, frame: object, stderr_fd: int = 2) -> None:
    """Ctrl-C that stops at once: one line, exit 130, no cleanup to wait for (nothing
    half-written is ever taken for a result: checkpoints and files are written whole)."""
    for stream in (sys.stdout, sys.stderr):
        try:  # what was printed before; the signal may have come in the middle of a print
            stream.flush()
        except (OSError, RuntimeError, ValueError):
            pass
    os.write(stderr_fd, b"interrupted (Ctrl-C): exit 130\n")  # not print: not re-entrant
    os._exit(EXIT_INTERRUPTED)


def requeue(max_requeues: int) -> str:
    """Put this job back in the queue (it resumes from its checkpoint); why not, if not."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        return (f"not requeued: the job has restarted {restarts} times "
                f"(hydra.launcher.max_num_timeout={max_requeues})")
    job = os.environ["SLURM_JOB_ID"]
    try:
        _scontrol(["requeue", job])
    except subprocess.CalledProcessError as e:
        return f"not requeued: scontrol requeue {job} failed: {e.stderr.strip()}"
    return f"requeued job {job} (restart {restarts + 1} of at most {max_requeues})"


def say(ranks: Ranks, message: str) -> None:
    """One line on this rank's own log (every rank has one), so each rank's end is on record."""
    print(f"[rank {ranks.process_id}/{ranks.num_processes}] {message}", file=sys.stderr,
          flush=True)


def leave(ranks: Ranks, message: str, code: int) -> None:
    """End this rank with one line on stderr and exit `code`. In a job of several processes
    it leaves at once: the others may be waiting for it in a collective or a checkpoint's
    barrier it will not reach, and a normal exit would first wait in jax.distributed's
    shutdown barrier; srun's --kill-on-bad-exit then ends them."""
    if ranks.num_processes > 1:
        say(ranks, message)
        sys.stdout.flush()
        os._exit(code)
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)
