"""Every named preset composes and passes the config's checks, and the large-model presets
are what their headers say: the sites they name, in three chunks (so the seed preset's
chunk coefficient, 1.5 = 0.5 x 3 chunks, means the same), on the mesh they were sized for.
Composition only: nothing is compiled (their gates' figures are in bench/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.api import compose
from pdecomp.kinds import site_C

PRESETS = sorted(p.stem for p in (Path(__file__).parents[1] / "launcher" / "conf" /
                                   "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    # gate.only: a preset for a real checkpoint or token file is sized without either
    cfg = compose(["gate.only=true"], preset=preset)
    assert site_C(cfg.model, cfg.layers), preset


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
