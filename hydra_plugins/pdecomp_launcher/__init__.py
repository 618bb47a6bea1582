"""pdecomp's Hydra launcher plugins. Hydra accepts launchers only from the `hydra_plugins`
namespace, so the SLURM launcher lives here rather than in `launcher/`."""
