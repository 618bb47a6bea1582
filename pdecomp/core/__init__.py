"""The floor everything stands on: the run's schema (`config`), units, exit codes, files
written whole (`storage`), the processes of a job, the hardware table, meshes and
shardings, and the shared numerics (Threefry bits, transformer blocks). Imports nothing
else of pdecomp."""
