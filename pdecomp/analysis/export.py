"""A decomposition's components alone, readable without pdecomp: `pdecomp export <run_dir>`.

From the run's last checkpoint (the components and the CI function only, as an analysis
restores them), into `<run_dir>/export/` (or `-o DIR`):

- `components.safetensors`: per site `s`, `s.V` [d_in, C] and `s.U` [C, d_out], float32.
  Component c of site s is the rank-one weight V[:, c] ⊗ U[c]; V @ U approximates the
  weight the target applies as y = x @ W (a Hugging Face Linear's `weight` is its
  transpose). A tied site's V, U are its leader's Uᵀ, Vᵀ, written out like any other.
- `ci_fn.safetensors`: the causal-importance function's parameters, each named by its
  place in the function (the pytree path), float32.
- `manifest.json`: what each tensor is and the run it came from (model, sites and C, the CI
  function's kind and sizes, the threshold that makes a component fire, step, commit).

Safetensors and JSON only: `safetensors.numpy.load_file` (or torch's) reads them. The
files are written beside their final place and renamed over it; an earlier export's files
are replaced, and nothing else in its directory is touched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from pdecomp.core import storage
from pdecomp.run.load import LoadedRun

PROG = "pdecomp export"
OUT_DIR = "export"
FORMAT = "pdecomp-components/1"


def component_tensors(loaded: LoadedRun) -> dict[str, np.ndarray]:
    """`<site>.V` and `<site>.U` of every site, float32."""
    out = {}
    for s, c in loaded.components.sites.items():
        out[f"{s}.V"] = np.asarray(c.V, np.float32)
        out[f"{s}.U"] = np.asarray(c.U, np.float32)
    return out


def ci_fn_tensors(ci_fn: Any) -> dict[str, np.ndarray]:
    """The CI function's arrays by pytree path (`sites['layers.0.mlp.up_proj'].weights[0]`).
    The global transformer's input projection and logit heads, which the state stacks by
    group, as each site's in the site order (`global_net.sites`): `global_net.w_in` every
    site's rows one after another, `global_net.w_out[i]` and `b_out[i]` site i's head."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(ci_fn, eqx.is_array))
    out = {jax.tree_util.keystr(path).lstrip("."): np.asarray(v, np.float32)
           for path, v in leaves}
    net = ci_fn.global_net
    if net is None:
        return out
    out = {k: v for k, v in out.items()
           if not k.startswith(("global_net.w_in[", "global_net.w_out[", "global_net.b_out["))}
    per_site = net.per_site()
    out["global_net.w_in"] = np.asarray(per_site["w_in"], np.float32)
    for part in ("w_out", "b_out"):
        out |= {f"global_net.{part}[{i}]": np.asarray(v, np.float32)
                for i, v in enumerate(per_site[part])}
    return out


def manifest(loaded: LoadedRun, ci: dict[str, np.ndarray]) -> dict[str, Any]:
    run = loaded.run
    tied = dict(run.tied)
    sites = {s: {"C": int(c.V.shape[1]), "d_in": int(c.V.shape[0]),
                 "d_out": int(c.U.shape[1]), "V": f"{s}.V", "U": f"{s}.U",
                 "tied_to": tied.get(s)}
             for s, c in loaded.components.sites.items()}
    written = storage.read_json(loaded.run_dir / "run.json") or {}
    return {
        "format": FORMAT, "run_dir": str(loaded.run_dir), "step": loaded.step,
        "provenance": written.get("provenance"),
        "model": {"kind": run.config.model.kind, "name": run.config.name,
                  "path": getattr(run.config.model, "path", None) or None},
        "weight": "W ≈ V @ U, [d_in, d_out], applied as y = x @ W",
        "sites": sites,
        "ci_fn": {"kind": run.config.layers.ci_fn, "hidden": list(run.config.layers.ci_hidden),
                  "tensors": {k: list(v.shape) for k, v in ci.items()},
                  "fires_above": run.config.loss.ci_threshold,
                  "semantics": "docs/method.md: CI = clamp(logits, 0, 1) per component"},
        "delta": run.config.layers.delta,
    }


FILES = ("components.safetensors", "ci_fn.safetensors", "manifest.json")


def output_problem(out: Path) -> str | None:
    """Why `out` cannot take an export, or None: it must be new, empty, or an export (its
    manifest of this format); an export's own files are replaced, nothing else in it."""
    if why := storage.unwritable(out):
        return why
    if not out.exists():
        return None
    if not out.is_dir():
        return "exists and is not a directory"
    names = {p.name for p in out.iterdir()}
    if not names:
        return None
    try:
        ours = json.loads((out / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    return None if ours else "exists and is not an export"


def write(loaded: LoadedRun, final: Path) -> Path:
    """The three files written beside their place, then each renamed over its own: a
    failure leaves the previous export (or none) and no partial file, and whatever else
    the directory holds stays as it was."""
    from safetensors.numpy import save_file

    def files(tmp: Path) -> None:
        ci = ci_fn_tensors(loaded.ci_fn)
        save_file(component_tensors(loaded), str(tmp / "components.safetensors"))
        save_file(ci, str(tmp / "ci_fn.safetensors"))
        (tmp / "manifest.json").write_text(json.dumps(manifest(loaded, ci), indent=1))

    if not final.exists():
        storage.write_dir(final, files)
        return final
    storage.replace_files(final, FILES, files)
    return final
