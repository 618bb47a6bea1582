"""A CPU step as its kernels' one-core times packed on its cores: what XLA:CPU's executor
would take if every kernel's work, measured on one core, were spread over all cores with
no cost beyond the data it waits for (bench/kernel_times.py `--packed`).

Each kernel of the entry computation is a node that waits for the kernels whose results it
reads (through bitcasts, tuples and their elements); a fusion XLA split into
`outer_dimension_partitions` parts is as many tasks, a kernel with matmul FLOPs one task per
core, any other kernel one task; each task is its kernel's one-core time over its tasks,
plus `hop_s`. Tasks start in the entry's order as they become ready, on the first core
free. The kernels of nested computations (loop bodies, calls) are added after, packed
perfectly (their one-core sum over the cores).
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict, deque

from pdecomp.gate import step_cost

_ALIASES = {"bitcast", "get-tuple-element", "tuple"}


def _nodes(text: str, cores: int) -> tuple[list[str], dict[str, set[str]], dict[str, int]]:
    """The entry's kernels in order, the kernels each waits for, and each one's tasks."""
    computations, entry = step_cost.parse(text)
    shapes = {i.name: i.shape for c in computations.values() for i in c}
    source: dict[str, set[str]] = {}  # a free instruction's kernels behind it
    order, waits, tasks = [], {}, {}
    for ins in computations[entry]:
        behind = set().union(*(source.get(o.split("#")[0], {o.split("#")[0]})
                               for o in ins.operands)) if ins.operands else set()
        if ins.op in _ALIASES:
            source[ins.name] = behind
        elif ins.op in step_cost.FREE and ins.op not in ("while", "call", "conditional"):
            source[ins.name] = set()
        else:
            order.append(ins.name)
            waits[ins.name] = behind
            part = re.search(r'outer_dimension_partitions":\["(\d+)"', ins.attrs)
            tasks[ins.name] = (int(part.group(1)) if part else
                               cores if step_cost.dot_flops(ins, shapes) else 1)
    known = set(order)
    return order, {n: w & known for n, w in waits.items()}, tasks


def packed_s(text: str, one_core: dict[str, float], cores: int, hop_s: float = 0.0) -> float:
    """Seconds of one step of module `text` whose kernels take `one_core` seconds each (a
    step's, on one core) packed on `cores` cores."""
    order, waits, tasks = _nodes(text, cores)
    users = defaultdict(list)
    for n in order:
        for w in waits[n]:
            users[w].append(n)
    pending = {n: len(waits[n]) for n in order}
    left = dict(tasks)
    queue = deque((n, one_core.get(n, 0.0) / tasks[n] + hop_s)
                  for n in order if not pending[n] for _ in range(tasks[n]))
    running: list[tuple[float, int, str]] = []
    now, free, seq = 0.0, cores, 0
    rank = {n: i for i, n in enumerate(order)}
    while queue or running:
        while free and queue:
            name, s = queue.popleft()
            free -= 1
            seq += 1
            heapq.heappush(running, (now + s, seq, name))
        now, _, name = heapq.heappop(running)
        free += 1
        left[name] -= 1
        if left[name]:
            continue
        for u in sorted(users[name], key=rank.__getitem__):
            pending[u] -= 1
            if not pending[u]:
                queue.extend((u, one_core.get(u, 0.0) / tasks[u] + hop_s)
                             for _ in range(tasks[u]))
    nested = sum(s for n, s in one_core.items() if n not in rank)
    return now + nested / cores
