"""This machine's matmul peak, measured: the yardstick a step's FLOP rate is read against.

Run alone, it also times the products the SmolLM2 LM step is made of (`bench_lm_cpu.py`'s
job), since XLA:CPU's rate for them differs by CPU kind more than the 4096^3 peak does:
    .venv/bin/python bench/peak.py
"""

from __future__ import annotations

import subprocess
import sys

# The SmolLM2 step's products: (name, m, k, n, the right operand stored [n, k])
LM_PRODUCTS = (
    ("MLP gate/up, [1024, 576] x [576, 1536]", 1024, 576, 1536, False),
    ("MLP down, [1024, 1536] x [1536, 576]", 1024, 1536, 576, False),
    ("head, x @ E^T: [1024, 576] x [49152, 576]^T", 1024, 576, 49152, True),
    ("head's input gradient, [1024, 49152] x [49152, 576]", 1024, 49152, 576, False),
    ("4096^3", 4096, 4096, 4096, False),
)


def matmul_rate(m: int, k: int, n: int, dtype: str = "float32", repeats: int = 5,
                accumulate: str | None = None, rhs_transposed: bool = False) -> float:
    """FLOP/s of the best of `repeats` [m, k] x [k, n] products through XLA on JAX's default
    device, at default precision, in a process of its own (the caller holds no device
    memory and keeps no compile); `accumulate`: the product's dtype when not `dtype`
    (bfloat16 operands summed in float32, as `memory.matmul_dtype` runs them);
    `rhs_transposed`: the right operand stored [n, k] and contracted on its second axis."""
    acc = f"jnp.{accumulate}" if accumulate else "None"
    rhs = (n, k) if rhs_transposed else (k, n)
    script = (
        "import time, jax, jax.numpy as jnp\n"
        f"dt = jnp.{dtype}\n"
        f"a = jax.random.normal(jax.random.PRNGKey(0), {(m, k)}, dt)\n"
        f"b = jax.random.normal(jax.random.PRNGKey(1), {rhs}, dt)\n"
        f"f = jax.jit(lambda a, b: jnp.matmul(a, b{'.T' if rhs_transposed else ''}, "
        f"preferred_element_type={acc}))\n"
        "f(a, b).block_until_ready()\n"
        "best = 1e9\n"
        f"for _ in range({repeats}):\n"
        "    t = time.perf_counter(); f(a, b).block_until_ready()\n"
        "    best = min(best, time.perf_counter() - t)\n"
        f"print({2 * m * k * n} / best)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def matmul_peak(n: int, dtype: str = "float32", repeats: int = 5,
                accumulate: str | None = None) -> float:
    """FLOP/s of the best of `repeats` n x n x n products (`matmul_rate`)."""
    return matmul_rate(n, n, n, dtype, repeats, accumulate)


if __name__ == "__main__":
    for name, m, k, n, transposed in LM_PRODUCTS:
        print(f"{name}: {matmul_rate(m, k, n, repeats=10, rhs_transposed=transposed) / 1e9:.0f}"
              " GFLOP/s (float32)")
