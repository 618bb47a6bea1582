"""Every command ends cleanly: damaged run files, disagreeing run directories, file-system
faults, the network and the label API, devices, and odd paths, each as a user meets them
(the real console script): the documented exit code, no traceback, one line naming what is
wrong, and nothing left behind that was not there before."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ok, pdecomp, run_on_cpu_devices

from pdecomp.analysis import labels
from pdecomp.analysis import state as analysis_state

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.plots=false"]


@pytest.fixture(scope="module")
def tms_run(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """A short TMS run with checkpoints at steps 150 and 300."""
    tmp = tmp_path_factory.mktemp("tms")
    run_dir = tmp / "run"
    ok(pdecomp(["+experiment=tms_5-2", "optim.steps=300", "logging.ckpt_every=150",
                "data.eval_batches=1", *QUIET, f"hydra.run.dir={run_dir}"], tmp, env))
    return run_dir


def entries(d: Path) -> dict[str, bytes | None]:
    """Every path under `d` with a file's bytes (None for a directory)."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


def one_line(proc: subprocess.CompletedProcess[str], code: int, *texts: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines, proc.stdout[-2000:]
    for text in texts:
        assert text in lines[-1], f"{text!r} not in: {lines[-1]}"
    return lines[-1]


def write(path: str, data: str | bytes) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        target = run / path
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.write_bytes if isinstance(data, bytes) else target.write_text)(data)
    return damage


def edit_json(path: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        record = json.loads((run / path).read_text())
        change(record)
        (run / path).write_text(json.dumps(record))
    return damage


def damage_checkpoint(step: str) -> Callable[[Path], None]:
    """Every array data file of the checkpoint at `step` cut to 10 bytes."""
    def damage(run: Path) -> None:
        for f in (run / "checkpoints" / step).rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(f.read_bytes()[:10])
    return damage


def set_layers_C(record: dict) -> None:
    record["config"]["layers"]["C"] = 7


def set_kind(record: dict) -> None:
    record["config"]["model"] = {"kind": "resid_mlp"}


# (case, damage, the command after `pdecomp`, code, texts of the last line)
DAMAGED = [
    ("run.json not JSON, export", write("run.json", "{bad"), ["export", "{run}"], 2,
     ["run.json", "not JSON"]),
    ("run.json not JSON, resume", write("run.json", "{bad"), ["resume", "{run}"], 2,
     ["run.json", "not JSON"]),
    ("run.json not JSON, prompt", write("run.json", "{bad"), ["prompt", "{run}", "hi"], 2,
     ["run.json"]),
    ("run.json cut mid-character", write("run.json", b'{"config": "caf\xc3'),
     ["export", "{run}"], 2, ["run.json"]),
    ("run.json with a bad value", edit_json("run.json", lambda r: r["config"]["layers"]
                                            .update(C="x")), ["export", "{run}"], 2,
     ["run.json", "layers.C"]),
    ("run.json says another C", edit_json("run.json", set_layers_C), ["export", "{run}"], 2,
     ["another run's state"]),
    ("run.json says another C, analyze", edit_json("run.json", set_layers_C),
     ["analyze", "{run}"], 2, ["another run's state"]),
    ("run.json says another kind", edit_json("run.json", set_kind), ["export", "{run}"], 2,
     []),
    ("gate.json not JSON", write("gate.json", "{"), ["export", "{run}"], 2, ["gate.json"]),
    ("history.json not JSON", write("history.json", "[1,"), ["export", "{run}"], 2,
     ["history.json"]),
    ("overrides.yaml not YAML", write(".hydra/overrides.yaml", "- [bad"),
     ["resume", "{run}"], 2, ["overrides.yaml", "not YAML"]),
    ("overrides.yaml not a list", write(".hydra/overrides.yaml", "a: 1"),
     ["resume", "{run}"], 2, ["overrides.yaml"]),
    ("a partial analysis cut short", write(".analysis-partial/pass.pkl", b"\x80\x05\x95"),
     ["analyze", "{run}"], 2, [".analysis-partial", "remove"]),
    ("every checkpoint damaged", lambda r: (damage_checkpoint("150")(r),
                                            damage_checkpoint("300")(r)),
     ["export", "{run}"], 2, ["no checkpoint can be read"]),
]


@pytest.mark.parametrize(("case", "damage", "command", "code", "texts"), DAMAGED,
                         ids=[c[0] for c in DAMAGED])
def test_a_damaged_or_disagreeing_run_directory_is_refused_in_one_line(
        case, damage, command, code, texts, tms_run: Path, tmp_path: Path,
        env: dict[str, str]) -> None:
    run = shutil.copytree(tms_run, tmp_path / "run")
    damage(run)
    before = entries(tmp_path)
    one_line(pdecomp([a.format(run=run) for a in command], tmp_path, env), code, *texts)
    assert entries(tmp_path) == before  # nothing written, nothing removed


def test_a_damaged_latest_checkpoint_is_passed_over_for_the_one_before(
        tms_run: Path, tmp_path: Path, env: dict[str, str]) -> None:
    run = shutil.copytree(tms_run, tmp_path / "run")
    damage_checkpoint("300")(run)
    proc = ok(pdecomp(["export", str(run)], tmp_path, env))
    assert "checkpoint at step 300 cannot be read" in proc.stderr
    assert "(step 150)" in proc.stderr
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert manifest["step"] == 150
    assert (run / "checkpoints" / "300").is_dir()  # a reader moves nothing aside


def test_a_damaged_sweep_file_ends_status_in_one_line(tms_run: Path, tmp_path: Path,
                                                       env: dict[str, str]) -> None:
    sweep = tmp_path / "sweep"
    shutil.copytree(tms_run, sweep / "0")
    (sweep / "0" / "summary.json").write_text("{")
    one_line(pdecomp(["status", str(sweep)], tmp_path, env), 2, "summary.json")


# -- where the output goes ------------------------------------------------------------------

def test_export_never_removes_what_it_did_not_write(tms_run: Path, tmp_path: Path,
                                                    env: dict[str, str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "manifest.json").write_text('{"mine": true}')  # not an export's
    before = entries(tmp_path)
    one_line(pdecomp(["export", str(tms_run), "-o", str(out)], tmp_path, env), 2,
             "is not an export")
    assert entries(tmp_path) == before
    # an earlier export with the user's file put beside it: the export's files replaced only
    shutil.rmtree(out)
    ok(pdecomp(["export", str(tms_run), "-o", str(out)], tmp_path, env))
    (out / "notes.txt").write_text("mine")
    (out / "components.safetensors").write_bytes(b"old")
    ok(pdecomp(["export", str(tms_run), "-o", str(out)], tmp_path, env))
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "components.safetensors").read_bytes() != b"old"
    assert sorted(p.name for p in out.iterdir()) == [
        "ci_fn.safetensors", "components.safetensors", "manifest.json", "notes.txt"]


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """mount(size, read_only, copy=DIR): a tmpfs of its own (root, which CI runs as, writes
    in any directory whatever its mode, but not on a read-only or a full file system)."""
    points: list[Path] = []

    def mount(size: str, read_only: bool, copy: Path | None = None) -> Path:
        d = tmp_path / f"fs{len(points)}"
        d.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        points.append(d)
        if copy is not None:
            shutil.copytree(copy, d / "run")
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        return d

    yield mount
    for d in points:
        subprocess.run(["umount", str(d)], check=False)


@pytest.mark.parametrize(("command", "texts"), [
    (["analyze", "{run}"], ["Read-only file system"]),
    (["export", "{run}"], ["Read-only file system"]),
    (["export", "{src}", "-o", "{fs}/out"], ["Read-only file system"]),
])
def test_a_read_only_file_system_is_refused_before_anything_is_computed(
        command: list[str], texts: list[str], tms_run: Path, mounted, tmp_path: Path,
        env: dict[str, str]) -> None:
    fs = mounted("16m", True, copy=tms_run)
    before = entries(fs)
    args = [a.format(run=fs / "run", src=tms_run, fs=fs) for a in command]
    one_line(pdecomp(args, tmp_path, env), 2, *texts)
    assert entries(fs) == before


def test_a_full_disk_ends_export_in_one_line_with_nothing_half_written(
        tms_run: Path, mounted, tmp_path: Path, env: dict[str, str]) -> None:
    fs = mounted("1m", False)
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # every block taken
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    before = entries(fs)
    one_line(pdecomp(["export", str(tms_run), "-o", str(fs / "out")], tmp_path, env), 1,
             "no space left on device")
    assert entries(fs) == before


# -- the label API and the viewer -----------------------------------------------------------

def analysed(run_dir: Path) -> Path:
    """A run directory with an analysis table of two firing components of one site, as
    `pdecomp analyze` writes it (the columns `label` and `view` read)."""
    ctx = pa.list_(pa.struct([("text", pa.string()), ("ci", pa.float64())]))
    tok = pa.list_(pa.struct([("token", pa.string()), ("count", pa.int64())]))
    table = pa.table({"component": pa.array([0, 1], pa.int32()),
                      "frequency": [0.1, 0.2], "dead": [False, False],
                      "top_contexts": pa.array([[{"text": "a [[b]]", "ci": 0.9}]] * 2, ctx),
                      "sample_contexts": pa.array([[]] * 2, ctx),
                      "input_tokens": pa.array([[{"token": "b", "count": 3}]] * 2, tok),
                      "next_tokens": pa.array([[]] * 2, tok)})
    table = table.replace_schema_metadata({"site": "layers.0.mlp.up_proj"})
    (run_dir / "analysis" / "components").mkdir(parents=True)
    pq.write_table(table, run_dir / "analysis" / "components" / "layers.0.mlp.up_proj.parquet")
    return run_dir


class API(http.server.BaseHTTPRequestHandler):
    """A chat API on loopback answering every request with `answer` (status, body)."""

    answer: tuple[int, bytes] = (200, b"")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = self.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api() -> Iterator[Callable[[int, bytes], str]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), API)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def answering(status: int, body: bytes) -> str:
        API.answer = (status, body)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield answering
    server.shutdown()
    server.server_close()


CHAT = json.dumps({"choices": [{"message": {"content": "a label"}}]}).encode()


@pytest.mark.parametrize(("status", "body", "code", "texts"), [
    (200, b"<html><body>a login page</body></html>", 2, ["not an OpenAI-compatible", "<html>"]),
    (200, b'{"error": "no such model"}', 2, ["not an OpenAI-compatible"]),
    (401, b'{"error": "bad key"}', 2, ["HTTP 401"]),
], ids=["html", "json without choices", "refused key"])
def test_label_ends_a_bad_answer_in_one_line_and_writes_nothing(
        status: int, body: bytes, code: int, texts: list[str], api, tmp_path: Path,
        env: dict[str, str]) -> None:
    run = analysed(tmp_path / "run")
    before = entries(tmp_path)
    one_line(pdecomp(["label", str(run), "--api-base", api(status, body), "--workers", "1"],
                     tmp_path, {**env, "OPENAI_API_KEY": "k"}), code, *texts)
    assert entries(tmp_path) == before  # no empty labels.jsonl


def test_label_goes_on_past_a_line_cut_mid_character(api, tmp_path: Path,
                                                     env: dict[str, str]) -> None:
    run = analysed(tmp_path / "run")
    done = json.dumps({"site": "layers.0.mlp.up_proj", "component": 0, "label": "café"},
                      ensure_ascii=False).encode()
    (run / labels.FILE).write_bytes(done + b"\n" + done[:-4])  # cut inside the é
    assert labels.read_labels(run) == {("layers.0.mlp.up_proj", 0): "café"}
    ok(pdecomp(["label", str(run), "--api-base", api(200, CHAT)], tmp_path,
               {**env, "OPENAI_API_KEY": "k"}))
    lines = (run / labels.FILE).read_bytes().splitlines()
    assert [json.loads(line)["component"] for line in lines] == [0, 1]
    assert labels.read_labels(run)[("layers.0.mlp.up_proj", 1)] == "a label"


def test_view_on_a_port_in_use_ends_in_one_line(tmp_path: Path, env: dict[str, str]) -> None:
    run = analysed(tmp_path / "run")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line(pdecomp(["view", str(run), "--port", str(port)], tmp_path, env), 2,
                 f"--port={port}", "cannot listen")


# -- devices --------------------------------------------------------------------------------

def test_more_devices_than_the_host_has_is_refused(tms_run: Path, tmp_path: Path,
                                                   env: dict[str, str]) -> None:
    one_line(pdecomp(["analyze", str(tms_run), "--devices", "3"], tmp_path, env), 2,
             "--devices=3")


def test_a_partial_analysis_continues_on_another_device_count(tmp_path: Path) -> None:
    """Co-firing counts saved split over 2 devices are read back onto 3 and onto 1, equal."""
    import jax.numpy as jnp

    script = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pdecomp.analysis import state as analysis_state
mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
counts = jax.device_put(jnp.arange(36, dtype=jnp.int32).reshape(6, 6),
                        NamedSharding(mesh, P("model", None)))
state = analysis_state.PassState({"windows": 8}, 1, 4, {}, [])
if sys.argv[1] == "save":
    analysis_state.save(Path(sys.argv[2]), state, (counts,))
    print(json.dumps(len(counts.addressable_shards)))
else:
    got, (back,) = analysis_state.load(Path(sys.argv[2]), {"windows": 8}, (counts * 0,))
    print(json.dumps(np.asarray(back).tolist()))
"""
    assert run_on_cpu_devices(script, 2, "save", str(tmp_path)) == 2
    whole = np.arange(36).reshape(6, 6).tolist()
    assert run_on_cpu_devices(script, 3, "load", str(tmp_path)) == whole
    like = jnp.zeros((6, 6), jnp.int32)
    state = analysis_state.load(tmp_path, {"windows": 8}, (like,))
    assert state is not None and np.asarray(state[1][0]).tolist() == whole
    assert analysis_state.load(tmp_path, {"windows": 16}, (like,)) is None  # another request


# -- odd paths ------------------------------------------------------------------------------

@pytest.mark.slow  # the resumed run evaluates again: seconds more than the fast tier's share
def test_paths_with_commas_equals_spaces_and_accents_work(tms_run: Path, tmp_path: Path,
                                                          env: dict[str, str]) -> None:
    odd = tmp_path / "runs, a=b c" / "é [x]"
    run = shutil.copytree(tms_run, odd / "run")
    ok(pdecomp(["export", str(run), "-o", str(odd / "out, é")], tmp_path, env))
    proc = ok(pdecomp(["resume", str(run), *QUIET], tmp_path, env))
    assert json.loads((run / "summary.json").read_text())["steps"] == 300
    assert "config error" not in proc.stderr
    assert os.path.isfile(odd / "out, é" / "manifest.json")


def test_a_run_written_with_the_scopes_former_names_opens(tms_run: Path, tmp_path: Path,
                                                          env: dict[str, str]) -> None:
    """Scopes named before they were named for what they share ("batch_shared" was one
    source per position) read as their present names."""
    run = shutil.copytree(tms_run, tmp_path / "run")

    def former(record: dict) -> None:
        record["config"]["loss"]["pgd"]["scope"] = "batch_shared"
        record["config"]["loss"]["eval_pgd"]["scope"] = "per_example"

    edit_json("run.json", former)(run)
    ok(pdecomp(["export", str(run)], tmp_path, env))
    from pdecomp.run.load import read_config

    loss = read_config(run).loss
    assert (loss.pgd.scope, loss.eval_pgd.scope) == ("per_position", "per_token")
