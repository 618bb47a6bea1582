"""Bad input on the `pdecomp` command line: exit code 2, one line naming the key, no trace.

Every case runs in a fresh, empty working directory and checks that the launcher refused
before Hydra made a run (or sweep) directory. The table of cases runs the console script's
`main` each in a process of its own, forked from one that imported it once (`FORKED`: the
same code path without 57 start-ups of Python, jax and Hydra); the others run the console
script itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import PDECOMP

# (id, argv after `pdecomp`, what the one-line message must contain: the offending key, or
#  a tuple of texts that must all appear)
CASES = [
    ("unknown-key", ["model.n_featurs=3"], "model.n_featurs"),
    ("unknown-top-level-key", ["foo=1"], "foo"),
    ("wrong-type", ["model.n_features=abc"], "model.n_features"),
    ("wrong-type-in-list", ["layers.ci_hidden=[a]"], "layers.ci_hidden"),
    ("unknown-group-option", ["model=nope"], ("model", "nope")),
    ("site-not-in-model", ["layers.sites=[foo]"], "layers.sites"),
    ("no-sites", ["layers.sites=[]"], "layers.sites"),
    ("site-range-backwards", ["layers.sites=[linear1-0]"], "layers.sites"),
    ("C-zero", ["layers.C=0"], "layers.C"),
    ("C-per-site-unknown-site", ["layers.C_per_site={foo:3}"], "layers.C_per_site"),
    ("negative-lr", ["optim.components.lr=-1"], "optim.components.lr"),
    ("bad-schedule", ["optim.ci_fn.schedule=exponential"], "optim.ci_fn.schedule"),
    ("bad-ci-fn", ["layers.ci_fn=transformer"], "layers.ci_fn"),
    ("bad-recon-plan", ["loss.recon.full.plan=sideways"], "loss.recon.full.plan"),
    ("chunk-too-big", ["loss.recon.full.plan=chunkwise", "loss.recon.full.sites_per_chunk=3"],
     "loss.recon.full.sites_per_chunk"),
    ("bad-routing", ["loss.recon.layerwise.routing=random"], "loss.recon.layerwise.routing"),
    ("bad-source", ["loss.recon.full.source=gaussian"], "loss.recon.full.source"),
    ("anneal-end-before-start",
     ["loss.p_anneal_start_frac=0.6", "loss.p_anneal_end_frac=0.3"], "loss.p_anneal_end_frac"),
    ("batch-size-zero", ["data.batch_size=0"], "data.batch_size"),
    ("feature-prob-above-one", ["model.feature_prob=1.5"], "model.feature_prob"),
    ("bad-distance", ["loss.distance=l1"], "loss.distance"),
    ("bad-compute-dtype", ["memory.compute_dtype=float8"], "memory.compute_dtype"),
    ("bad-matmul-dtype", ["memory.matmul_dtype=int8"], "memory.matmul_dtype"),
    ("bad-gate-target", ["gate.target=tpu"], "gate.target"),
    ("bad-value-inside-sweep", ["-m", "layers.C=5,0,10"], "layers.C"),
    ("bad-type-inside-sweep", ["-m", "data.batch_size=128,big"], "data.batch_size"),
    ("bad-group-option-inside-sweep", ["-m", "model=tms_5-2,nope"], ("model", "nope")),
    ("override-syntax-error", ["layers.sites=[foo"], "layers.sites"),
    ("not-optional", ["model.n_features=null"], "model.n_features"),
    ("kl-on-a-toy", ["loss.distance=kl"], "loss.distance"),
    ("bad-remat", ["memory.remat=some"], "memory.remat"),
    ("llama-path-missing", ["+experiment=llama_tiny_chunkwise", "model.path=/nonexistent/llama"],
     "model.path"),
    ("llama-site-out-of-range", ["+experiment=llama_tiny_chunkwise",
                                 "layers.sites=[layers.9.mlp.up_proj]"], "layers.sites"),
    ("toy-data-for-llama", ["+experiment=llama_tiny_chunkwise", "data=toy"], "data.source"),
    ("tokens-without-path", ["+experiment=llama_tiny_chunkwise", "data=tokens"], "data.path"),
    ("bad-pgd-scope", ["+experiment=llama_tiny_chunkwise", "loss.pgd.scope=batch"],
     "loss.pgd.scope"),
    ("ci-heads-not-dividing", ["+experiment=llama_tiny_chunkwise", "layers.ci_heads=3"],
     "layers.ci_heads"),
    ("eval-frac-not-a-fraction", ["+experiment=llama_tiny_chunkwise", "data.eval_frac=1.5"],
     "data.eval_frac"),
    ("eval-pgd-negative-steps", ["+experiment=llama_tiny_chunkwise",
                                 "loss.eval_pgd.n_steps=-1"], "loss.eval_pgd.n_steps"),
    ("seed-negative-tms", ["seed=-1"], ("seed=-1", "[0, 2147483647]", "every model kind")),
    ("seed-negative-resid-mlp", ["+experiment=resid_mlp1", "seed=-1"], "seed=-1"),
    ("seed-negative-llama", ["+experiment=llama_tiny_chunkwise", "seed=-1"], "seed=-1"),
    ("seed-beyond-32-bits", ["seed=4294967296"], "seed=4294967296"),
    ("model-seed-negative-llama", ["+experiment=llama_tiny_chunkwise", "model.seed=-5"],
     "model.seed=-5"),
    ("seed-negative-inside-sweep", ["-m", "seed=0,-1"], "seed=-1"),
    ("required-value-left-missing", ["layers.C=???"], ("layers.C", "for you to give")),
    ("required-value-missing-in-sweep", ["-m", "layers.C=???", "seed=0,1"], "layers.C"),
    ("unknown-preset-in-own-config-dir", ["--config-dir", "/nonexistent/conf",
                                          "+experiment=mine"], ("--config-dir", "no such")),
    ("searching-sweeper-without-objective",
     ["-m", "hydra/sweeper=optuna", "loss.imp_min_coeff=interval(1e-4,1e-2)"],
     ("logging.objective", "OptunaSweeper")),
    ("interval-end-not-allowed", ["-m", "hydra/sweeper=optuna", "logging.objective=loss/total",
                                  "layers.C=tag(int, interval(0, 10))"], "layers.C=0"),
    ("preset-rope-yarn", ["+experiment=llama_tiny_chunkwise",
                          "model.rope_scaling={rope_type:yarn,factor:4.0}"],
     ("model.rope_scaling.rope_type", "default, llama3")),
    ("mesh-fit-without-gpu-rates", ["gate.fit=mesh"], ("gate.fit", "gate.target=h100")),
    ("mesh-fit-with-data-axis-fixed",
     ["gate.fit=mesh", "gate.target=h100", "mesh.gpus_per_host=4", "mesh.data=2"], "mesh.data"),
    ("mesh-fit-no-split-within-a-host-divides-the-batch",  # the config's own spans hosts
     ["gate.fit=mesh", "gate.target=h100", "mesh.hosts=2", "mesh.gpus_per_host=4",
      "mesh.model=8", "data.batch_size=8", "optim.microbatches=8"],
     ("data.batch_size", "2 x 4 GPUs")),
    ("preset-rope-llama3-without-factor",
     ["+experiment=llama_tiny_chunkwise", "~model.rope_scaling.factor"],
     ("model.rope_scaling.factor", "number > 0")),
]


# Runs each case's argv through `launcher.app.main` in a fork of this process (imported
# once), its stdout and stderr to files, in its own directory; prints [exit code, ...].
FORKED = r"""
import json, os, sys, traceback
cases = json.loads(sys.stdin.read())
from launcher.app import main
codes = []
for argv, cwd in cases:
    pid = os.fork()
    if pid == 0:
        out = os.open(os.path.join(cwd, "..", "out"), os.O_WRONLY | os.O_CREAT)
        err = os.open(os.path.join(cwd, "..", "err"), os.O_WRONLY | os.O_CREAT)
        os.dup2(out, 1), os.dup2(err, 2), os.chdir(cwd)
        sys.argv = ["pdecomp", *argv]
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def forked(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case of CASES refused (or not) as `main` ran it, by id; each case's directory."""
    root = tmp_path_factory.mktemp("cases")
    for i, _, _ in CASES:
        (root / i / "cwd").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", FORKED], check=True, env=env, text=True,
                          capture_output=True, timeout=900, input=json.dumps(
                              [[a, str(root / i / "cwd")] for i, a, _ in CASES]))
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return {i: subprocess.CompletedProcess(a, c, (root / i / "out").read_text(),
                                           (root / i / "err").read_text())
            for (i, a, _), c in zip(CASES, codes, strict=True)} | {"": root}


@pytest.mark.parametrize(("case", "key"), [pytest.param(i, k, id=i) for i, _, k in CASES])
def test_bad_input_exits_2_with_one_line(case: str, key: str | tuple[str, ...], forked) -> None:
    check_refused(forked[case], key, forked[""] / case / "cwd")


@pytest.mark.parametrize("n", ["two", "0", "-1"])
def test_a_bad_cpu_device_count_exits_2_with_one_line(n: str, env: dict[str, str],
                                                      tmp_path: Path) -> None:
    refused([], "PDECOMP_CPU_DEVICES", dict(env, PDECOMP_CPU_DEVICES=n), tmp_path)


def refused(argv: list[str], key: str | tuple[str, ...], env: dict[str, str],
            tmp_path: Path) -> None:
    check_refused(subprocess.run([PDECOMP, *argv], check=False, cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120), key, tmp_path)


def check_refused(proc: subprocess.CompletedProcess[str], key: str | tuple[str, ...],
                  tmp_path: Path) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"want one line on stderr, got:\n{proc.stderr}"
    for text in (key,) if isinstance(key, str) else key:
        assert text in lines[0], f"{text!r} not named in: {lines[0]}"
    assert lines[0].startswith("config error:"), lines[0]
    assert proc.stdout.strip() == "", proc.stdout
    # Refused before Hydra started: no run or sweep directory, nothing at all in the cwd.
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()
    assert list(tmp_path.iterdir()) == []


def test_cases_are_distinct() -> None:
    ids = [c[0] for c in CASES]
    argvs = [tuple(c[1]) for c in CASES]
    assert len(set(ids)) == len(ids) >= 16
    assert len(set(argvs)) == len(argvs)


# -- damaged model directories: refused by the launcher's header check, before Hydra ---------

FIXTURE = Path(__file__).parent / "fixtures" / "llama" / "gqa_llama3"
FIXTURE_SITES = "layers.sites=[layers.1.mlp.gate_proj,layers.1.mlp.up_proj,layers.1.mlp.down_proj]"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
# (id, config.json fields set, or a damage to model.safetensors; texts the line must hold
#  besides the damaged file's path)
MODEL_DAMAGE = [
    ("truncated-weights", "truncated", ("model.safetensors", "truncated")),
    ("garbage-header", "garbage", ("model.safetensors", "header")),
    ("rope-yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     ("config.json", "rope_scaling.rope_type='yarn'", "default, llama3")),
    ("rope-linear", {"rope_scaling": {"type": "linear", "factor": 2.0}},
     ("config.json", "rope_scaling.rope_type='linear'")),
    ("rope-dynamic", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     ("config.json", "rope_parameters.rope_type='dynamic'")),
    ("rope-llama3-missing-field",
     {"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "high_freq_factor"}},
     ("config.json", "rope_scaling.high_freq_factor is missing", "number > 0")),
]


@pytest.mark.parametrize(("damage", "texts"),
                         [pytest.param(d, t, id=i) for i, d, t in MODEL_DAMAGE])
def test_a_damaged_model_directory_exits_2_naming_the_file(
        damage: str | dict, texts: tuple[str, ...], env: dict[str, str], tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model = tmp_path_factory.mktemp("model") / "llama"
    shutil.copytree(FIXTURE, model)
    if isinstance(damage, dict):
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, **damage}))
        named = model / "config.json"
    else:
        named = model / "model.safetensors"
        data = named.read_bytes()
        named.write_bytes(data[:len(data) // 2] if damage == "truncated" else
                          data[:8] + b"\x00garbage" + data[16:])
    refused(["+experiment=llama_tiny_chunkwise", f"model.path={model}", FIXTURE_SITES],
            ("model.path", str(named), *texts), env, tmp_path)


# -- token files: every id and the dtype, checked by the launcher before Hydra ---------------

TOKEN_CASES = [  # (id, how the file is written, data.token_dtype, texts the line must hold)
    ("id-beyond-vocab-past-the-first-million", "late-bad-id", "uint32",
     ("data.path", "token id 512 >= model vocab size 512", "token 1100000")),
    ("uint32-file-read-as-uint16", "uint32-no-sidecar", "uint16",
     ("data.token_dtype", "looks like uint32 ids read as uint16")),
    ("sidecar-says-uint16", "uint16-sidecar", "uint32",
     ("data.token_dtype", "tokens.bin.json", "data.token_dtype=uint16")),
]


@pytest.mark.parametrize(("written", "dtype", "texts"),
                         [pytest.param(w, d, t, id=i) for i, w, d, t in TOKEN_CASES])
def test_a_bad_token_file_exits_2_naming_it(written: str, dtype: str, texts: tuple[str, ...],
                                            env: dict[str, str], tmp_path: Path,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    from pdecomp.targets.data import write_tokens

    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    ids = np.random.default_rng(0).integers(0, 512, size=1_200_000)
    if written == "late-bad-id":
        ids[1_100_000] = 512  # llama_tiny's vocab is 512
        write_tokens(path, ids, "uint32")
    elif written == "uint32-no-sidecar":
        ids.astype("<u4").tofile(path)
    else:
        write_tokens(path, ids, "uint16")
    refused(["+experiment=llama_tiny_chunkwise", "data=tokens", f"data.path={path}",
             f"data.token_dtype={dtype}"], texts, env, tmp_path)


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1])
def test_the_seed_rule_accepts_the_same_seeds_for_every_model_kind(seed: int) -> None:
    """One rule for every kind, at validation: what a toy accepts, a Llama accepts."""
    import dataclasses

    from test_lm import tiny_cfg

    from pdecomp.core.config import ResidMLPConfig, RunConfig
    from pdecomp.plan.validation import validate

    resid = RunConfig(model=ResidMLPConfig(name="resid", n_features=10,
                                        d_hidden=10, d_embed=100),
                      layers=dataclasses.replace(RunConfig().layers,
                                                 sites=["layers.0.mlp_in", "layers.0.mlp_out"]))
    for cfg in (RunConfig(), resid, tiny_cfg()):
        cfg = dataclasses.replace(cfg, seed=seed, model=dataclasses.replace(cfg.model, seed=seed))
        validate(cfg)
