"""The job-side pieces of a run that need no cluster: the CPU device count a process takes,
and what a SLURM rank does when the coordinator never answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from launcher import cluster


def test_cpu_device_count_only_on_request(monkeypatch) -> None:
    """XLA's one CPU device unless PDECOMP_CPU_DEVICES asks for more; other flags kept, and
    a device count already in XLA_FLAGS (the user's own) wins."""
    monkeypatch.delenv("PDECOMP_CPU_DEVICES", raising=False)
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=x")
    cluster.split_cpu_devices()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=x"
    monkeypatch.setenv("PDECOMP_CPU_DEVICES", "3")
    cluster.split_cpu_devices()
    flags = os.environ["XLA_FLAGS"].split()
    assert sorted(flags) == ["--xla_dump_to=x", "--xla_force_host_platform_device_count=3"]
    # two XLA threads per simulated device, so no device waits on a thread at a collective
    assert int(os.environ["NPROC"]) >= 6
    monkeypatch.setenv("PDECOMP_CPU_DEVICES", "2")
    cluster.split_cpu_devices()
    assert os.environ["XLA_FLAGS"].split() == flags


def test_gpus_split_only_between_tasks_that_share_them(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x8)")
    assert cluster.local_device_ids() is None  # one process drives all eight
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert cluster.local_device_ids() == [6, 7]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # SLURM bound one GPU to each task
    assert cluster.local_device_ids() is None


def test_unreachable_coordinator_ends_the_rank_instead_of_hanging() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("from launcher import cluster; "
              f"cluster.init_distributed(cluster.Ranks(1, 2), 3, '127.0.0.1:{port}')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode != 0
    assert f"[rank 1/2] joining jax.distributed at 127.0.0.1:{port}" in proc.stderr
    assert "mesh.init_timeout_s" in proc.stderr and "DEADLINE_EXCEEDED" in proc.stderr
