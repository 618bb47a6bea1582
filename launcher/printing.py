"""What a job prints on the console: the gate's table and its largest temporaries, and at
the end what the decomposition found (per site, and for a language model every mask's CE
and the fresh adversary's curve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from launcher.console import make_console
from pdecomp.core.config import RunConfig
from pdecomp.core.units import fmt_bytes
from pdecomp.gate.report import GateReport
from pdecomp.gate.report import rows as gate_rows

console = make_console(stderr=True)


def gate_table(report: GateReport, title: str = "memory gate (per device)") -> Table:
    table = Table(title=title, show_header=False)
    for label, value in gate_rows(report):
        table.add_row(label, value)
    return table


def temps_table(report: GateReport) -> Table | None:
    """What to cut: the largest temporaries, with the operation and source line behind each."""
    if not report.largest_temps:
        return None
    table = Table(title="largest temporaries (XLA buffer assignment)")
    for col in ("size", "shape", "operation", "source"):
        table.add_column(col, overflow="fold")
    for t in report.largest_temps:
        table.add_row(fmt_bytes(t["bytes"]), t["shape"], t["op"], t["source"])
    return table


# Per-site metrics the findings table shows where the summary has them: (column, summary
# key, format).
FINDINGS_COLUMNS = (("1-hot live", "live_one_hot", "d"), ("MMCS", "mmcs", ".3f"),
                    ("ML2R", "ml2r", ".3f"), ("one-to-one", "one_to_one", "d"))


def print_pgd_curve(cfg: RunConfig, summary: dict[str, Any]) -> None:
    """The fresh adversary's KL after each of its ascent counts (loss.eval_pgd.curve_to)
    beside the zero-ablation KL of the same sites, in nats: the field's robustness figure."""
    pgd = cfg.loss.eval_pgd
    if not any(f"kl/pgd_{m}" in summary for m in pgd.marks):
        return
    curve = ", ".join(f"{m}: {summary[f'kl/pgd_{m}']:.4g}" for m in pgd.marks)
    console.print(f"fresh adversary ({pgd.scope} sources, sign steps of {pgd.step_size:g}), KL "
                  f"to the target after n ascents, nats: {curve}; every site ablated: "
                  f"{summary['kl/zero']:.4g}")


def print_findings(cfg: RunConfig, summary: dict[str, Any], run_dir: Path) -> None:
    """What the decomposition found, in a form a person reads at a glance."""
    from pdecomp.kinds import site_C
    from pdecomp.spd.metrics import EVAL_KINDS

    table = Table(title=f"{cfg.name}: what SPD found")
    sites = site_C(cfg.model, cfg.layers)
    # the kind's per-site metrics: those the summary has for some site
    extra = [(col, key, spec) for col, key, spec in FINDINGS_COLUMNS
             if any(f"{key}/{s}" in summary for s in sites)]
    # site names whole, never cut to "layers.0.mlp_…" on a narrow console
    table.add_column("site", no_wrap=True, min_width=max(map(len, sites)))
    thr = cfg.loss.ci_threshold  # the field counts L0 at CI > 0; ours also above the threshold
    for col in ("C", "live", f"L0 (CI > {thr:g})", "L0 (CI > 0)", *(c for c, _, _ in extra)):
        table.add_column(col)
    for site, C in sites.items():
        def fmt(key: str, spec: str = ".3f", site: str = site) -> str:
            v = summary.get(f"{key}/{site}")
            return "-" if v is None else format(v, spec)

        table.add_row(site, str(C), fmt("live", "d"), fmt("l0"), fmt("l0_any"),
                      *(fmt(key, spec) for _, key, spec in extra))
    console.print(table)
    if "ce/target" in summary:  # an LM: how much of the target's behaviour each mask keeps
        masks = Table(title=f"every site masked; target CE {summary['ce/target']:.4f}")
        for col in ("mask", "CE", "KL to target", "CE unrecovered"):
            masks.add_column(col)
        for kind in EVAL_KINDS:
            if f"ce/{kind}" not in summary:  # pgd: loss.eval_pgd.n_steps=0
                continue
            unrecovered = summary[f"ce_unrecovered/{kind}"]
            masks.add_row(kind, f"{summary[f'ce/{kind}']:.4f}", f"{summary[f'kl/{kind}']:.4f}",
                          "n/a (zero-ablation CE ≤ target's)" if unrecovered is None
                          else f"{unrecovered:.3f}")
        console.print(masks)
        print_pgd_curve(cfg, summary)
    for key in ("plots/tms_directions", "plots/mean_ci"):
        if key in summary:
            console.print(f"plot: {summary[key]}")
    console.print(f"run dir: {run_dir}")
