"""Bad input on the `pdecomp` command line: exit code 2, one line naming the key, no trace.

Every case runs the real console script in a fresh, empty working directory and checks
that the launcher refused before Hydra made a run (or sweep) directory.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

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
]


@pytest.mark.parametrize(("argv", "key"), [pytest.param(a, k, id=i) for i, a, k in CASES])
def test_bad_input_exits_2_with_one_line(argv: list[str], key: str | tuple[str, ...],
                                         env: dict[str, str], tmp_path: Path) -> None:
    refused(argv, key, env, tmp_path)


@pytest.mark.parametrize("n", ["two", "0", "-1"])
def test_a_bad_cpu_device_count_exits_2_with_one_line(n: str, env: dict[str, str],
                                                      tmp_path: Path) -> None:
    refused([], "PDECOMP_CPU_DEVICES", dict(env, PDECOMP_CPU_DEVICES=n), tmp_path)


def refused(argv: list[str], key: str | tuple[str, ...], env: dict[str, str],
            tmp_path: Path) -> None:
    proc = subprocess.run([PDECOMP, *argv], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
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
