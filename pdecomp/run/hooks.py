"""What a front end plugs into a run: where its lines go, the metrics and the gate's report
as they come, progress, when to stop, and the process-wide switches that are its to ask for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdecomp.gate.report import GateReport


@dataclass
class Hooks:
    """Callbacks a front end supplies; all optional."""

    log: Callable[[str], None] = print
    on_metrics: Callable[[int, dict[str, float]], None] | None = None
    on_gate: Callable[[GateReport], None] | None = None  # pdecomp.gate.report
    progress: Callable[[int, int, dict[str, float]], None] | None = None
    # Asked every `logging.stop_check_every` steps; True on any process stops every process
    # at that step, with a checkpoint (raises Interrupted).
    should_stop: Callable[[], bool] | None = None
    # The front end ends the process with xla_dump.end_process after a gate-only run, so a
    # deviceless gate may report from XLA's buffer assignment and leave code generation
    # running (gate.compile_and_report, detach).
    detach_gate: bool = False
    # Called once the frozen target is loaded (the launcher's host switch goes there).
    on_target_loaded: Callable[[], None] | None = None
    # The front end's host switches keep a CPU step's temporaries from one step to the next
    # (launcher/host.py), so the gate's forecast counts no first-touched memory for them.
    temporaries_reused: bool = False
    # Process-wide likewise: orbax's tracebacks for a checkpoint failure that the run
    # reports itself are dropped (Checkpointer's `quiet`).
    quiet_checkpoint_failures: bool = False
