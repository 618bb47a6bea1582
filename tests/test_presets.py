"""Every named preset composes and passes the config's checks (and every option of every
config group composes over one of them), and the large-model presets
are what their headers say: the sites they name, in three chunks (so the seed preset's
chunk coefficient, 1.5 = 0.5 x 3 chunks, means the same), on the mesh they were sized for.
Composition only: nothing is compiled (their gates' figures are in bench/RESULTS.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher import app
from launcher.api import compose
from pdecomp.core.config import ConfigError
from pdecomp.kinds import site_C

PRESETS = sorted(p.stem for p in (Path(__file__).parents[1] / "launcher" / "conf" /
                                   "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    # gate.only: a preset for a real checkpoint or token file is sized without either
    cfg = compose(["gate.only=true"], preset=preset)
    assert site_C(cfg.model, cfg.layers), preset


def _options() -> list[tuple[str, str]]:
    groups = sorted(p for p in Path(app.CONF_DIR).iterdir() if p.is_dir())
    return [(g.name, o.stem) for g in groups for o in sorted(g.glob("*.yaml"))]


def test_every_option_of_every_group_composes_and_every_preset_validates():
    """An experiment is a whole run and validates as it is; any other option composes and
    validates over the defaults or over one of the experiments (an option for a Llama or a
    residual MLP over theirs; the 8B model's groups over the 8B preset's gate, or over its
    model with the Llama groups; the 70B preset likewise). A preset of a real model reads the user's token file:
    without one it validates as a gate-only run (its shapes need no data)."""
    gpu_gate = ["gate.only=true", "gate.target=b200"]
    real_model = ["gate.only=true"]  # the smollm2_* presets
    experiments = [[f"+experiment={o}", *(gpu_gate if re.search(r"\d+b_", o)
                                          else real_model if o.startswith("smollm2_") else [])]
                   for g, o in _options() if g == "experiment"]
    bases = [[], *experiments,
             ["model=llama3_8b", "loss=llama", "optim=llama", "data=tokens", *gpu_gate]]
    composed = []
    with app.conf_dir():
        for base in experiments:
            app.compose_run(base)
            composed.append(base[0])
        for group, option in _options():
            if group == "experiment":
                continue
            errors = []
            for base in bases:
                try:
                    app.compose_run([*base, f"{group}={option}"])
                    break
                except ConfigError as e:  # an option for another model kind
                    errors.append(str(e))
            else:
                raise AssertionError(f"{group}={option} fits no preset: {errors}")
            composed.append(f"{group}={option}")
    assert len(composed) >= 30, composed


# preset -> (its MLP layers, the mesh its header sizes it for)
LARGE = {"llama8b_all_mlp": (range(32), "fsdp8x8"),
         "llama70b_l27-44": (range(27, 45), "fsdp8x8"),
         "llama70b_l20-49": (range(20, 50), "fsdp16x8")}


@pytest.mark.parametrize("preset", sorted(LARGE))
def test_large_presets_name_their_layers_in_three_chunks(preset):
    layers, mesh = LARGE[preset]
    cfg = compose(["gate.only=true", "gate.target=b200", f"mesh={mesh}",
                   "data.seq_len=2048", "data.batch_size=256"], preset=preset)
    expected = [f"layers.{i}.mlp.{w}" for i in layers
                for w in ("gate_proj", "up_proj", "down_proj")]
    assert list(site_C(cfg.model, cfg.layers)) == expected
    chunkwise = cfg.loss.recon["chunkwise"]
    assert chunkwise.sites_per_chunk * 3 == len(expected) and chunkwise.coeff == 1.5
    assert set(site_C(cfg.model, cfg.layers).values()) == {49152}
