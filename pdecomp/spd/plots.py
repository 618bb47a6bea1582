"""Plots saved in the run directory: mean CI per component, and TMS directions; the
analysis report's (firing frequency against norm, toys' CI per feature); and the memory of
a sweep's jobs, saved in the sweep directory."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np

from pdecomp.core.storage import atomic_write
from pdecomp.core.units import GiB, MiB, fmt_bytes


class _Pyplot:
    """matplotlib.pyplot (Agg) on first use: importing it is 0.25 s of every process that
    imports this module, most of which draw nothing (a gate, `--help`, a SLURM rank)."""

    def __getattr__(self, name: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

        return getattr(matplotlib.pyplot, name)


plt = _Pyplot()


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
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # ranks: no tick at 2.5
    axes[-1, 0].set_xlabel("component (sorted by mean CI)")
    fig.tight_layout()
    _save(fig, path, dpi=120)
    return path


def plot_ci_distribution(ci: dict[str, dict], folder: Path, threshold: float,
                         edges: Sequence[float]) -> Path:
    """The slow tier of the in-loop evaluation, one row per site: the histogram of every CI
    value over `edges` (left) and of the components' firing densities, log-spaced (right)."""
    sites = list(ci)
    fig, axes = plt.subplots(len(sites), 2, figsize=(10, 2.2 * len(sites)), squeeze=False)
    for (a, b), s in zip(axes, sites):
        hist = ci[s]["ci_hist"]
        a.bar(np.arange(len(hist)), hist / max(hist.sum(), 1), color="tab:blue")
        a.set_xticks(np.arange(len(hist)), [f"<{e:g}" for e in edges[1:]],
                     fontsize=6, rotation=45)
        a.set_yscale("log")
        a.set_title(f"{s}: CI values (share of rows x components)", fontsize=9)
        density = ci[s]["density"]
        dead = int((density == 0).sum())
        bins = np.logspace(-6, 0, 25)
        b.hist(np.clip(density[density > 0], 1e-6, 1), bins=bins, color="tab:orange")
        b.set_xscale("log")
        b.set_title(f"{s}: firing density (CI > {threshold}); {dead} never fire", fontsize=9)
    axes[-1, 1].set_xlabel("share of positions a component fires on")
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ci_distribution.png"
    _save(fig, path, dpi=110)
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
    _save(fig, path, dpi=120)
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
    _save(fig, path, dpi=120)
    return path


def _draw_caps(ax: plt.Axes, x: np.ndarray, reports: list[dict], scale: float, ytop: float
               ) -> list[str]:
    """The cap as a dashed red line, one segment per bar when the jobs' caps differ; then
    each job's cap is returned as a line for its tick label, where no bar can hide it. A cap
    above the axis is only named, so that MiB-sized toy bars stay readable under a host-RAM
    cap of many GiB."""
    caps = np.array([r["cap_bytes"] for r in reports], float)
    if len(set(caps)) > 1:
        ax.hlines(caps / scale, x - 0.4, x + 0.4, colors="red", linestyles="--",
                  label="cap (per job)")
        return [f"cap {fmt_bytes(c)}" + (" ↑" if c / scale > ytop else "") for c in caps]
    above = caps[0] / scale > ytop
    label = f"cap {fmt_bytes(caps[0])}" + (" (above the axis)" if above else "")
    if source := reports[0].get("cap_source"):
        label += f"\n{source}"
    if above:
        ax.plot([], [], color="red", ls="--", label=label)
    else:
        ax.axhline(caps[0] / scale, color="red", ls="--", label=label)
    return [""] * len(reports)


def _job_ticks(ax: plt.Axes, x: np.ndarray, labels: list[str], notes: list[str]) -> None:
    """Job labels under the bars, each with its note as a last line; a key every label
    shares (one swept key) moves to the axis label, leaving the values as ticks."""
    keys = {lab.partition("=")[0] for lab in labels}
    if len(keys) == 1 and all("=" in lab and "\n" not in lab for lab in labels):
        ax.set_xlabel(keys.pop())
        labels = [lab.partition("=")[2] for lab in labels]
    ax.set_xticks(x, [f"{lab}\n{n}" if n else lab for lab, n in zip(labels, notes)],
                  fontsize=8)


def _overlapping(texts: list[plt.Text]) -> bool:
    """Whether neighbouring texts (tick labels, left to right) overlap as laid out now."""
    texts[0].figure.canvas.draw()
    boxes = [t.get_window_extent() for t in texts]
    return any(a.x1 > b.x0 for a, b in pairwise(boxes))


def plot_gate_sweep(labels: list[str], reports: list[dict], path: Path) -> Path:
    """Per-device memory of each job of a sweep, from its gate report: argument, temp and
    output-not-aliased stacked, so a bar's top is the gate's peak; against the cap. Jobs
    that do not fit are hatched and outlined red."""
    peaks = np.array([r["peak_bytes"] for r in reports], float)
    unit, scale = ("GiB", GiB) if peaks.max() >= GiB else ("MiB", MiB)
    # a cap more than 4x the tallest bar would flatten the bars: leave it off the axis
    top = peaks.max() / scale
    caps = np.array([r["cap_bytes"] for r in reports], float) / scale
    ytop = 1.15 * max([top, *caps[caps <= 4 * top]])
    x = np.arange(len(reports))
    width = min(16.0, max(6.0, 1.2 * len(reports) + 3))
    fig, ax = plt.subplots(figsize=(width, 4.5))
    segments = (("argument", [r["argument_bytes"] for r in reports]),
                ("temp", [r["temp_bytes"] for r in reports]),
                ("output (not aliased)", [r["output_bytes"] - r["alias_bytes"] for r in reports]))
    bottom = np.zeros(len(reports))
    for name, sizes in segments:
        h = np.array(sizes, float) / scale
        ax.bar(x, h, 0.6, bottom=bottom, label=name)
        bottom += h
    refused = np.array([not r["fits"] for r in reports])
    if refused.any():
        ax.bar(x[refused], peaks[refused] / scale, 0.6, fill=False, edgecolor="red", hatch="//",
               linewidth=1.5, label="does not fit")
    for xi, p in zip(x, peaks):
        ax.text(xi, p / scale, f"{p / scale:.3g}", ha="center", va="bottom", fontsize=8)
    notes = _draw_caps(ax, x, reports, scale, ytop)
    ax.set_ylim(0, ytop)
    ax.set_ylabel(f"per-device memory ({unit})")
    _job_ticks(ax, x, labels, notes)
    # the target names its device kind and count ("deviceless NVIDIA B200 x 64 (8 hosts)")
    targets = "\n".join(sorted({str(r["target"]) for r in reports}))
    ax.set_title(f"gate: peak memory per device\n{targets}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    if _overlapping(ax.get_xticklabels()):
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
        fig.tight_layout()
    _save(fig, path, dpi=120, bbox_inches="tight")
    return path


def plot_frequency_norm(sites: dict[str, tuple[np.ndarray, np.ndarray]], path: Path) -> Path:
    """One scatter per site: each component's firing frequency against its weight norm
    ‖V_c‖·‖U_c‖; dead components (frequency 0) drawn at the bottom edge in gray."""
    n = len(sites)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, (s, (freq, norm)) in zip(axes.flat, sites.items()):
        live = freq > 0
        floor = 0.5 * freq[live].min() if live.any() else 1e-6
        ax.scatter(norm[live], freq[live], s=10, color="tab:blue", label="fires")
        ax.scatter(norm[~live], np.full((~live).sum(), floor), s=10, color="lightgray",
                   marker="v", label="dead")
        ax.set_yscale("log")
        ax.set_title(f"{s}: {int((~live).sum())} dead of {len(freq)}", fontsize=9)
        ax.set_xlabel("‖V_c‖·‖U_c‖", fontsize=8)
        ax.set_ylabel("firing frequency", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path, dpi=110)
    return path


def plot_feature_ci(ci: dict[str, np.ndarray], path: Path, threshold: float, value: float
                    ) -> Path:
    """Toys: one heat map per site of CI [feature, component] with a single feature on at
    `value`; components that fire for some feature first, ordered by that feature, the
    rest after them."""
    fig, axes = plt.subplots(len(ci), 1, figsize=(9, 0.9 + 0.16 * max(
        m.shape[0] for m in ci.values()) * len(ci) + 0.6 * len(ci)), squeeze=False)
    for ax, (s, m) in zip(axes[:, 0], ci.items()):
        fires = (m > threshold).any(0)
        order = np.lexsort((np.arange(m.shape[1]), m.argmax(0), ~fires))
        im = ax.imshow(m[:, order], aspect="auto", vmin=0, vmax=1, cmap="Blues",
                       interpolation="nearest")
        ax.set_title(f"{s}: CI with feature f alone at {value} ({int(fires.sum())} of "
                     f"{m.shape[1]} components fire)", fontsize=9)
        ax.set_ylabel("feature")
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xticks(range(m.shape[1]), [str(c) for c in order],
                      fontsize=max(3, min(7, 400 // m.shape[1])), rotation=90)
        fig.colorbar(im, ax=ax, fraction=0.03)
    axes[-1, 0].set_xlabel("component")
    fig.tight_layout()
    _save(fig, path, dpi=110)
    return path


def _save(fig: plt.Figure, path: Path, **savefig_kw) -> None:
    """Saved whole or not at all (a full disk leaves no half-written image); closed either
    way. The format is the path's, which the temporary file's name does not end in."""
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip("."),
                                                   **savefig_kw))
    finally:
        plt.close(fig)
