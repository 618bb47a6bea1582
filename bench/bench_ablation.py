"""How far the analysis's first-order ablation effect is from the exact one: on a language
model's run, for the components of each site that fire most often, the CE change of
ablating each where it fires (one forward per component) beside the first-order estimate
the analysis reports (one backward for all, `harvest.ablation_gradients`), on the same
windows. Pearson and Spearman correlation, the least-squares slope and the share of signs
that agree go into bench/results.json under "analysis"/"ablation_exact".

    .venv/bin/python bench/bench_ablation.py RUN_DIR [COMPONENTS_PER_SITE] [WINDOWS]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdecomp.analysis import analyze, harvest
from pdecomp.run.load import load_run
from pdecomp.spd import metrics
from pdecomp.spd.ci import ci_lower

RESULTS = Path(__file__).resolve().parent / "results.json"


def exact_effects(f: metrics.SiteForward, components, x, site: str, fired, chosen):
    """Per chosen component of `site`: the summed CE with it ablated where it fires, less
    the CE of the unablated forward (the target's own output: every mask 1, delta on)."""
    ones = {s: jnp.ones(g.shape) for s, g in f.logits.items()}

    def ablated(drop):  # drop: [positions, C] of 0/1, 1 where ablated
        mask = 1.0 - drop.reshape(ones[site].shape)
        return harvest.masked_ce(f, components, x, {**ones, site: mask})

    base = harvest.masked_ce(f, components, x, ones)
    one_hot = jax.nn.one_hot(chosen, fired.shape[1])
    return jax.lax.map(lambda h: ablated(fired * h) - base, one_hot)


def site_figures(first: np.ndarray, exact: np.ndarray) -> dict:
    rank = lambda v: np.argsort(np.argsort(v))
    slope = float(first @ exact / max(exact @ exact, 1e-30))
    return {"components": len(exact), "pearson": float(np.corrcoef(first, exact)[0, 1]),
            "spearman": float(np.corrcoef(rank(first), rank(exact))[0, 1]),
            "slope_first_on_exact": slope,
            "sign_agreement": float(np.mean(np.sign(first) == np.sign(exact))),
            "median_abs_exact": float(np.median(np.abs(exact)))}


def main(run_dir: Path, per_site: int = 48, windows: int = 64) -> None:
    run = load_run(run_dir, whole_state=False)
    threshold = run.run.config.loss.ci_threshold
    sums = {s: {"first": 0.0, "exact": 0.0} for s in run.components.sites}
    chosen, t0 = {}, time.perf_counter()

    @jax.jit
    def batch_effects(target, components, ci_fn, x, picks):
        f = metrics.site_forward(target, components, ci_fn, x)
        grads = harvest.ablation_gradients(f, components, x)
        out = {}
        for s, logit in f.logits.items():
            fired = (ci_lower(logit).reshape(-1, logit.shape[-1]) > threshold)
            first = -jnp.where(fired, grads[s], 0.0).sum(0)[picks[s]]
            out[s] = (first, exact_effects(f, components, x, s, fired.astype(jnp.float32),
                                           picks[s]))
        return out

    for i, x in enumerate(analyze._lm_windows(run, windows, 32, "held_out")):
        if i == 0:  # the components that fire most often in the first batch
            f = metrics.site_forward(run.target, run.components, run.ci_fn, jnp.asarray(x))
            chosen = {s: jnp.argsort(-(ci_lower(v) > threshold).reshape(-1, v.shape[-1])
                                     .sum(0))[:per_site] for s, v in f.logits.items()}
        effects = batch_effects(run.target, run.components, run.ci_fn, jnp.asarray(x), chosen)
        for s, (first, exact) in effects.items():
            sums[s]["first"] += np.asarray(first, np.float64)
            sums[s]["exact"] += np.asarray(exact, np.float64)
        print(f"batch {i + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
    sites = {s: site_figures(v["first"], v["exact"]) for s, v in sums.items()}
    print(json.dumps(sites, indent=1))
    data = json.loads(RESULTS.read_text())
    data["analysis"]["ablation_exact"] = {
        "command": f"bench/bench_ablation.py {run_dir.name} {per_site} {windows}",
        "windows": windows, "seq_len": run.config.data.seq_len, "sites": sites,
        "wall_s": round(time.perf_counter() - t0, 1)}
    RESULTS.write_text(json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), *map(int, sys.argv[2:4]))
