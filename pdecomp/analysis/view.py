"""`pdecomp view <run_dir>`: a small local web viewer of an analysed run's components.

It serves one page and two JSON endpoints over the Parquet tables `pdecomp analyze`
wrote (`<run_dir>/analysis/components/<site>.parquet`): the sites, and one page of a
site's components, sorted by a column and filtered by a search (a component's number, or
a token it fires on or that follows it). Only the site asked for is read, and only one
page of it goes to the browser: a site of 49,152 components pages like one of 64.
The page keeps its state in the address (`#site=...&page=...&sort=...&q=...`), so a view
can be bookmarked, shared, or opened by a test.

A third endpoint reads a text the user types (`#prompt=...`): which components fire at
each of its tokens (`pdecomp prompt`'s answer). The run's components, CI function and
target are read for it once, at the first text, not before: a viewer that only pages the
tables never holds the model.
"""

from __future__ import annotations

import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pdecomp.analysis.labels import FILE as LABELS
from pdecomp.analysis.labels import read_labels

SORTABLE = ("component", "frequency", "fired", "mean_ci", "max_ci", "norm",
            "ablation_dce")
TOKEN_COLUMNS = ("input_tokens", "input_tokens_pmi", "next_tokens", "next_tokens_pmi",
                 "promoted_tokens", "suppressed_tokens")
PER_PAGE = 50
PAGE_HTML = Path(__file__).with_name("view.html")


class Tables:
    """The analysis's Parquet tables, one site at a time (the last few kept)."""

    def __init__(self, components_dir: Path):
        self.dir = components_dir
        self.files = {pq.read_schema(p).metadata[b"site"].decode(): p
                      for p in sorted(components_dir.glob("*.parquet"))}
        self._read = functools.lru_cache(maxsize=4)(self._read_site)
        self._seen: tuple[int | None, dict[tuple[str, int], str]] = (None, {})

    def _read_site(self, site: str) -> pa.Table:
        return pq.read_table(self.files[site])

    def _labels(self, path: Path) -> dict[tuple[str, int], str]:
        """The labels file, read again only when it has changed (`pdecomp label` may be
        adding to it)."""
        stamp = path.stat().st_mtime_ns if path.is_file() else None
        if stamp is None or stamp != self._seen[0]:
            self._seen = (stamp, read_labels(path.parent))
        return self._seen[1]

    def table(self, site: str) -> pa.Table:
        """The site's table, with the labels `pdecomp label` has written so far."""
        t = self._read(site)
        labels = self._labels(self.dir.parent.parent / LABELS)
        return t.append_column("label", pa.array(
            [labels.get((site, c)) for c in t["component"].to_pylist()], pa.string()))

    def sites(self) -> list[dict[str, Any]]:
        """Per site: C, how many fire, how many positions were read (two columns only)."""
        out = []
        for site, path in self.files.items():
            t = pq.read_table(path, columns=["dead", "positions"])
            dead = pc.sum(t["dead"]).as_py() or 0
            out.append({"site": site, "C": t.num_rows, "firing": t.num_rows - dead,
                        "dead": dead, "positions": t["positions"][0].as_py()})
        return out

    def page(self, site: str, page: int, per: int, sort: str, desc: bool, q: str
             ) -> dict[str, Any]:
        """One page of a site's components, sorted and filtered."""
        t = self.table(site)
        if sort not in t.column_names:
            raise ValueError(f"sort={sort!r}: {site} has no such column")
        if q:
            t = t.filter(matches(t, q))
        t = t.sort_by([(sort, "descending" if desc else "ascending"),
                       ("component", "ascending")])
        rows = t.slice(page * per, per).to_pylist()
        edges = pq.read_schema(self.files[site]).metadata.get(b"ci_hist_edges", b"").decode()
        return {"site": site, "total": t.num_rows, "page": page, "per": per,
                "pages": max(-(-t.num_rows // per), 1), "rows": rows,
                "hist_edges": [float(e) for e in edges.split(",") if e]}


def matches(t: pa.Table, q: str) -> pa.Array:
    """Rows of component `#q`; else rows whose label, or a token among those it fires on,
    that follow it or that it promotes or suppresses, contains `q` (case and surrounding
    spaces ignored), and, where `q` is a number, component `q` (a run without a tokenizer
    shows its tokens as numbers too)."""
    q = q.strip()
    if q.startswith("#") and q[1:].isdigit():
        return pc.equal(t["component"], int(q[1:]))
    want = q.lower()
    columns = [c for c in TOKEN_COLUMNS if c in t.column_names]
    hits = pa.array([any(want in (tok["token"] or "").strip().lower()
                         for col in columns for tok in row[col] or ())
                     for row in t.select(columns).to_pylist()], pa.bool_())
    if "label" in t.column_names:
        labelled = pc.match_substring(pc.utf8_lower(t["label"]), want)
        hits = pc.or_(hits, pc.fill_null(labelled, False))
    if q.isdigit():
        hits = pc.or_(hits, pc.equal(t["component"], int(q)))
    return hits


class Prompter:
    """The run, read at the first text (one at a time: the model is read once)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self._loaded, self._lock = run_dir, None, threading.Lock()

    def read(self, args: dict[str, str]) -> dict[str, Any]:
        """The /api/prompt query: `text` (the model's tokenizer) or `ids` (comma-separated);
        per token, the components firing there. ValueError with the line that refuses it."""
        from pdecomp.analysis import prompt
        from pdecomp.analysis.analyze import reads_tokens
        from pdecomp.run.load import RunDirError, load_run

        with self._lock:
            if self._loaded is None:
                try:
                    self._loaded = load_run(self.run_dir, log=lambda _: None,
                                            whole_state=False)
                except RunDirError as e:
                    raise ValueError(str(e)) from None
            if not reads_tokens(self._loaded.run):
                raise ValueError(f"a {self._loaded.run.config.model.kind} run reads no tokens")
            ids = prompt.token_ids(self._loaded, args.get("text"), args.get("ids"))
            if isinstance(ids, str):
                raise ValueError(ids)  # noqa: TRY004 - the refusal's one line, sent as a 400
            return {"threshold": self._loaded.run.config.loss.ci_threshold,
                    "tokens": prompt.per_token(self._loaded, ids)}


def handler(tables: Tables, run_name: str, prompter: Prompter
            ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            args = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if url.path == "/":
                    body = PAGE_HTML.read_text(encoding="utf-8").replace(
                        "__RUN__", json.dumps(run_name))
                    return self.send(200, body.encode(), "text/html; charset=utf-8")
                if url.path == "/api/sites":
                    return self.json(tables.sites())
                if url.path == "/api/components":
                    return self.json(components(tables, args))
                if url.path == "/api/prompt":
                    return self.json(prompter.read(args))
            except (KeyError, ValueError) as e:
                return self.send(400, json.dumps({"error": str(e)}).encode(),
                                 "application/json")
            self.send(404, b"not found", "text/plain")

        def json(self, data: Any) -> None:
            self.send(200, json.dumps(data, default=float).encode(), "application/json")

        def send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # quiet: the terminal shows the address
            pass

    return Handler


def components(tables: Tables, args: dict[str, str]) -> dict[str, Any]:
    """The /api/components query: site, page, per, sort, order (asc, desc), q."""
    site = args["site"]
    if site not in tables.files:
        raise KeyError(f"no site {site!r}")
    sort = args.get("sort", "component")
    if sort not in SORTABLE:
        raise ValueError(f"sort={sort!r}: one of {', '.join(SORTABLE)}")
    per = min(max(int(args.get("per", PER_PAGE)), 1), 1000)
    return tables.page(site, max(int(args.get("page", 0)), 0), per, sort,
                       args.get("order", "asc") == "desc", args.get("q", ""))


def serve(run_dir: Path, host: str, port: int) -> ThreadingHTTPServer:
    tables = Tables(run_dir / "analysis" / "components")
    return ThreadingHTTPServer((host, port), handler(tables, run_dir.name, Prompter(run_dir)))
