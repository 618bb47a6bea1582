"""`pdecomp`: the Hydra app. Compose, validate, dispatch; the job itself is in launcher.job.

Every override (and every value of a `-m` sweep) is composed and validated before Hydra
starts, so a bad value ends with one line and exit code 2, leaving no run directory behind.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import re
import shutil
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher import analysis_job, callbacks, cluster, resume
from launcher.registry import register, to_run_config
from pdecomp.core import hardware
from pdecomp.core.config import ConfigError, RunConfig
from pdecomp.core.exits import EXIT_BAD_CONFIG, EXIT_FAULT, Refused
from pdecomp.core.storage import WriteFailed, storage_error, unwritable
from pdecomp.plan.resolve import with_microbatch_size
from pdecomp.plan.validation import validate

# Inside the package, so an installed wheel carries the configs (package data).
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
MAX_CHECKED_COMBOS = 512

# Hydra flags that take a value, and flags after which nothing is composed or run.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp",
                     "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--version",
               "--shell-completion", "-sc"}

register()


def _overrides(argv: list[str]) -> list[str] | None:
    """The overrides in argv, or None when argv asks for help/info only."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _INFO_FLAGS:
            return None
        if a in _FLAGS_WITH_VALUE:
            skip = True
            continue
        if a.startswith("-"):
            continue
        out.append(a)
    return out


_MISSING_OPTION = re.compile(r"Could not find '([^']+)/([^']+)'")


def _one_line(e: Exception) -> str:
    """Hydra/OmegaConf errors span several lines; keep the informative ones, on one line."""
    text = str(e)
    missing = _MISSING_OPTION.search(text)
    if missing:  # an unknown group option: name the group and list what exists
        group, name = missing.groups()
        options = sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
        return (f"config error: {group.replace('/', '.')}={name} is not an option; "
                f"available: {', '.join(options)}")
    parts: list[str] = []
    full_key = None
    for exc in (e, e.__cause__):
        if exc is None:
            continue
        for line in str(exc).splitlines():
            line = line.strip()
            if line.startswith("full_key:"):
                full_key = line.split(":", 1)[1].strip()
            elif line and not line.startswith(("object_type", "reference_type", "To append",
                                                "msg:")) and line not in parts:
                parts.append(line.rstrip("."))
    head = f"config error: {full_key}: " if full_key else "config error: "
    return head + "; ".join(parts)


def parse_overrides(overrides: list[str]) -> list[Override]:
    """Hydra's parse of each override line, one at a time so a syntax error names its key."""
    parser, parsed = OverridesParser.create(), []
    for line in overrides:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as e:
            key, _, value = line.partition("=")
            why = "; ".join(x.strip() for x in str(e).splitlines()
                            if x.strip() and not x.startswith("See "))
            raise ConfigError(key or line, value, f"bad override syntax: {why}") from None
    return parsed


@contextmanager
def conf_dir() -> Iterator[None]:
    """Hydra initialised on the app's configs (whatever was initialised before is cleared)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


@dataclass(frozen=True)
class Composed:
    """One composed run: its validated config, the `_target_` of the launcher it composes,
    and the directories Hydra will make for it (relative to the working directory; their
    `${now:}` part may come out a second later in the job)."""

    cfg: RunConfig | None  # None: a config printed with values left to give (`???`)
    launcher: str
    run_dir: Path
    sweep_dir: Path


def compose_run(overrides: list[str], validated: bool = True) -> Composed:
    """One run (overrides without sweeps; inside `conf_dir`); its cross-field checks unless
    `validated` is False (a config printed, not run)."""
    composed = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    hc = composed.hydra
    launcher = str(hc.launcher.get("_target_", ""))
    sweeper = str(hc.sweeper.get("_target_", ""))
    dirs = Path(str(hc.run.dir)), Path(str(hc.sweep.dir))
    with open_dict(composed):  # Hydra's node holds job-time interpolations
        del composed["hydra"]
    if missing := sorted(OmegaConf.missing_keys(composed)):  # `???`: the user's to give
        if not validated:  # printed as they are
            return Composed(None, launcher, *dirs)
        raise ConfigError(missing[0], "???", f"a value the config leaves for you to give: "
                          f"add {missing[0]}=... to the command line"
                          + (f" (and {', '.join(missing[1:])})" if missing[1:] else ""))
    # a planned mesh's microbatches now; a local mesh's in the job, which knows its devices
    cfg = with_microbatch_size(to_run_config(composed), None)
    if validated:  # a submitted job's data: headers and sizes here, every id in the job
        validate(cfg, scan_data=launcher.endswith("BasicLauncher"))
        if cfg.logging.objective is None and not sweeper.endswith("BasicSweeper"):
            raise ConfigError("logging.objective", None, (
                f"the sweeper {sweeper.rsplit('.', 1)[-1]} chooses jobs by their results: name "
                "the summary key it optimises, e.g. logging.objective=loss/total"))
    return Composed(cfg, launcher, *dirs)


def error_line(e: Exception) -> str:
    """The one line a compose-time error is reported with."""
    return str(e) if isinstance(e, ConfigError) else _one_line(e)


def _is_searchpath(override: str) -> bool:
    return override.split("=", 1)[0].lstrip("+~") == "hydra.searchpath"


def search_path(overrides: list[str], config_dirs: list[str]) -> list[str]:
    """The override that gives Hydra's compose API the user's config directories
    (`--config-dir DIR`, `hydra.searchpath=[...]`), where the user has any: their presets
    and config group options are then checked as the run will see them. A directory that
    is not there is refused (Hydra would only warn, then not find what was meant)."""
    given = [("--config-dir", d) for d in config_dirs]
    for o in parse_overrides([o for o in overrides if _is_searchpath(o)]):
        value = o.value()
        given += [("hydra.searchpath", str(v))
                  for v in (value if isinstance(value, list) else [value])]
    paths = []
    for key, path in given:
        local = Path(path.removeprefix("file://")).expanduser().absolute()
        if "://" in path and not path.startswith("file://"):
            paths.append(path)  # pkg://: a package's configs
        elif local.is_dir():
            paths.append(f"file://{local}")
        else:
            raise ConfigError(key, path, "no such directory: give a directory of config groups")
    return [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []


def config_dirs(argv: list[str]) -> list[str]:
    """The values of `--config-dir DIR` / `-cd DIR` / `--config-dir=DIR` in argv."""
    dirs = [b for a, b in itertools.pairwise(argv) if a in ("--config-dir", "-cd")]
    return dirs + [a.split("=", 1)[1] for a in argv if a.startswith("--config-dir=")]


def check_overrides(overrides: list[str], validated: bool = True,
                    config_dirs: list[str] = ()) -> Composed:
    """Compose and validate every combination of sweep values (the first MAX_CHECKED_COMBOS);
    the first combination's run. Not `validated`: composed and typed only (a config that is
    printed may leave a required value, such as a preset's data.path, for later)."""
    choices: list[list[str]] = []
    for o in parse_overrides(overrides):
        key = o.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue  # Hydra's own settings: Hydra checks them
        if o.is_interval_sweep():  # a searching sweeper's range: both of its ends checked
            v = o.value()
            cast = int if "int" in v.tags else float
            choices.append([f"{key}={cast(end)}" for end in (v.start, v.end)])
        elif o.is_sweep_override():
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    hydra_lines = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").startswith("hydra")
                   and not _is_searchpath(o)]
    search = search_path(overrides, config_dirs)
    first = None
    with conf_dir():
        for combo in itertools.islice(itertools.product(*choices), MAX_CHECKED_COMBOS):
            # Hydra's own settings too, for the directories they name (never swept here)
            run = compose_run([*combo, *search, *(hydra_lines if first is None else [])],
                              validated)
            first = first or run
    assert first is not None
    return first


def missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    return [p for p in (path, *path.parents) if not (p.exists() or p.is_symlink())]


def remove_if_empty(dirs: list[Path]) -> None:
    """Take back the directories a refused run made (deepest first), unless something else
    was put in them meanwhile."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            pass


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict | float:
    from launcher.job import objective, run_job  # heavy imports (jax, wandb) only in a job

    return objective(cfg.logging.objective, run_job(cfg))


def _hydra_record(overrides: list[str]) -> tuple[Path, dict[str, bytes]] | None:
    """`.hydra/` of an existing `hydra.run.dir` (a resume) and its files as they are now.

    Hydra rewrites them with the new command before the job starts; when the job then
    refuses to resume (exit 2), they are put back, so the run keeps its own record."""
    for line in overrides:
        if line.split("=", 1)[0] == "hydra.run.dir":
            value = OverridesParser.create().parse_overrides([line])[0].value()
            directory = Path(str(value)) / ".hydra"
            if directory.is_dir():
                return directory, {p.name: p.read_bytes() for p in directory.iterdir()
                                   if p.is_file()}
    return None


def _restore(record: tuple[Path, dict[str, bytes]] | None) -> None:
    if record is None or not record[0].parent.is_dir():
        return
    directory, files = record
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)


def version_line() -> str:
    """`pdecomp --version`: the version, the commit of the checkout it runs from, and the
    versions that make its figures (jax's above all)."""
    from pdecomp.plan.resolve import provenance

    p = provenance()
    return (f"pdecomp {p['pdecomp']} (commit {p['commit'] or 'unknown: not a git checkout'}; "
            f"jax {p['jax']}, Python {p['python']})")


def main() -> None:
    # Ctrl-C outside training (composing, tracing, a gate-only compile) ends the process at
    # once. As an exception it could be swallowed: raised inside a garbage-collection
    # callback (jax has one), it is reported as "ignored" and the process goes on. Training
    # installs its own handler (launcher.cluster.StopSignals: a checkpoint first). The line
    # goes to stderr as it is now: loading the CUDA compile plugin points fd 2 at /dev/null
    # for a moment (pdecomp.core.hardware), and a Ctrl-C then must still say why it stopped.
    signal.signal(signal.SIGINT, functools.partial(cluster.interrupted, stderr_fd=os.dup(2)))
    _main()


# Subcommands of their own, not Hydra jobs: `pdecomp <name> ...` -> its module's `main`.
SUBCOMMANDS = {name: f"launcher.commands.{name}" for name in (
    "analyze", "calibrate", "convert", "export", "label", "prompt", "tokenize", "view")} | {
    "status": "launcher.status"}


def ended_cleanly(prog: str, command: Callable[[], int]) -> int:
    """`command()`'s exit code; what its input or the machine can do wrong ends it in one
    line instead of a traceback: a refused input (a bad flag, a damaged or disagreeing file
    of the run) with exit 2, a fault of the file system (full, read-only, failing) or of the
    network with exit 1. Anything else is a crash, with its traceback."""
    try:
        return command()
    except (Refused, ConfigError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except WriteFailed as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_FAULT
    except Exception as e:
        if (why := storage_error(e)) is None:
            raise
        where = getattr(e, "filename", None)
        print(f"{prog}: {f'{where}: ' if where else ''}{why}", file=sys.stderr)
        return EXIT_FAULT


def _main() -> None:
    if sys.argv[1:2] in (["--version"], ["-V"]):  # pdecomp's, not Hydra's
        print(version_line())
        return
    if sys.argv[1:2] == ["resume"]:  # the run's own command line, in its directory
        sys.argv[1:] = resume.command_line(sys.argv[2:])
    cluster.split_cpu_devices()  # before jax starts, for a run or an analysis alike
    name = sys.argv[1] if sys.argv[1:2] else ""
    if name == "analyze":  # here, or as a job (`cluster=...`)
        sys.exit(ended_cleanly("pdecomp analyze", lambda: analyze(sys.argv[2:])))
    if name in SUBCOMMANDS:
        main = importlib.import_module(SUBCOMMANDS[name]).main
        sys.exit(ended_cleanly(f"pdecomp {name}", lambda: main(sys.argv[2:])))
    hardware.no_gpu_autotuning_without_gpus()
    wait = _pop_flag("--wait")
    overrides = _overrides(sys.argv[1:])
    record, made = None, []
    if overrides is not None:
        # Hydra allows one of these modes; printing the config or Hydra's info runs no job.
        prints = {"--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"} & set(sys.argv)
        try:
            run = check_overrides(overrides, not prints, config_dirs(sys.argv[1:]))
        except Exception as e:  # noqa: BLE001 - ours, Hydra's and OmegaConf's compose-time errors
            print(error_line(e), file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
        if wait and run.launcher.endswith("slurm_launcher.SlurmLauncher"):
            sys.argv.append("hydra.launcher.wait=true")  # hold the terminal to the end
        if not (run.launcher.endswith("BasicLauncher") or prints
                or {"-m", "--multirun"} & set(sys.argv)):
            # Hydra uses its launcher in multirun mode only: a run submitted to a cluster is
            # a sweep of one job.
            sys.argv.insert(1, "--multirun")
        multirun = bool({"-m", "--multirun"} & set(sys.argv))
        key, out_dir = ("hydra.sweep.dir", run.sweep_dir) if multirun else ("hydra.run.dir",
                                                                            run.run_dir)
        prints_only = bool({"--cfg", "-c"} & set(sys.argv))  # Hydra makes no directory
        if not prints_only and (why := unwritable(out_dir)):
            print(f"config error: {key}={out_dir}: {why}; give a directory that can be made "
                  "and written", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
        if not multirun:
            record, made = _hydra_record(overrides), missing_dirs(run.run_dir.parent)
    try:
        _hydra_main()
        code = callbacks.sweep_result["exit_code"]
    except SystemExit as e:  # a refused gate (exit 3) and the like
        code = e.code
    except BaseException:  # the traceback, then the same way out
        if not _compile_in_flight():
            raise
        traceback.print_exc()
        code = 1
    if code == EXIT_BAD_CONFIG:  # refused in the job: the disk as it was before
        _restore(record)
        remove_if_empty(made)
    if _compile_in_flight():  # a gate-only run left XLA's code generation running
        dump = sys.modules["pdecomp.gate.xla_dump"]
        dump.end_process(0 if code is None else code if isinstance(code, int) else 1)
    sys.exit(code)


def launcher_config(overrides: list[str]) -> tuple[str, dict[str, Any]]:
    """(the executor: `slurm`, `local` or `basic`, its `hydra.launcher` keys) that
    `overrides` compose to, from the config groups a run composes from."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        node = compose("config", overrides=overrides, return_hydra_config=True).hydra.launcher
        params = OmegaConf.to_container(node, resolve=False)
    target = str(params.get("_target_", ""))
    kind = ("slurm" if target.endswith("SlurmLauncher") else
            "local" if target.endswith("LocalLauncher") else "basic")
    return kind, params


def analyze(argv: list[str]) -> int:
    """`pdecomp analyze ...`: here, or as a job of the launcher its overrides name
    (`cluster=...`, `hydra.launcher.*`)."""
    own, overrides = analysis_job.launcher_overrides([a for a in argv if a != "--wait"])
    try:
        kind, params = launcher_config(overrides) if overrides else ("basic", {})
    except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's compose-time errors
        print(error_line(e), file=sys.stderr)
        return EXIT_BAD_CONFIG
    return analysis_job.main(own, kind, params, "--wait" in argv)


def _pop_flag(flag: str) -> bool:
    """Whether `flag` (pdecomp's, not Hydra's) was given; it is taken out of sys.argv."""
    given = flag in sys.argv
    sys.argv = [a for a in sys.argv if a != flag]
    return given


def _compile_in_flight() -> bool:
    # Looked up, not imported: only a job that ran has loaded the gate (and JAX with it).
    dump = sys.modules.get("pdecomp.gate.xla_dump")
    return dump is not None and dump.compile_in_flight()


if __name__ == "__main__":
    main()
