"""Plots saved in the run directory: mean CI per component, and TMS directions."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def plot_mean_ci(ci: dict[str, dict], path: Path, threshold: float) -> Path:
    """One bar chart per site: mean CI per component, sorted, live ones highlighted."""
    sites = list(ci)
    fig, axes = plt.subplots(len(sites), 1, figsize=(8, 2.2 * len(sites)), squeeze=False)
    for ax, s in zip(axes[:, 0], sites):
        mean, mx = ci[s]["mean_ci"], ci[s]["max_ci"]
        order = np.argsort(-mean)
        colors = ["tab:blue" if mx[i] > threshold else "lightgray" for i in order]
        ax.bar(np.arange(len(order)), mean[order], color=colors)
        ax.set_title(f"{s}: {ci[s]['live']} live of {len(mean)} (max CI > {threshold})",
                     fontsize=9)
        ax.set_ylabel("mean CI")
    axes[-1, 0].set_xlabel("component (sorted by mean CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tms_directions(W: np.ndarray, comp_rows: np.ndarray, live: np.ndarray, path: Path
                        ) -> Path:
    """TMS linear1: the target's feature rows W[f] (left) beside each live component's
    direction U[c] scaled by its largest |V[f, c]| (right). Only for 2-d hidden spaces."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 4))
    lim = 1.2 * max(np.abs(W).max(), np.abs(comp_rows).max(initial=1e-6))
    rows = comp_rows[live]
    # colour each component like the feature it points along most closely
    cos = rows @ W.T / np.maximum(np.linalg.norm(rows, axis=1)[:, None]
                                  * np.linalg.norm(W, axis=1)[None], 1e-12)
    matched = cos.argmax(1) if len(rows) else np.zeros(0, int)
    for ax, vecs, colours, title in ((a, W, range(len(W)), "target features W[f]"),
                                     (b, rows, matched, "live components")):
        for v, c in zip(vecs, colours):
            ax.arrow(0, 0, v[0], v[1], head_width=0.04 * lim, length_includes_head=True,
                     color=plt.cm.tab10(int(c) % 10))
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_title(f"{title} ({len(vecs)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_history(history: list[dict[str, float]], path: Path) -> Path:
    """Loss terms (log scale) and L0 per site over training."""
    steps = [h["step"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for k in sorted({k for h in history for k in h if k.startswith("loss/")}):
        a.plot(steps, [max(h.get(k, np.nan), 1e-12) for h in history], label=k[5:])
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_title("loss terms", fontsize=10)
    a.legend(fontsize=7)
    for k in sorted({k for h in history for k in h if k.startswith("train/l0/")}):
        b.plot(steps, [h.get(k, np.nan) for h in history], label=k[9:])
    b.set_xlabel("step")
    b.set_title("L0 (components with CI > threshold, per input)", fontsize=10)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
