"""`pdecomp analyze`: the report's numbers against a direct recomputation, the toys'
per-feature CI, bad input, the atomic write, and the report opened in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import zlib
from pathlib import Path
from urllib.parse import quote

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import PDECOMP, leet, ok, pdecomp

from pdecomp.analysis import analyze, view
from pdecomp.analysis import report as analysis_report
from pdecomp.core.memory import MemoryPolicy
from pdecomp.kinds.language_model import token_stream
from pdecomp.run.load import load_run
from pdecomp.spd import metrics
from pdecomp.spd.ci import ci_lower
from pdecomp.spd.components import Components, SiteComponents

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.plots=false"]
SITE = "layers.1.mlp.up_proj"
SITES = "[layers.1.mlp.gate_proj,layers.1.mlp.up_proj,layers.1.mlp.down_proj]"


@pytest.fixture(scope="module")
def lm_report(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """A short llama_tiny run (random weights, three sites, a few steps) and its report on
    64 held-out windows, top 3 contexts."""
    tmp = tmp_path_factory.mktemp("lm")
    run_dir = tmp / "run"
    ok(pdecomp(["+experiment=llama_tiny_chunkwise", "model.train_steps=0",
                f"layers.sites={SITES}", "optim.steps=10", "optim.faith_warmup_steps=5",
                "logging.log_every=5", "loss.eval_pgd.n_steps=0", "data.eval_batches=1",
                *QUIET, f"hydra.run.dir={run_dir}"], tmp, env, timeout=600))
    proc = ok(pdecomp(["analyze", str(run_dir), "--windows", "64", "--top-k", "3"], tmp,
                      env))
    assert proc.stdout.strip() == str(run_dir / "analysis" / "index.html")
    return run_dir


@pytest.fixture(scope="module")
def tms_report(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    tmp = tmp_path_factory.mktemp("tms")
    run_dir = tmp / "run"
    # with wandb (offline, the env fixture's): the report's plots go there too
    ok(pdecomp(["+experiment=tms_5-2", "optim.steps=300",
                *(q for q in QUIET if not q.startswith("logging.wandb.")),
                "logging.wandb.artifacts=true", f"hydra.run.dir={run_dir}"], tmp, env))
    ok(pdecomp(["analyze", str(run_dir)], tmp, env))
    return run_dir


def table_rows(page: str, table_id: str) -> list[list[str]]:
    """The rows of a table in the report (or the browser's DOM): each cell's data-v, or its
    text where it has none."""
    body = re.search(rf'<table[^>]*id="?\'?{re.escape(table_id)}["\'][^>]*>.*?<tbody>(.*?)'
                     r"</tbody>", page, re.DOTALL)
    assert body, f"no table {table_id}"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.DOTALL)
    return [[m.group(1) if m.group(1) is not None else m.group(2)
             for m in re.finditer(r'<td[^>]*?(?:data-v="([^"]*)"[^>]*)?>(.*?)</td>', r,
                                  re.DOTALL)]
            for r in rows]


@pytest.mark.slow  # the llama_tiny run compiles for most of a minute
def test_lm_report_matches_a_direct_recomputation(lm_report: Path, cache) -> None:
    assert not (lm_report / "wandb").exists()  # wandb off: no wandb files
    out = lm_report / "analysis"
    assert sorted(p.name for p in out.iterdir()) == ["components", "frequency_norm.png",
                                                     "gate.json", "index.html", "mean_ci.png"]
    page = (out / "index.html").read_text()
    rows = table_rows(page, analysis_report._site_id(SITE) + "-components")
    run = load_run(lm_report)
    C = run.config.layers.C
    assert len(rows) == C
    freq, mean, mx, norm = (np.array([float(r[i]) for r in rows]) for i in range(1, 5))

    # The same 64 held-out windows (two evaluation batches of 32), CI from the loaded CI
    # function directly, on the whole set at once.
    stream = token_stream(run.config.model, run.config.data, run.config.seed, held_out=True)
    x = jnp.asarray(np.concatenate([stream.rows(0, 32), stream.rows(1, 32)]))
    ci = np.asarray(metrics.causal_importances(run.target, run.components, run.ci_fn,
                                               x)[SITE]).reshape(-1, C)
    thr = run.config.loss.ci_threshold
    assert ci.shape[0] == 64 * run.config.data.seq_len
    np.testing.assert_allclose(freq, (ci > thr).mean(0), atol=2 / ci.shape[0])
    np.testing.assert_allclose(mean, ci.mean(0), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(mx, ci.max(0), rtol=1e-4, atol=1e-7)
    comp = run.components.sites[SITE]
    np.testing.assert_allclose(norm, np.linalg.norm(np.asarray(comp.V), axis=0)
                               * np.linalg.norm(np.asarray(comp.U), axis=1), rtol=1e-6)

    # Dead components counted; the top context of a firing component is its max CI.
    sites = {re.sub("<[^>]+>", "", r[0]): r for r in table_rows(page, "sites")}
    assert int(sites[SITE][3]) == int(((ci > thr).sum(0) == 0).sum())
    firing = int(np.argmax(freq))
    top = re.search(r"<div[^>]*>([0-9.]+): ", rows[firing][5])
    assert top and float(top.group(1)) == pytest.approx(mx[firing], abs=1e-3)

    # The same, as the site's Parquet table: exact counts, the bound, the contexts.
    import pyarrow.parquet as pq

    table = pq.read_table(out / "components" / f"{SITE}.parquet")
    assert table.schema.metadata[b"site"] == SITE.encode()
    t = table.to_pydict()
    fired = (ci > thr).sum(0)
    assert t["component"] == list(range(C)) and t["fired"] == fired.tolist()
    assert set(t["positions"]) == {ci.shape[0]} and t["dead"] == (fired == 0).tolist()
    np.testing.assert_allclose(t["mean_ci"], ci.mean(0), rtol=1e-4, atol=1e-7)
    n = ci.shape[0]
    bound = np.array(t["frequency_upper95"])
    assert (bound >= np.array(t["frequency"])).all() and (bound <= 1).all()
    assert np.allclose(bound[fired == 0], 1.959964**2 / (n + 1.959964**2))  # about 3.8 / n
    top = [c["ci"] for c in t["top_contexts"][firing]]
    assert top[0] == pytest.approx(mx[firing], abs=1e-3) and top == sorted(top, reverse=True)
    assert all(c["text"].count("[[") == 1 for c in t["top_contexts"][firing])
    assert len(top) == 3
    assert all(r[5] == "never fires" for r, f in zip(rows, freq) if f == 0)


def test_tms_feature_ci(tms_report: Path, cache) -> None:
    assert (tms_report / "analysis" / "feature_ci.png").is_file()
    page = (tms_report / "analysis" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 3  # mean CI, frequency/norm, feature CI
    run = load_run(tms_report)
    summary, thr = run.summary, run.config.loss.ci_threshold
    assert summary is not None
    for site, m in analyze.feature_ci(run).items():
        assert m.shape == (5, run.config.layers.C)
        lit = m > thr
        # every feature lights a component, and the components some feature lights are the
        # run's own count of them (toys.one_hot_live, at the end of training)
        assert lit.any(1).all(), (site, m.max(1))
        assert int(lit.any(0).sum()) == summary[f"live_one_hot/{site}"]


@pytest.mark.parametrize("case", ["missing", "not a run", "no checkpoints", "empty checkpoints"])
def test_bad_run_dir_exits_2_with_one_line(case: str, tms_report: Path, tmp_path: Path,
                                           env: dict[str, str]) -> None:
    target = tmp_path / "d"
    if case == "not a run":
        target.mkdir()
        (target / "notes.txt").write_text("x")
    elif case != "missing":
        target.mkdir()
        shutil.copy(tms_report / "config.yaml", target)
        if case == "empty checkpoints":
            (target / "checkpoints").mkdir()
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    proc = pdecomp(["analyze", str(target)], tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0] and "expects a run directory" in lines[0]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(("launch", "named"), [
    (["cluster=nosuch"], "cluster=nosuch"),
    (["cluster=slurm", "hydra.launcher.nodes=2"], "hydra.launcher.nodes=2"),
    (["cluster=slurm", "hydra.launcher.bogus=1"], "hydra.launcher.bogus"),
])
def test_bad_launcher_keys_exit_2_before_anything_is_submitted(
        launch: list[str], named: str, tms_report: Path, tmp_path: Path,
        env: dict[str, str]) -> None:
    before = sorted(p.name for p in tms_report.iterdir())
    proc = pdecomp(["analyze", str(tms_report), "--wait", *launch], tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    assert sorted(p.name for p in tms_report.iterdir()) == before


def test_a_failed_write_leaves_the_previous_report(tms_report: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = shutil.copytree(tms_report, tmp_path / "run")
    before = (run_dir / "analysis" / "index.html").read_bytes()

    def half(a, out: Path) -> Path:
        (out / "index.html").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(analysis_report, "render", half)
    with pytest.raises(RuntimeError, match="disk full"):
        analysis_report.write_report(None, run_dir)  # type: ignore[arg-type]
    assert (run_dir / "analysis" / "index.html").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".analysis")) == []


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium, installed (once) when it is missing."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("chromium is not installed and this user cannot install it: run "
                    "`apt-get install -y chromium` as root")
    proc = subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True,
                          text=True, timeout=900, check=False)
    if proc.returncode != 0 or not shutil.which("chromium"):
        proc = subprocess.run("apt-get update && apt-get install -y chromium", shell=True,
                              capture_output=True, text=True, timeout=900, check=False)
    found = shutil.which("chromium")
    if not found:
        pytest.fail(f"could not install chromium (apt-get exit {proc.returncode}): "
                    f"{proc.stderr.strip()[-500:]}")
    return found


def browse(chromium: str, url: str, tmp: Path, *flags: str) -> str:
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={tmp / 'profile'}", *flags, url],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow  # reads the llama_tiny run's report
def test_the_report_renders_in_a_browser(chromium: str, lm_report: Path, cache,
                                         tmp_path: Path) -> None:
    index = lm_report / "analysis" / "index.html"
    table = analysis_report._site_id(SITE) + "-components"
    # sorted on load by frequency, descending, through the page's own script
    dom = browse(chromium, f"{index.as_uri()}#sort={table}:1:desc", tmp_path, "--dump-dom")
    run = load_run(lm_report)
    assert "function sortTable" in dom and "addEventListener(\"click\"" in dom
    assert len(table_rows(dom, "sites")) == len(run.config.layers.sites) == 3
    for site in run.config.layers.sites:
        assert len(table_rows(dom, analysis_report._site_id(site) + "-components")) == \
            run.config.layers.C
    freq = [float(r[1]) for r in table_rows(dom, table)]
    assert freq == sorted(freq, reverse=True) and freq[0] > 0
    assert f'id="{table}" data-sorted="1:desc"' in dom
    assert dom.count("<img") == 2

    shot = tmp_path / "shot.png"
    browse(chromium, index.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_contexts_are_decoded_with_the_model_directorys_tokenizer(tmp_path: Path) -> None:
    """A model directory's tokenizer.json turns ids into the model's own text; without one
    (or without the tokenizers package, which the test extra installs) ids stay ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["the", "cat", "sat", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    decoded = analyze.Tokens(str(tmp_path))
    assert [decoded.decode(i) for i in ids] == ["the", "cat", "sat"]
    assert decoded.source == f"decoded with {tmp_path / 'tokenizer.json'}"
    plain = analyze.Tokens(str(tmp_path / "elsewhere"))
    assert plain.decode(2) == "2" and plain.source == "token ids" and plain.sep == " "


def test_a_character_split_across_byte_level_tokens_is_shown_whole(tmp_path: Path) -> None:
    """Byte-level BPE splits most non-ASCII characters into several tokens, each of which
    alone decodes to U+FFFD; a context's pieces show each character whole, on its last
    token, and join to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    text = "the cat 日本 café"
    ids = tok.encode(text).ids
    decoded = analyze.Tokens(str(tmp_path))
    assert "\ufffd" in "".join(decoded.decode(i) for i in ids)  # one token at a time
    pieces = decoded.pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    assert "日" in pieces and "本" in pieces and "é" in pieces


def test_the_plots_are_logged_to_the_runs_wandb(tms_report: Path) -> None:
    """With wandb on, analyze resumes the run's own wandb run (its id) and logs each plot
    of the report as an image (with wandb off it writes no wandb files: the LM report's
    test)."""
    run_id = (tms_report / "wandb_id.txt").read_text().strip()
    runs = sorted((tms_report / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, runs  # the training run's, then analyze's
    logged = {p.name.rsplit("_", 2)[0] for p in
              (runs[-1] / "files" / "media" / "images" / "analyze").glob("*.png")}
    assert logged == {p.stem for p in (tms_report / "analysis").glob("*.png")} >= {
        "mean_ci", "frequency_norm", "feature_ci"}
    # each site's component table as a wandb.Table, every row of its Parquet file
    tables = runs[-1] / "files" / "media" / "table" / "analyze" / "components"
    for site in ("linear1", "linear2"):
        (f,) = tables.glob(f"{site}_*.table.json")
        logged_table = json.loads(f.read_text())
        parquet = pq.read_table(tms_report / "analysis" / "components" / f"{site}.parquet")
        assert logged_table["columns"] == parquet.column_names
        assert len(logged_table["data"]) == parquet.num_rows
        freq = [row[parquet.column_names.index("frequency")] for row in logged_table["data"]]
        assert freq == sorted(freq, reverse=True)
    # logging.wandb.artifacts: the report's files, copied, as an artifact of the run
    records = [json.loads(line) for line in leet(["--json", str(runs[-1])]).splitlines()]
    arts = [r["artifact"] for r in records if r.get("type") == "artifact"]
    (art,) = [a for a in arts if a["type"] == "report"]  # beside wandb's own of the tables
    report = tms_report / "analysis"
    assert {c["path"] for c in art["manifest"]["contents"]} == {
        str(p.relative_to(report)) for p in report.rglob("*") if p.is_file()} >= {
        "index.html", "mean_ci.png", "components/linear1.parquet"}


def test_top_contexts_rank_saturated_ci_by_its_logit(monkeypatch) -> None:
    """A component whose CI is 1 at several positions: the top positions are those of its
    largest logits, not the first positions met."""
    from pdecomp.analysis import harvest

    logits = jnp.array([[[1.5], [3.0], [0.5], [2.0], [-1.0]]])  # [rows 1, T 5, C 1]
    x = jnp.ones((1, 5, 2))
    comps = Components.of_sites({"s": SiteComponents(jnp.ones((2, 1)), jnp.ones((1, 3)))})
    monkeypatch.setattr(metrics, "site_forward",
                        lambda *a: metrics.SiteForward(None, None, {"s": x}, {"s": logits}))
    step = jax.jit(harvest.step_fn(harvest.Options(0.1, top_k=2)))
    out, _ = step(None, comps, None, None, jax.random.PRNGKey(0), ())
    _, idx, val, act, along = out["s"]["top"]
    assert float(out["s"]["sum"][0]) == 3.5
    assert np.asarray(idx).tolist() == [[1, 3]]  # logits 3.0 and 2.0; clamped, all tie at 1
    assert np.asarray(val).tolist() == [[1.0, 1.0]]
    assert float(out["s"]["max"][0]) == 1.0 and int(out["s"]["fired"][0]) == 4
    np.testing.assert_allclose(np.asarray(along)[0, 0], [1.0, 1.0, 0.5, 1.0, 0.0])
    np.testing.assert_allclose(np.asarray(act), 2 * np.sqrt(3))  # (x . V) ||U||


def test_component_and_feature_axes_tick_at_integers(monkeypatch, tmp_path: Path) -> None:
    """The axes that count components or features tick at whole numbers (no component
    2.5)."""
    from pdecomp.spd import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: figs.append(fig))
    ci = {"s": {"mean_ci": np.linspace(0.1, 0.9, 20), "max_ci": np.ones(20), "live": 20}}
    plots.plot_mean_ci(ci, tmp_path / "m.png", 0.1)  # C = 20: ticks at 2.5, 7.5, ... before
    plots.plot_feature_ci({"s": np.eye(9, 20)}, tmp_path / "f.png", 0.1, 0.75)
    ticks = [*figs[0].axes[0].get_xticks(), *figs[1].axes[0].get_yticks()]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


@pytest.mark.slow
def test_a_run_too_large_for_one_device_is_analysed_on_a_mesh(tmp_path: Path,
                                                              env: dict[str, str]) -> None:
    """TMS with C = 512: the analysis step needs about 0.5 GiB on one device, refused under
    a 0.25 GiB cap before anything is read; on 8 CPU devices the components and CI function
    split along C and it fits, with the tables a single device computes. Only the
    components and the CI function are read from the checkpoint."""
    import pyarrow.parquet as pq

    run_dir = tmp_path / "run"
    ok(pdecomp(["layers.C=512", "optim.steps=10", "data.eval_batches=1", *QUIET,
                f"hydra.run.dir={run_dir}"], tmp_path, env))
    args = ["analyze", str(run_dir), "--inputs", "4096", "--batch-size", "4096"]
    eight = {**env, "PDECOMP_CPU_DEVICES": "8"}
    refused = pdecomp([*args, "--devices", "1", "--hbm-cap-gib", "0.25"], tmp_path, eight)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 3 and len(lines) == 1, refused.stderr[-2000:]
    assert lines[0].startswith("analysis refused") and "on 1 device(s)" in lines[0]
    assert not (run_dir / "analysis").exists()

    ok(pdecomp([*args, "--devices", "8", "--hbm-cap-gib", "0.25"], tmp_path, eight))
    gate = json.loads((run_dir / "analysis" / "gate.json").read_text())
    assert gate["fits"] and gate["n_devices"] == 8 and gate["peak_bytes"] < 0.25 * 2**30
    on_mesh = {s: pq.read_table(run_dir / "analysis" / "components" / f"{s}.parquet")
               for s in ("linear1", "linear2")}
    one = shutil.copytree(run_dir, tmp_path / "one", ignore=shutil.ignore_patterns("analysis"))
    ok(pdecomp(["analyze", str(one), "--inputs", "4096", "--batch-size", "4096"], tmp_path, env))
    assert json.loads((one / "analysis" / "gate.json").read_text())["peak_bytes"] > 0.25 * 2**30
    for s, table in on_mesh.items():
        want = pq.read_table(one / "analysis" / "components" / f"{s}.parquet").to_pydict()
        got = table.to_pydict()
        assert got["fired"] == want["fired"], s
        np.testing.assert_allclose(got["mean_ci"], want["mean_ci"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got["norm"], want["norm"], rtol=1e-5)

    whole, parts = load_run(run_dir), load_run(run_dir, whole_state=False)
    assert parts.state is None and whole.state is not None
    for (k, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path((whole.components,
                                                                     whole.ci_fn)),
                              jax.tree_util.tree_leaves_with_path((parts.components,
                                                                     parts.ci_fn))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(k))


@pytest.mark.slow  # shares the llama_tiny run
def test_export_is_read_back_without_pdecomp(lm_report: Path, tmp_path: Path, env) -> None:
    """`pdecomp export`: V, U per site and the CI function as safetensors with a manifest;
    read with safetensors alone, V @ U is the run's own sum of components and the CI
    function's tensors are its parameters; the second export replaces the first."""
    from safetensors.numpy import load_file

    out = tmp_path / "exported"
    for _ in range(2):
        proc = ok(pdecomp(["export", str(lm_report), "-o", str(out)], tmp_path, env))
    assert proc.stdout.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["ci_fn.safetensors",
                                                     "components.safetensors",
                                                     "manifest.json"]
    manifest = json.loads((out / "manifest.json").read_text())
    comps, ci = load_file(out / "components.safetensors"), load_file(out / "ci_fn.safetensors")
    run = load_run(lm_report, whole_state=False)
    assert manifest["step"] == run.step and manifest["model"]["kind"] == "llama"
    assert set(manifest["sites"]) == set(run.components.sites)
    for s, info in manifest["sites"].items():
        V, U = comps[info["V"]], comps[info["U"]]
        assert V.shape == (info["d_in"], info["C"]) and U.shape == (info["C"], info["d_out"])
        mine = run.components.sites[s]
        np.testing.assert_allclose(V @ U, np.asarray(mine.V @ mine.U), rtol=1e-5, atol=1e-6)
    params = jax.tree.leaves(run.ci_fn)
    assert sum(v.size for v in ci.values()) == sum(p.size for p in params)
    assert {k: list(v.shape) for k, v in ci.items()} == manifest["ci_fn"]["tensors"]
    assert manifest["provenance"]["pdecomp"] and manifest["ci_fn"]["fires_above"] == 0.1


def test_export_refuses_what_is_not_a_run_or_not_its_own(tms_report: Path, tmp_path: Path,
                                                         env) -> None:
    """Bad input: one line and exit 2, nothing written; a tied toy exports both sites."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    proc = pdecomp(["export", str(tms_report), "-o", str(busy)], tmp_path, env)
    assert proc.returncode == 2 and "is not an export" in proc.stderr
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    proc = pdecomp(["export", str(tmp_path / "nothing")], tmp_path, env)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "nothing").exists()
    ok(pdecomp(["export", str(tms_report)], tmp_path, env))
    manifest = json.loads((tms_report / "export" / "manifest.json").read_text())
    assert manifest["sites"]["linear2"]["tied_to"] == "linear1"


@pytest.mark.slow  # shares the llama_tiny run
def test_prompt_shows_the_components_firing_at_each_token(lm_report: Path, tmp_path: Path,
                                                          env) -> None:
    """`pdecomp prompt`: per token, the components with CI above the threshold, strongest
    first, as a direct computation of the CI finds them; a text through a tokenizer gives
    what its ids give; bad input exits 2 with one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pdecomp.analysis import prompt

    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    proc = ok(pdecomp(["prompt", str(lm_report), "--ids", ",".join(map(str, ids)), "--json"],
                      tmp_path, env))
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["id"] for r in rows] == ids and [r["position"] for r in rows] == list(range(8))
    run = load_run(lm_report, whole_state=False)
    ci = metrics.causal_importances(run.target, run.components, run.ci_fn,
                                    jnp.asarray([ids], jnp.int32))
    thr = run.run.config.loss.ci_threshold
    for t, r in enumerate(rows):
        want = {(s, int(c)): float(v[0, t, c]) for s, v in ci.items()
                for c in np.nonzero(np.asarray(v[0, t]) > thr)[0]}
        assert {(s, c): pytest.approx(v, abs=1e-5) for s, c, v in r["firing"]} == want
        values = [v for _, _, v in r["firing"]]
        assert values == sorted(values, reverse=True) and all(v > thr for v in values)
    assert sum(len(r["firing"]) for r in rows) > 0
    words = [f"w{i}" for i in range(10)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = " ".join(f"w{i}" for i in ids)
    proc = ok(pdecomp(["prompt", str(lm_report), text, "--tokenizer", str(tmp_path),
                       "--json"], tmp_path, env))
    worded = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r | {"text": ""} for r in worded] == [r | {"text": ""} for r in rows]
    assert "".join(r["text"] for r in worded).split() == text.split()
    assert [(s, c) for s, c, _ in prompt.firing(run, ids)[0]] == [
        (s, c) for s, c, _ in rows[0]["firing"]]
    for args in (["some text"], ["--ids", "1,x"], ["--ids", "100000"], []):
        proc = pdecomp(["prompt", str(lm_report), *args], tmp_path, env)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, args


def _direct(run, windows: int) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The fixture's held-out windows, and each site's CI and signed activation at every
    position [positions, C], computed at once from the loaded run."""
    B = run.config.data.batch_size
    stream = token_stream(run.config.model, run.config.data, run.config.seed, held_out=True)
    ids = np.concatenate([stream.rows(i, B) for i in range(windows // B)])
    f = metrics.site_forward(run.target, run.components, run.ci_fn, jnp.asarray(ids))
    inputs, logits = f.inputs, f.logits
    ci, act = {}, {}
    for s, logit in logits.items():
        C = logit.shape[-1]
        ci[s] = np.asarray(ci_lower(logit)).reshape(-1, C)
        comp = run.components.sites[s]
        act[s] = (np.asarray(inputs[s]).reshape(-1, comp.V.shape[0]) @ np.asarray(comp.V)
                  * np.linalg.norm(np.asarray(comp.U), axis=1))
    return ids, ci, act


def test_a_value_write_reaches_the_residual_as_the_block_carries_it() -> None:
    """v_proj's residual write is what the layer adds where each query head attends to
    that one position (a window of one token): its group's heads carry the value through
    o_proj (grouped-query attention, 4 query heads on 2 kv heads)."""
    from pdecomp.targets.llama import LlamaConfig, init_llama

    model = init_llama(jax.random.PRNGKey(0), LlamaConfig(num_key_value_heads=2))
    cfg = model.cfg
    U = jax.random.normal(jax.random.PRNGKey(1), (3, cfg.num_key_value_heads * cfg.d_head))
    w = {**model.layer(0), "down_proj": jnp.zeros_like(model.mlp["down_proj"][0])}
    for c in range(3):
        def linear(name, x, W, c=c):
            return jnp.broadcast_to(U[c], (*x.shape[:2], U.shape[1])) if name == "v_proj" \
                else x @ W
        out = model.block(jnp.zeros((1, 1, cfg.hidden_size)), w,
                          model.context(jnp.zeros((1, 1), jnp.int32)), linear)
        np.testing.assert_allclose(
            out[0, 0], model.residual_write("layers.0.self_attn.v_proj", U)[c], rtol=1e-5,
            atol=1e-6)
    assert model.residual_write("layers.0.self_attn.q_proj", U) is None


@pytest.mark.slow  # shares the llama_tiny run
def test_promoted_and_suppressed_tokens_are_the_direct_path(lm_report: Path) -> None:
    """down_proj's components: the tokens whose logit U[c] raises or lowers most through
    the final norm's gain and the unembedding; up_proj's have no such column."""
    run = load_run(lm_report)
    site = "layers.1.mlp.down_proj"
    rows = pq.read_table(lm_report / "analysis" / "components" / f"{site}.parquet").to_pylist()
    target = run.target
    unembed = np.asarray(target.embed).T if target.lm_head is None else np.asarray(
        target.lm_head)
    logits = (np.asarray(run.components.sites[site].U) * np.asarray(target.final_norm)
              ) @ unembed
    for c, row in enumerate(rows):
        want_up, want_down = np.argsort(-logits[c])[:8], np.argsort(logits[c])[:8]
        assert [t["id"] for t in row["promoted_tokens"]] == want_up.tolist(), c
        assert [t["id"] for t in row["suppressed_tokens"]] == want_down.tolist(), c
        np.testing.assert_allclose([t["logit"] for t in row["promoted_tokens"]],
                                   logits[c, want_up], rtol=1e-4, atol=1e-5)
    up = pq.read_table(lm_report / "analysis" / "components" / f"{SITE}.parquet")
    assert "promoted_tokens" not in up.column_names


@pytest.mark.slow  # shares the llama_tiny run
def test_every_statistic_matches_a_direct_recomputation(lm_report: Path) -> None:
    """The CI histogram, the top and drawn contexts with their signed activation, the
    input and next tokens (count, precision, recall, PMI) and the co-firing partners of
    the Parquet tables, each against the same quantity computed directly."""
    from pdecomp.analysis import harvest

    run = load_run(lm_report)
    ids, ci, act = _direct(run, 64)
    thr, edges = run.config.loss.ci_threshold, harvest.HIST_EDGES
    table = pq.read_table(lm_report / "analysis" / "components" / f"{SITE}.parquet")
    assert table.schema.metadata[b"ci_hist_edges"].decode() == ",".join(
        repr(float(e)) for e in edges)
    t = table.to_pylist()
    v, a = ci[SITE], act[SITE]
    fired = v > thr
    bins = np.clip(np.searchsorted(edges, v, side="right") - 1, 0, len(edges) - 2)
    for c, row in enumerate(t):
        assert row["ci_hist"] == np.bincount(bins[:, c], minlength=len(edges) - 1).tolist()
    firing = [c for c in range(v.shape[1]) if fired[:, c].sum() >= 3]
    assert len(firing) > 10
    flat_ids, T = ids.reshape(-1), ids.shape[1]
    for c in firing[:20]:
        row = t[c]
        for ctx in row["top_contexts"]:  # each at a position with that CI and activation
            assert np.isclose(v[:, c], ctx["ci"], atol=1e-5).any()
        top_pos = np.argsort(-v[:, c], kind="stable")[:3]
        if v[top_pos[-1], c] < 1:  # unsaturated: the order of the CI is the logit's
            np.testing.assert_allclose([x["act"] for x in row["top_contexts"]],
                                       a[top_pos, c], rtol=1e-3, atol=1e-4)
        drawn = row["sample_contexts"]
        assert len(drawn) == min(5, fired[:, c].sum())
        for ctx in drawn:
            match = fired[:, c] & np.isclose(v[:, c], ctx["ci"], atol=1e-5) & np.isclose(
                a[:, c], ctx["act"], rtol=1e-3, atol=1e-4)
            assert match.any(), (c, ctx)
        _check_tokens(row["input_tokens"], flat_ids[fired[:, c]], flat_ids)
        has_next = np.arange(len(flat_ids)) % T < T - 1
        nxt = np.roll(flat_ids, -1)
        _check_tokens(row["next_tokens"], nxt[fired[:, c] & has_next], nxt[has_next])
        _check_tokens(row["input_tokens_pmi"], flat_ids[fired[:, c]], flat_ids, by_pmi=True)
        _check_tokens(row["next_tokens_pmi"], nxt[fired[:, c] & has_next], nxt[has_next],
                      by_pmi=True)

    _check_ablation(run, ids, ci, [r.get("ablation_dce") for r in t], fired)

    # co-firing within layer 1 (its three MLP sites), P(d fires | c fires)
    group = [s for s in run.config.layers.sites if s.startswith("layers.1.")]
    masks = np.concatenate([ci[s] > thr for s in group], axis=1).astype(np.int64)
    co = masks.T @ masks
    start = group.index(SITE) * v.shape[1]
    owner = [(s, k) for s in group for k in range(ci[s].shape[1])]
    for c in firing[:20]:
        p = co[start + c] / co[start + c, start + c]
        p[start + c] = -1
        best = np.sort(p)[::-1][:5]
        got = t[c]["cofire"]
        np.testing.assert_allclose([x["p"] for x in got], best[best > 0], rtol=1e-6)
        for x in got:
            assert p[owner.index((x["site"], x["component"]))] == pytest.approx(x["p"])


def _check_tokens(rows: list[dict], at_fired: np.ndarray, everywhere: np.ndarray,
                  by_pmi: bool = False) -> None:
    """A component's token list against counts made directly: each entry's count,
    precision, recall and PMI, and the list is the best by count (or by PMI)."""
    counts = np.bincount(at_fired, minlength=everywhere.max() + 1)
    totals = np.bincount(everywhere, minlength=len(counts))
    n, fired = len(everywhere), len(at_fired)
    pmi = np.log(np.maximum(counts, 1e-300) / fired / (np.maximum(totals, 1) / n))
    for r in rows:
        k = counts[r["id"]]
        assert r["count"] == k and r["precision"] == pytest.approx(k / fired)
        assert r["recall"] == pytest.approx(k / totals[r["id"]])
        assert r["pmi"] == pytest.approx(pmi[r["id"]])
        assert isinstance(r["token"], str)
    if by_pmi:
        eligible = np.sort(pmi[counts >= 3])[::-1]
        np.testing.assert_allclose([r["pmi"] for r in rows], eligible[:len(rows)], rtol=1e-9)
        assert len(rows) == min(8, len(eligible))
    else:
        assert [r["count"] for r in rows] == sorted(counts[counts > 0])[::-1][:8]


@pytest.fixture(scope="module")
def viewer(lm_report: Path, env: dict[str, str]):
    """`pdecomp view` on the llama_tiny run's analysis, on a free port: its address."""
    proc = subprocess.Popen([PDECOMP, "view", str(lm_report), "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.stderr.read())
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def view_rows(chromium: str, url: str, tmp: Path) -> tuple[str, list[int]]:
    """The viewer's page at `url` after its script has fetched and drawn: the DOM and the
    components it shows, in order."""
    dom = browse(chromium, url, tmp, "--dump-dom", "--virtual-time-budget=20000")
    assert "data-shown=" in dom, dom[-2000:]
    return dom, [int(c) for c in re.findall(r'data-component="(\d+)"', dom)]


def check_viewer(chromium: str, run_dir: Path, viewer: str, site: str, tmp: Path) -> dict:
    """What the viewer of `run_dir`'s analysis at `viewer` shows of `site`, against its
    Parquet table: every component page by page, the frequency sort, a component found by a
    token it fires on, and every statistic of it on its row; the component found."""
    rows = pq.read_table(run_dir / "analysis" / "components" / f"{site}.parquet").to_pylist()
    C, per = len(rows), 24
    seen = []
    for page in range(-(-C // per)):  # every component of the site, page by page
        _, shown = view_rows(chromium, f"{viewer}#site={site}&page={page}&per={per}", tmp)
        assert len(shown) == min(per, C - page * per)
        seen += shown
    assert seen == list(range(C))

    _, shown = view_rows(chromium, f"{viewer}#site={site}&sort=frequency&order=desc&per={C}",
                         tmp)
    freq = {r["component"]: r["frequency"] for r in rows}
    assert [freq[c] for c in shown] == sorted(freq.values(), reverse=True)

    # found by a token it fires on: the component whose top input token is the rarest
    # among the components (so the search names few)
    firing = [r for r in rows if r["input_tokens"]]
    target = min(firing, key=lambda r: sum(
        any(t["token"].strip() == r["input_tokens"][0]["token"].strip() for t in o["input_tokens"])
        for o in firing))
    word = target["input_tokens"][0]["token"].strip() or target["input_tokens"][0]["token"]
    _, shown = view_rows(chromium, f"{viewer}#site={site}&q={quote(word)}&per={C}", tmp)
    assert target["component"] in shown and len(shown) < C

    # every statistic of one component on its row
    c = target["component"]
    dom, shown = view_rows(chromium, f"{viewer}#site={site}&q=%23{c}", tmp)
    assert shown == [c]
    row = re.search(rf'<tr[^>]*data-component="{c}".*?</tr>', dom, re.DOTALL).group(0)
    assert f"{target['fired']} of {target['positions']}" in row  # frequency and its bound
    assert row.count('title="CI in [') == len(target["ci_hist"])  # the histogram's bins
    assert row.count('class="ctx"') == len(target["top_contexts"]) + len(
        target["sample_contexts"])  # top and drawn contexts, the firing token in <b>
    assert row.count("<b>") == row.count('class="ctx"')
    assert row.count('class="tok"') == sum(len(target.get(k) or ()) for k in view.TOKEN_COLUMNS)
    for p in target["cofire"]:
        assert f"{p['site']} #{p['component']}" in row
    dce = re.search(r'class="n ablation">([^<]*)<', row).group(1)  # its ablation effect
    assert float(dce) == pytest.approx(target["ablation_dce"], rel=2e-3)
    return target


@pytest.mark.slow  # shares the llama_tiny run
def test_the_viewer_pages_sorts_and_searches_in_a_browser(chromium: str, lm_report: Path,
                                                           viewer: str, tmp_path: Path) -> None:
    check_viewer(chromium, lm_report, viewer, SITE, tmp_path)

    # a down_proj component's promoted and suppressed tokens, each with its logit
    down = "layers.1.mlp.down_proj"
    first = pq.read_table(lm_report / "analysis" / "components" / f"{down}.parquet").slice(
        0, 1).to_pylist()[0]
    dom, shown = view_rows(chromium, f"{viewer}#site={down}&q=%230", tmp_path)
    row = re.search(r'<tr[^>]*data-component="0".*?</tr>', dom, re.DOTALL).group(0)
    effects = first["promoted_tokens"] + first["suppressed_tokens"]
    assert shown == [0] and row.count('class="tok"') == sum(
        len(first[k] or ()) for k in view.TOKEN_COLUMNS)
    assert len(effects) == 16 and "suppresses:" in row

    # a text read token by token: the components firing at each, strongest first, each a
    # link to its row; a text this tokenizer-less run cannot encode is refused in one line
    from pdecomp.analysis import prompt

    ids = [3, 17, 5, 9]
    want = prompt.firing(load_run(lm_report), ids)
    assert any(want), want
    dom, _ = view_rows(chromium, f"{viewer}#site={SITE}&prompt={','.join(map(str, ids))}&ids=1",
                       tmp_path)
    readings = re.findall(r'<tr class="reading" data-position="(\d+)">(.*?)</tr>', dom,
                          re.DOTALL)
    assert [int(t) for t, _ in readings] == list(range(len(ids)))
    for (_, html), fired in zip(readings, want):
        shown = re.findall(r'class="firing"[^>]*>([^<]*) #(\d+)</a>', html)
        assert shown == [(s, str(c)) for s, c, _ in fired[:12]]
        assert ("none above" in html) == (not fired)
    dom, _ = view_rows(chromium, f"{viewer}#site={SITE}&prompt=hello", tmp_path)
    assert "no tokenizer.json" in dom


class ChatAPI:
    """An OpenAI-compatible chat endpoint on a free local port: each answer names its
    prompt's checksum; the first request is told to come back (429); a key other than
    `sk-test` is refused (401)."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.prompts: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                first = not api.prompts and not getattr(api, "limited", False)
                if self.headers["Authorization"] != "Bearer sk-test" or first:
                    api.limited = True
                    self.send_response(401 if not first else 429)
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    return
                text = body["messages"][0]["content"]
                api.prompts.append(text)
                out = json.dumps({"choices": [{"message": {
                    "content": f" label {zlib.crc32(text.encode())}\nmore"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.mark.slow  # shares the llama_tiny run
def test_labels_come_from_the_api_resume_and_are_searched(
        lm_report: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdecomp label`: one prompt per firing component from its row (most frequent first,
    --limit per site), the answer's first line appended as its label; a rate limit is
    waited out; a second call labels only what the first did not; a refused key is one
    line and exit 2 with the labels kept; the viewer finds a component by its label."""
    from launcher.commands import label
    from pdecomp.analysis import labels, view

    run = shutil.copytree(lm_report, tmp_path / "run")
    api = ChatAPI()
    common = [str(run), "--api-base", api.base, "--api-key-env", "TEST_KEY", "--workers", "3"]
    monkeypatch.delenv("TEST_KEY", raising=False)
    assert label.main([*common, "--limit", "2"]) == 2 and not (run / labels.FILE).exists()
    monkeypatch.setenv("TEST_KEY", "sk-test")
    assert label.main([*common, "--limit", "2"]) == 0
    assert label.main([*common, "--limit", "3"]) == 0
    got = labels.read_labels(run)
    tables = sorted((run / "analysis" / "components").glob("*.parquet"))
    want = {}
    for path in tables:
        site = pq.read_schema(path).metadata[b"site"].decode()
        rows = sorted((r for r in pq.read_table(path).to_pylist() if not r["dead"]),
                      key=lambda r: -r["frequency"])[:3]
        want |= {(site, r["component"]): f"label {zlib.crc32(labels.prompt_for(site, r).encode())}"
                 for r in rows}
    assert got == want and len(api.prompts) == len(want) == 3 * len(tables)
    monkeypatch.setenv("TEST_KEY", "sk-wrong")
    assert label.main([*common, "--limit", "4"]) == 2 and labels.read_labels(run) == got
    (site, c), label = next(iter(got.items()))
    found = view.Tables(run / "analysis" / "components").page(site, 0, 50, "component", False,
                                                              label.upper())
    assert [r["component"] for r in found["rows"]] == [c] and found["rows"][0]["label"] == label


@pytest.mark.slow  # a deviceless compile
def test_the_analysis_gates_deviceless_for_gpus_it_does_not_have(tmp_path: Path, env) -> None:
    """A run directory holding only its composed config (no checkpoint) gated for 8 H100s
    from this CPU host: the report on stdout, exit 0 (a refusal is the local gate's, tested
    on a mesh above); hosts that are not whole, exit 2; nothing written in the directory."""
    run_dir = tmp_path / "composed"
    run_dir.mkdir()
    cfg = ok(pdecomp(["+experiment=llama_tiny_chunkwise", f"layers.sites={SITES}",
                      "--cfg", "job", "--resolve"], tmp_path, env))
    (run_dir / "config.yaml").write_text(cfg.stdout)
    proc = ok(pdecomp(["analyze", str(run_dir), "--target", "h100", "--devices", "8"],
                      tmp_path, env))
    report = json.loads(proc.stdout)
    assert report["fits"] and report["n_devices"] == 8 and report["mesh"] == {"data": 1,
                                                                               "model": 8}
    assert "h100 (deviceless)" in report["target"] and report["cap_source"].startswith("h100")
    assert report["peak_bytes"] > report["argument_bytes"] > 0

    proc = pdecomp(["analyze", str(run_dir), "--target", "h100", "--devices", "12"],
                   tmp_path, env)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "pdecomp analyze: --devices=12 must be a multiple of --gpus-per-host=8 (whole hosts)")
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


def _check_ablation(run, ids: np.ndarray, ci: dict[str, np.ndarray], ablation: list,
                    fired: np.ndarray, eps: float = 1e-2) -> None:
    """The first-order ablation effect of the three components of largest effect, against
    a finite difference: the CE summed over the windows' positions with the component's
    mask at 1 - eps where it fires (1 elsewhere, the delta channel on), less the CE with
    every mask at 1, over eps. A component that never fires has none."""
    from pdecomp.spd.components import SiteMask, masked_linear

    sites = tuple(ci)
    x = jnp.asarray(ids)
    prefix, suffix = run.target.split(sites, MemoryPolicy())
    resid = prefix(x)

    @jax.jit
    def nll(masks):  # per predicted position
        logits = suffix(resid, masked_linear(run.components, {
            s: SiteMask(masks[s], jnp.ones(masks[s].shape[:-1]), None) for s in sites}))
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, x[:, 1:, None], axis=-1)[..., 0]

    shape = ids.shape
    ones = {s: jnp.ones((*shape, ci[s].shape[1])) for s in sites}
    base = nll(ones)
    assert all((a is None) == (not fired[:, c].any()) for c, a in enumerate(ablation))
    counts = fired.sum(0)
    effect = np.array([0.0 if a is None else a for a in ablation]) * counts
    for c in np.argsort(-np.abs(effect))[:3]:
        m = np.ones((*shape, fired.shape[1]), np.float32)
        m.reshape(-1, fired.shape[1])[fired[:, c], c] = 1 - eps
        diff = float(jnp.sum(nll({**ones, SITE: jnp.asarray(m)}) - base)) / eps
        assert effect[c] == pytest.approx(diff, rel=0.05, abs=1e-2), (c, effect[c], diff)


def test_a_sites_static_table_lists_its_most_frequent_components_when_large(monkeypatch
                                                                             ) -> None:
    """Past STATIC_ROWS components, the page lists the most frequent (in component order)
    and says where the rest are."""
    monkeypatch.setattr(analysis_report, "STATIC_ROWS", 5)
    C = 20
    freq = np.random.default_rng(0).random(C)
    v = analyze.SiteStats(freq, freq / 2, freq, np.ones(C), 100, np.zeros((C, 10), int))
    a = analyze.Analysis(None, {"s": v}, None, None, "")
    page = "\n".join(analysis_report._site_rows(a, "layers.0.mlp.up_proj", v))
    shown = [int(c) for c in re.findall(r"<tr[^>]*><td data-v=\"(\d+)\"", page)]
    assert shown == sorted(np.argsort(-freq)[:5].tolist())
    assert "the 5 most frequent" in page and "layers.0.mlp.up_proj.parquet" in page


@pytest.mark.slow  # shares the llama_tiny run
def test_a_stopped_analysis_goes_on_from_its_last_save(lm_report: Path, tmp_path: Path,
                                                       monkeypatch) -> None:
    """The fixture's request (64 windows, two batches of 32), stopped after the first batch
    (saving after each): the same command goes on from the save (also as an older version
    pickled it), reads the second batch only, and its tables equal the fixture's
    uninterrupted pass's."""
    import pickle

    from launcher.commands import analyze as analyze_command
    from pdecomp.analysis import state as analysis_state

    run_dir = tmp_path / "run"
    shutil.copytree(lm_report, run_dir, ignore=shutil.ignore_patterns("analysis"))
    args = [str(run_dir), "--windows", "64", "--top-k", "3", "--save-every", "0"]
    read: list[int] = []

    def stop_after(batches: int):
        def bar(total, label):
            def update(done, _):
                read.append(done)
                if len(read) == batches:
                    raise KeyboardInterrupt
            return update, lambda: None
        return bar

    monkeypatch.setattr(analyze_command, "progress_bar", stop_after(1))
    with pytest.raises(KeyboardInterrupt):
        analyze_command.main(args)
    saved = run_dir / analysis_state.PARTIAL / "pass.pkl"
    assert saved.is_file() and not (run_dir / "analysis").exists()
    # as a pdecomp before the library's floors saved it: its classes at their old places
    with open(saved, "rb") as f:
        older = pickle.dumps(analysis_state.OlderLayoutUnpickler(f).load(), protocol=0)
    for old, new in analysis_state.MOVED.items():
        older = older.replace(f"c{new}\n".encode(), f"c{old}\n".encode())
    assert b"cpdecomp.harvest\n" in older
    saved.write_bytes(older)
    read.clear()
    monkeypatch.setattr(analyze_command, "progress_bar", stop_after(-1))
    assert analyze_command.main(args) == 0
    assert read == [64]  # the second batch only
    assert not (run_dir / analysis_state.PARTIAL).exists()
    for path in (lm_report / "analysis" / "components").iterdir():
        resumed = pq.read_table(run_dir / "analysis" / "components" / path.name)
        assert resumed.to_pylist() == pq.read_table(path).to_pylist(), path.name
