"""pdecomp, the library: parameter decomposition (SPD) in JAX, in floors that import only
downward (docs/cli.md, "Layout"): core, spd, targets, kinds, plan, gate, run, analysis.
The front end (Hydra, the subcommands' arguments, wandb) is `launcher/`."""
