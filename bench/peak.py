"""This machine's matmul peak, measured: the yardstick a step's FLOP rate is read against."""

from __future__ import annotations

import subprocess
import sys


def matmul_peak(n: int, dtype: str = "float32", repeats: int = 5,
                accumulate: str | None = None) -> float:
    """FLOP/s of the best of `repeats` n x n x n products through XLA on JAX's default
    device, at default precision, in a process of its own (the caller holds no device
    memory and keeps no compile); `accumulate`: the product's dtype when not `dtype`
    (bfloat16 operands summed in float32, as `memory.matmul_dtype` runs them)."""
    acc = f"jnp.{accumulate}" if accumulate else "None"
    script = (
        "import time, jax, jax.numpy as jnp\n"
        f"n, dt = {n}, jnp.{dtype}\n"
        "a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dt)\n"
        f"f = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type={acc}))\n"
        "f(a).block_until_ready()\n"
        "best = 1e9\n"
        f"for _ in range({repeats}):\n"
        "    t = time.perf_counter(); f(a).block_until_ready()\n"
        "    best = min(best, time.perf_counter() - t)\n"
        "print(2 * n ** 3 / best)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])
