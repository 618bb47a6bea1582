"""The LM step's matmul FLOPs counted by hand, term by term, to check the gate's count (the
dot_generals of the traced step, `pdecomp.gate.compiled.matmul_flops`).

The job: a Llama whose decomposed sites are MLP matrices of one layer `site_layer`, one
microbatch, faithfulness + importance minimality + one stochastic reconstruction of all the
sites in one forward (KL to the clean model), no PGD, no rematerialization. A matmul
[m, k] x [k, n] is 2mkn FLOPs. What XLA is asked to compute, in order:

1. prefix: the frozen layers before the site layer, once (outside every gradient);
2. clean suffix: the site layer to the last, and the head (the recon target);
3. CI function on each site's clean input, forward and backward (its weights' gradients);
4. masked forward from the site layer: each site's x@V, (mask * inner)@U, and the frozen
   x@W, once, for the delta component (x@(W - VU) = x@W - inner@U, folded into the mask
   on the inner acts) and where routing leaves a position unrouted;
5. its backward: the head and every layer after the sites take only input gradients
   (frozen); each site its U, inner-activation and V gradients (x@W is frozen: no weight
   gradient), and input gradients where its input depends on a trained parameter
   (down_proj after gate/up; nothing before the first site does);
6. faithfulness: the deltas W - V@U and their gradient back through V@U.

Run: .venv/bin/python bench/lm_flops.py [overrides...]: the analytic count per term beside
the gate's traced count for the three CI functions (tracing only: nothing compiles).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    d: int  # residual width
    d_mlp: int
    n_heads: int
    n_kv: int
    d_head: int
    vocab: int
    n_layers: int
    site_layer: int
    sites: tuple[str, ...]  # of gate_proj, up_proj, down_proj
    C: int
    batch: int
    seq: int
    ci_fn: str  # mlp | shared_mlp | vector_mlp
    ci_hidden: tuple[int, ...]
    routing: str = "uniform_k"
    delta: bool = True


def _layer(j: Job, n: int) -> dict[str, int]:
    """Matmul FLOPs of one frozen layer's forward on n tokens, by part."""
    q_out, kv_out = j.n_heads * j.d_head, j.n_kv * j.d_head
    attn_proj = 2 * n * j.d * (2 * q_out + 2 * kv_out)  # q, k, v, o
    # scores and their average over the values, every (query, key) pair (masked, not skipped)
    attn = 2 * 2 * j.batch * j.n_heads * j.seq * j.seq * j.d_head
    mlp = 2 * n * 3 * j.d * j.d_mlp
    return {"attn_proj": attn_proj, "attn": attn, "mlp": mlp}


def _site_dims(j: Job, site: str) -> tuple[int, int]:
    return (j.d_mlp, j.d) if site == "down_proj" else (j.d, j.d_mlp)


def _ci(j: Job, n: int) -> int:
    """The CI function on every site, forward and its weights' gradients."""
    total = 0
    for s in j.sites:
        d_in, _ = _site_dims(j, s)
        if j.ci_fn == "shared_mlp":  # d_in -> hidden... -> C, per site
            dims = (d_in, *j.ci_hidden, j.C)
            fwd = sum(2 * n * a * b for a, b in itertools.pairwise(dims))
            # backward: every weight's gradient, and the input gradient of all but the first
            total += 2 * fwd + sum(2 * n * a * b for a, b in itertools.pairwise(dims[1:]))
        elif j.ci_fn == "mlp":  # x @ V, then C scalar MLPs (elementwise: no matmul)
            total += 2 * (2 * n * d_in * j.C)  # forward, and V's gradient
        elif j.ci_fn == "vector_mlp":  # the site input to each component's first layer
            first = 2 * n * d_in * j.C * j.ci_hidden[0]
            total += 2 * first  # forward, and the first layer's weight gradient
        else:
            raise ValueError(j.ci_fn)
    return total


def count(j: Job) -> dict[str, int]:
    """Matmul FLOPs of one step, by term (see the module docstring)."""
    n = j.batch * j.seq
    layer = _layer(j, n)
    per_layer = sum(layer.values())
    after = j.n_layers - j.site_layer - 1  # frozen layers after the site layer
    head = 2 * n * j.d * j.vocab
    # the site layer's own frozen parts: its attention, its MLP matrices not decomposed
    frozen_mlp = 2 * n * j.d * j.d_mlp * (3 - len(j.sites))
    site_fwd = site_bwd = 0
    downstream = "down_proj" in j.sites and len(j.sites) > 1  # reads gate/up's outputs
    for s in j.sites:
        d_in, d_out = _site_dims(j, s)
        x_v, inner_u = 2 * n * d_in * j.C, 2 * n * j.C * d_out
        full = 2 * n * d_in * d_out  # one [n, d_in] x [d_in, d_out]
        # the frozen x@W: the delta channel's, and where a position is not routed (one
        # site: always is)
        extra = full * (j.delta or (j.routing == "uniform_k" and len(j.sites) > 1))
        site_fwd += x_v + inner_u + extra
        # U's gradient, the inner activations' (for V's) and V's
        site_bwd += 2 * inner_u + x_v
        if s == "down_proj" and downstream:  # its input depends on trained parameters
            site_bwd += x_v + extra  # input gradients through V and W
    masked_fwd = (layer["attn_proj"] + layer["attn"] + frozen_mlp + site_fwd
                  + after * per_layer + head)
    # the head and the later layers pass input gradients only (attention's two matmuls
    # take two each); its attention, before every site, none
    later_bwd = per_layer + layer["attn"]
    # a frozen down_proj after a gate/up site passes input gradients; frozen gate/up before
    # a down_proj site, none
    frozen_after = 2 * n * j.d * j.d_mlp * ("down_proj" not in j.sites)
    masked_bwd = head + after * later_bwd + site_bwd + frozen_after
    faith = sum(3 * 2 * _site_dims(j, s)[0] * j.C * _site_dims(j, s)[1] for s in j.sites)
    return {"prefix": j.site_layer * per_layer,
            "clean suffix": per_layer * (after + 1) + head,
            "CI function": _ci(j, n),
            "masked forward": masked_fwd,
            "masked backward": masked_bwd,
            "faithfulness": faith}


def job_of(cfg) -> Job:
    """The Job of a composed RunConfig (a Llama with its sites in one layer's MLP)."""
    m, lay, rec = cfg.model, cfg.layers, next(iter(cfg.loss.recon.values()))
    layers = {int(s.split(".")[1]) for s in lay.sites}
    assert len(layers) == 1 and all(".mlp." in s for s in lay.sites), lay.sites
    return Job(d=m.d_embed, d_mlp=m.d_mlp, n_heads=m.n_heads, n_kv=m.n_kv_heads,
               d_head=m.head_dim or m.d_embed // m.n_heads, vocab=m.vocab_size,
               n_layers=m.n_layers, site_layer=layers.pop(),
               sites=tuple(s.rsplit(".", 1)[1] for s in lay.sites), C=lay.C,
               batch=cfg.data.batch_size, seq=cfg.data.seq_len, ci_fn=lay.ci_fn,
               ci_hidden=tuple(lay.ci_hidden), routing=rec.routing, delta=lay.delta)


def traced_count(cfg) -> int:
    """The gate's figure: the dot_generals of the traced step (nothing compiled)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pdecomp.core import sharding
    from pdecomp.gate import compiled as gate
    from pdecomp.gate.shapes import abstract_run
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import make_train_step

    run = resolve(cfg, len(jax.devices()))
    target, state = abstract_run(run, jax.random.PRNGKey(run.config.seed))
    mesh = sharding.make_mesh(run.placement)
    batch = run.kind.batch_abstract(run.config.model, run.config.data, run.batch.size,
                                    NamedSharding(mesh, P(sharding.AXIS)))
    return gate.matmul_flops(jax.jit(make_train_step(run.step)).trace(state, target,
                                                                      batch).jaxpr)


def main(overrides: list[str]) -> None:
    from bench_lm_cpu import CI_FNS, JOB

    from launcher import api

    print("| term | " + " | ".join(CI_FNS) + " |")
    print("|---|" + "---|" * len(CI_FNS))
    counts, traced = {}, {}
    for ci_fn, hidden in CI_FNS.items():
        cfg = api.compose([*JOB, "data.source=synthetic", f"layers.ci_fn={ci_fn}",
                           f"layers.ci_hidden={hidden}", *overrides], preset="smollm2_l28")
        counts[ci_fn], traced[ci_fn] = count(job_of(cfg)), traced_count(cfg)
    for term in next(iter(counts.values())):
        print(f"| {term} | " + " | ".join(f"{c[term] / 1e9:.2f}" for c in counts.values())
              + " |")
    print("| **analytic total** | " + " | ".join(
        f"{sum(c.values()) / 1e9:.2f}" for c in counts.values()) + " |")
    print("| **gate (traced step)** | " + " | ".join(
        f"{t / 1e9:.2f}" for t in traced.values()) + " |")
    print("| analytic / gate | " + " | ".join(
        f"{sum(counts[k].values()) / traced[k]:.4f}" for k in CI_FNS) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
