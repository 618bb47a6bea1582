"""`pdecomp label <run_dir>`: a short label per component, written by a language model
through an OpenAI-compatible chat API, from what `pdecomp analyze` gathered.

Each firing component's row of the analysis (its strongest and typical contexts, the tokens
it fires on and that follow, the tokens it promotes and suppresses, its frequency) becomes
one prompt; the answer's first line is its label. Labels are appended to
`<run_dir>/labels.jsonl` as they come (one object per line: site, component, label, model),
beside `analysis/`, so a stopped command loses nothing and the same command goes on with
the components not labelled yet; a new analysis keeps them. `pdecomp view` shows them and
searches them.

The key is read from the environment (`--api-key-env`, default OPENAI_API_KEY), never from
the command line; `--api-base` points at any OpenAI-compatible server (OpenRouter, vLLM,
a local one). A rate limit or a server error is retried with backoff; a refused key ends
the command at once with what was labelled so far kept.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

PROG = "pdecomp label"
FILE = "labels.jsonl"
RETRIES = 6  # attempts per component on a rate limit, a server error or a dropped line
LABEL_CHARS = 120


class KeyRefused(Exception):
    """The API refused the key or the request itself (4xx other than a rate limit), or
    answered with something other than a chat completion."""


def read_labels(run_dir: Path) -> dict[tuple[str, int], str]:
    """(site, component) -> label, from `labels.jsonl` (a line cut short by a stop is
    skipped; the latest label of a component wins)."""
    out: dict[tuple[str, int], str] = {}
    path = run_dir / FILE
    if not path.is_file():
        return out
    for line in path.read_bytes().splitlines():
        try:  # bytes: a line cut mid-character is skipped like any other cut line
            r = json.loads(line.decode("utf-8"))
            out[(str(r["site"]), int(r["component"]))] = str(r["label"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _without_cut_line(path: Path) -> None:
    """Drop a last line cut short by a stop (no newline after it), so the labels appended
    next start on a line of their own."""
    if not path.is_file() or not (data := path.read_bytes()) or data.endswith(b"\n"):
        return
    with path.open("r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


def _tokens(items: Sequence[dict[str, Any]] | None) -> str:
    return ", ".join(json.dumps(t["token"], ensure_ascii=False) for t in items or ()) or "-"


def prompt_for(site: str, row: dict[str, Any]) -> str:
    """The question about one component, from its row of the analysis."""
    lines = [
        ("A weight matrix of a language model was decomposed into rank-one components; one "
        f"component of {site} is shown by the text where it is active."),
        f"It is active at {row['frequency']:.3%} of tokens.",
        "Where it is most active (the token it is active on in [[ ]]):",
        *(f"- {c['text']}" for c in row.get("top_contexts") or ()),
        "Typical places where it is active:",
        *(f"- {c['text']}" for c in row.get("sample_contexts") or ()),
        f"Tokens it is active on, most often: {_tokens(row.get('input_tokens'))}",
        f"Tokens that follow where it is active: {_tokens(row.get('next_tokens'))}",
    ]
    if row.get("promoted_tokens"):
        lines += [f"Next tokens it makes more likely: {_tokens(row['promoted_tokens'])}",
                  f"Next tokens it makes less likely: {_tokens(row['suppressed_tokens'])}"]
    lines.append("In at most eight words, what does this component respond to or do? Reply "
                 "with the label alone.")
    return "\n".join(lines)


def ask(base: str, key: str, model: str, prompt: str, timeout: float = 60) -> str:
    """One chat completion's first line; retried with backoff on a rate limit, a server
    error or a dropped connection; KeyRefused on another refusal."""
    body = json.dumps({"model": model, "max_tokens": 40, "temperature": 0,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    request = urllib.request.Request(
        f"{base.rstrip('/')}/chat/completions", body, method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    for attempt in range(RETRIES):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                text = _content(base, r.read())
            return (text.strip().splitlines() or [""])[0].strip()[:LABEL_CHARS]
        except urllib.error.HTTPError as e:
            if e.code != 429 and e.code < 500:
                raise KeyRefused(f"{base}: HTTP {e.code} {e.reason}") from None
            wait = float(e.headers.get("Retry-After") or 2 ** attempt)
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            wait = 2 ** attempt
        if attempt + 1 < RETRIES:
            time.sleep(min(wait, 60))
    raise ConnectionError(f"{base}: no answer after {RETRIES} attempts")


def _content(base: str, body: bytes) -> str:
    """The first choice's message of a chat completion; KeyRefused, saying what came
    instead, when `body` is not one (an HTML page, an error object, another API's JSON)."""
    try:
        text = json.loads(body)["choices"][0]["message"]["content"]
        if text is not None and not isinstance(text, str):
            raise TypeError(type(text).__name__)
        return text or ""
    except (ValueError, KeyError, IndexError, TypeError):
        shown = " ".join(body[:80].decode("utf-8", "replace").split())
        raise KeyRefused(f"{base}: not an OpenAI-compatible chat completion (the answer began "
                         f"{shown!r}); check --api-base") from None


def todo(run_dir: Path, limit: int | None, done: dict[tuple[str, int], str]
         ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(site, row) of each firing component without a label: per site the most frequent
    first, at most `limit` of them counted with those already labelled."""
    for path in sorted((run_dir / "analysis" / "components").glob("*.parquet")):
        site = pq.read_schema(path).metadata[b"site"].decode()
        rows = [r for r in pq.read_table(path).to_pylist() if not r["dead"]]
        rows.sort(key=lambda r: -r["frequency"])
        for r in rows[:limit]:
            if (site, r["component"]) not in done:
                yield site, r


def label_all(run_dir: Path, jobs: list[tuple[str, dict[str, Any]]],
              answer: Callable[[str], str], workers: int, model: str,
              progress: Callable[[int, int], None]) -> int:
    """Label `jobs` on `workers` threads, each label appended as it comes; how many."""
    n = 0
    if not jobs:
        return n
    _without_cut_line(run_dir / FILE)
    with ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(answer, prompt_for(s, r)): (s, r["component"]) for s, r in jobs}
        try:
            for f in as_completed(futures):
                site, c = futures[f]
                line = json.dumps({"site": site, "component": c, "label": f.result(),
                                   "model": model}, ensure_ascii=False) + "\n"
                with (run_dir / FILE).open("a", encoding="utf-8") as out:  # made by a label
                    out.write(line)
                n += 1
                progress(n, len(jobs))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return n
