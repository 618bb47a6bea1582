"""An analysis written: the static HTML page (sortable tables, plots inline, the PNGs beside
it) and every site's component table as Parquet, into `<run_dir>/analysis/` whole or not at
all (`write_report`). What is written is gathered by `pdecomp.analysis.analyze`."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import numpy as np

from pdecomp.analysis import harvest
from pdecomp.analysis import tables as component_tables
from pdecomp.analysis.analyze import (
    ONE_HOT_VALUE,
    OUT_DIR,
    TOKENS_SHOWN,
    Analysis,
    Context,
    SiteStats,
)
from pdecomp.core import storage
from pdecomp.plan.files import write_json
from pdecomp.spd import plots

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #eee;
text-align:right;vertical-align:top}th{background:#f4f4f4;position:sticky;top:0}
th.sortable{cursor:pointer}th.sortable:after{content:" \\2195";color:#999}
td.l,th.l{text-align:left}tr.dead{color:#aaa}
.ctx{font-family:ui-monospace,monospace;font-size:12px;white-space:pre-wrap;text-align:left}
.ctx span{padding:0 1px;border-radius:2px}.ctx b{outline:1px solid #c00}
img{max-width:100%}code{background:#f4f4f4;padding:0 3px}
"""

# Click a header to sort its table by that column (again to reverse); cells sort by their
# data-v value when they have one. `index.html#sort=<table id>:<column>[:desc]` sorts on load.
_SCRIPT = """
function sortTable(table, col, desc) {
  const body = table.tBodies[0];
  const key = r => { const c = r.cells[col]; const v = c.dataset.v;
    return v !== undefined ? parseFloat(v) : c.textContent; };
  const rows = Array.from(body.rows);
  rows.sort((a, b) => { const x = key(a), y = key(b);
    const o = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
    return desc ? -o : o; });
  rows.forEach(r => body.appendChild(r));
  table.dataset.sorted = col + (desc ? ":desc" : ":asc");
}
document.querySelectorAll("table.sortable").forEach(t => {
  t.querySelectorAll("th").forEach((th, i) => {
    th.classList.add("sortable");
    th.addEventListener("click", () => sortTable(t, i, t.dataset.sorted === i + ":asc"));
  });
});
const m = location.hash.match(/^#sort=([^:]+):(\\d+)(:desc)?$/);
if (m && document.getElementById(m[1])) sortTable(document.getElementById(m[1]), +m[2], !!m[3]);
"""


def _num(v: float, fmt: str = ".4g") -> str:
    return f'<td data-v="{v!r}">{v:{fmt}}</td>'


def _ctx_html(ctx: Context) -> str:
    parts = []
    for i, (tok, ci) in enumerate(zip(ctx.tokens, ctx.cis)):
        alpha = min(max(ci, 0.0), 1.0)
        # shading only where it shows: a report with thousands of contexts stays small
        style = f' style="background:rgba(255,140,0,{alpha:.2f})"' if alpha >= 0.01 else ""
        span = f'<span{style} title="CI {ci:.3f}">{html.escape(tok)}</span>'
        parts.append(f"<b>{span}</b>" if i == ctx.at else span)
    return (f'<div title="window {ctx.window}, position {ctx.position}">{ctx.ci:.3f}: '
            + ctx.sep.join(parts) + "</div>")


def _site_id(site: str) -> str:
    return "site-" + "".join(ch if ch.isalnum() else "-" for ch in site)


def _png_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def render(a: Analysis, out: Path) -> Path:
    """Write the report into `out` (the plots as PNGs, then index.html with them inline)."""
    run, cfg, thr = a.run, a.run.config, a.run.config.loss.ci_threshold
    pngs = [plots.plot_mean_ci({s: {"mean_ci": v.mean_ci, "max_ci": v.max_ci,
                                    "live": int((v.freq > 0).sum())}
                                for s, v in a.stats.items()}, out / "mean_ci.png", thr),
            plots.plot_frequency_norm({s: (v.freq, v.norm) for s, v in a.stats.items()},
                                      out / "frequency_norm.png")]
    if a.feature_ci is not None:
        pngs.append(plots.plot_feature_ci(a.feature_ci, out / "feature_ci.png", thr,
                                          ONE_HOT_VALUE))
    h = [(f"<!doctype html><html><head><meta charset='utf-8'>"
          f"<title>pdecomp analysis: {html.escape(run.run_dir.name)}</title>"
          f"<style>{_STYLE}</style></head><body>"),
         f"<h1>pdecomp analysis of <code>{html.escape(str(run.run_dir))}</code></h1>",
         (f"<p>Model <code>{html.escape(cfg.model.name)}</code> ({cfg.model.kind}), "
          f"checkpoint step {run.step} of {cfg.optim.steps}, {len(a.stats)} sites. Data: "
          f"{html.escape(a.data)}. A component fires at a position when its CI exceeds "
          f"<code>loss.ci_threshold</code> = {thr}; dead: never fires on this data. Weight "
          f"norm: ‖V<sub>c</sub>‖·‖U<sub>c</sub>‖. Click a column header to sort.</p>"),
         ("<h2>Sites</h2><table class='sortable' id='sites'><thead><tr><th class='l'>site</th>"
          "<th>C</th><th>firing</th><th>dead</th><th>mean L0</th><th>positions</th>"
          "</tr></thead><tbody>")]
    for s, v in a.stats.items():
        C = len(v.freq)
        h.append(f"<tr><td class='l'><a href='#{_site_id(s)}'>{html.escape(s)}</a></td>"
                 f"{_num(C, 'd')}{_num(C - v.dead, 'd')}{_num(v.dead, 'd')}"
                 f"{_num(float(v.freq.sum()), '.3f')}{_num(v.positions, 'd')}</tr>")
    h.append("</tbody></table><h2>Plots</h2>")
    h += [_png_tag(p, p.stem) for p in pngs]
    for s, v in a.stats.items():
        h += _site_rows(a, s, v)
    h.append(f"<script>{_SCRIPT}</script></body></html>")
    index = out / "index.html"
    index.write_text("\n".join(h), encoding="utf-8")
    return index


STATIC_ROWS = 4096  # components a site's static table lists at most; pdecomp view pages all


def _site_rows(a: Analysis, s: str, v: SiteStats) -> list[str]:
    """A site's heading and component table (its STATIC_ROWS most frequent when larger)."""
    sid, C = _site_id(s), len(v.freq)
    shown = np.arange(C) if C <= STATIC_ROWS else np.sort(
        np.argsort(-v.freq, kind="stable")[:STATIC_ROWS])
    more = (f" Listed: the {STATIC_ROWS} most frequent; every component is in "
            f"components/{html.escape(component_tables.file_name(s))} and pages in "
            "<code>pdecomp view</code>." if C > STATIC_ROWS else "")
    h = [f"<h2 id='{sid}'>{html.escape(s)}</h2>"
         f"<p>{C - v.dead} firing, {v.dead} dead of {C}.{more}</p>"
         f"<table class='sortable components' id='{sid}-components'><thead><tr>"
         "<th>component</th><th>frequency</th><th>mean CI</th><th>max CI</th>"
         "<th>norm</th>" + ("<th class='l'>top contexts</th>" if a.contexts else "")
         + "</tr></thead><tbody>"]
    for c in shown:
        dead = " class='dead'" if v.freq[c] == 0 else ""
        row = (f"<tr{dead}>{_num(int(c), 'd')}{_num(float(v.freq[c]))}"
               f"{_num(float(v.mean_ci[c]))}{_num(float(v.max_ci[c]))}"
               f"{_num(float(v.norm[c]))}")
        if a.contexts:  # a dead component's top CIs are all below the threshold
            row += ("<td class='ctx'>" + ("".join(_ctx_html(x) for x in a.contexts[s][c])
                                          if v.freq[c] else "never fires") + "</td>")
        h.append(row + "</tr>")
    return [*h, "</tbody></table>"]


def context_text(ctx: Context) -> str:
    """A context as one line of text, the firing token in [[ ]]."""
    before, at, after = ctx.tokens[:ctx.at], ctx.tokens[ctx.at], ctx.tokens[ctx.at + 1:]
    return ctx.sep.join([*before, f"[[{at}]]", *after])


def write_tables(a: Analysis, out: Path) -> list[Path]:
    """Every site's components as `out/components/<site>.parquet` (pdecomp.analysis.tables)."""
    tables = {s: component_tables.site_table(st.freq, st.mean_ci, st.max_ci, st.norm,
                                             st.positions, st.hist, extra_columns(a, s))
              for s, st in a.stats.items()}
    return component_tables.write(tables, out / "components", harvest.HIST_EDGES)


def extra_columns(a: Analysis, site: str) -> dict[str, Any]:
    """A site's list columns: top and drawn contexts (text, the firing token in [[ ]], CI,
    signed activation), input and next tokens (by count and by PMI), co-firing partners."""
    import pyarrow as pa

    cols: dict[str, Any] = {}
    if a.stats[site].ablation is not None:
        cols["ablation_dce"] = pa.array(a.stats[site].ablation, from_pandas=True)  # NaN: null
    for name, ctx in (("top", a.contexts), ("sample", a.samples)):
        if ctx and site in ctx:
            cols[f"{name}_contexts"] = pa.array(
                [[{"text": context_text(c), "ci": c.ci, "act": c.act} for c in row]
                 for row in ctx[site]], pa.list_(component_tables.CONTEXT))
    if a.tokens and site in a.tokens and a.decoder:
        for kind in ("input", "next"):
            for by in ("count", "pmi"):
                rows = a.tokens[site].rows(kind, TOKENS_SHOWN, by)
                cols[f"{kind}_tokens" + ("_pmi" if by == "pmi" else "")] = pa.array(
                    [[{**r.__dict__, "token": a.decoder.decode(r.token), "id": r.token}
                      for r in row] for row in rows], pa.list_(component_tables.TOKEN))
    if a.effects and site in a.effects and a.decoder:
        e = a.effects[site]
        for name, ids, values in (("promoted", e.promoted_ids, e.promoted),
                                  ("suppressed", e.suppressed_ids, e.suppressed)):
            cols[f"{name}_tokens"] = pa.array(
                [[{"token": a.decoder.decode(int(t)), "id": int(t), "logit": float(v)}
                  for t, v in zip(row_ids, row)] for row_ids, row in zip(ids, values)],
                pa.list_(component_tables.EFFECT))
    if a.partners and site in a.partners:
        cols["cofire"] = pa.array([[p.__dict__ for p in row] for row in a.partners[site]],
                                  pa.list_(component_tables.PARTNER))
    return cols


def write_report(a: Analysis, run_dir: Path, gate: dict[str, Any] | None = None) -> Path:
    """Render (with the analysis gate's report, `gate.json`) into a temporary directory
    beside the final one, then swap it in: a failure leaves the previous report (or none)
    and no partial one."""

    def write(tmp: Path) -> None:
        render(a, tmp)
        write_tables(a, tmp)
        if gate is not None:
            write_json(tmp / "gate.json", gate)

    return storage.write_dir(run_dir / OUT_DIR, write) / "index.html"
