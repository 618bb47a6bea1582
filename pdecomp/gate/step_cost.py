"""What one compiled step computes and moves on each device, and the time that takes at a
target's published rates: a roofline read from XLA's optimized, partitioned module.

From the module's text (`compiled.as_text()`, or the `*after_optimizations.txt` of a dump:
a deviceless gate has no executable to ask), each instruction counts as often as it runs:
a while loop's body as many times as its known trip count (XLA records it on the loop; a
scanned layer stack is such a loop), a fusion's body as often as the fusion. Per device:

- **FLOPs**: 2 x multiply-adds of every dot (and cuBLAS call), wherever it sits, and the
  part of them on float32 operands (`f32_flops`: TF32 on the tensor cores, half the rate);
- **HBM bytes**: what each top-level instruction (a fusion, a copy, a collective, a custom
  call) reads and writes, its operands and its result, as XLA's own cost analysis counts
  them (a fusion's intermediates stay on chip);
- **collective bytes** by kind, each sent and received once per device by the usual ring
  algorithms over a group of n: an all-gather sends (n - 1)/n of its result, a
  reduce-scatter (n - 1) of its result (n - 1)/n of its input), an all-reduce twice
  (n - 1)/n of its buffer, an all-to-all (n - 1)/n, a collective-permute its buffer; a
  group within one host goes over NVLink, one across hosts over the network.

The time: compute at the dense bf16 rate (TF32's for float32 operands), HBM at its
bandwidth, each collective at its link's rate; the step takes the largest of the three with
full overlap (`roofline_s`, its `bound` named), the sum of compute and network with none
(`serial_s`).
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

COLLECTIVES = {"all-gather": "all-gather", "all-gather-start": "all-gather",
               "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
               "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
               "ragged-all-to-all": "all-to-all", "collective-permute": "collective-permute",
               "collective-permute-start": "collective-permute"}
# No data of their own moved: names for other buffers, control, or a loop's bookkeeping.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
        "conditional", "after-all", "partition-id", "replica-id", "all-gather-done",
        "all-reduce-done", "collective-permute-done", "async-done", "async-update",
        "copy-done", "send-done", "recv-done", "opt-barrier", "domain", "add-dependency",
        "async-start"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                    r"branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]  # the names of the instructions it reads
    attrs: str  # everything after the operands
    args: str = ""  # the operands as written (a parameter's number)
    root: bool = False


@functools.lru_cache(maxsize=4096)
def elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (a shape that is no tuple: itself)."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or depth == 0:
            out.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [e for e in out if e]


def shape_of(operand: str, shapes: dict[str, str]) -> str:
    """An operand's shape: an instruction's, or an element of its tuple (`%t#3`)."""
    name, *path = operand.split("#")
    shape = shapes.get(name, "")
    for k in path:
        parts = elements(shape)
        shape = parts[int(k)] if int(k) < len(parts) else ""
    return shape


def array_bytes(shape: str) -> int:
    """Bytes of every array in a shape (a tuple's elements summed)."""
    return int(sum(_BYTES.get(t, 1 if t.startswith("f8") else 4) * math.prod(
        int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape)))


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape, what follows it) of an instruction's right-hand side."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 2:]
    return rest, ""


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The module's computations (name -> instructions) and the entry's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = computations.setdefault(m.group(2), [])
            entry = m.group(2) if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            shape, tail = _split_shape(m.group(3))
            op, _, args = tail.partition("(")
            operands, _, attrs = args.partition(")")
            current.append(Instruction(m.group(2), shape, op.strip(),
                                       re.findall(r"%([\w.\-]+(?:#\d+)*)", operands), attrs,
                                       operands, bool(m.group(1))))
    return computations, entry


def multipliers(computations: dict[str, list[Instruction]], entry: str
                ) -> tuple[dict[str, int], set[str]]:
    """How many times each computation runs per step, and those whose instructions stay on
    chip (fusion bodies, reducers): counted for FLOPs, not for HBM traffic."""
    runs: dict[str, int] = defaultdict(int)
    runs[entry] = 1
    inner: set[str] = set()
    order, seen = [entry], {entry}
    for name in order:  # callers before callees: a computation is called from one place
        for ins in computations.get(name, []):
            if ins.op.endswith(("-done", "-update")):  # the same work as its start
                continue
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
            for key, value in _CALLS.findall(ins.attrs):
                for child in re.findall(r"%?([\w.\-]+)", value.strip("{}")):
                    times = int(trip.group(1)) if trip and key in ("body", "condition") else 1
                    runs[child] += runs[name] * times
                    if ins.op == "fusion" or key == "to_apply":
                        inner.add(child)
                    if child not in seen:
                        seen.add(child)
                        order.append(child)
    return dict(runs), inner


def group_members(attrs: str, n_devices: int) -> list[int]:
    """The device ids of one replica group of a collective (all of them where none is
    named), in any of the forms XLA prints."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):
        return [int(i) for i in m.group(1).split(",") if i]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs):
        axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        chosen = set(re.findall(r"'([^']+)'", m.group(2)))
        varied = [n if a in chosen else 1 for a, n in axes]  # the others held at 0
        return sorted(int(np.ravel_multi_index(idx, [n for _, n in axes]))
                      for idx in np.ndindex(*varied))
    if pairs := re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[-1]
                           if "source_target_pairs=" in attrs else ""):
        return sorted({int(i) for pair in pairs for i in pair})  # every device it links
    return list(range(n_devices))


def sent_bytes(kind: str, size: int, n: int) -> float:
    """Bytes one device sends (and receives) in a collective of result `size` over n."""
    share = (n - 1) / n
    return {"all-gather": size * share, "reduce-scatter": size * (n - 1),
            "all-reduce": 2 * size * share, "all-to-all": size * share,
            "collective-permute": size}[kind]


def _result_bytes(ins: Instruction, shapes: dict[str, str]) -> int:
    """A collective's result: for an async start, its destination buffer (the start's
    tuple is (operands, results, ...))."""
    if ins.op.endswith("-start") and ins.op != "all-reduce-start" and ins.shape.startswith("("):
        parts = elements(ins.shape)
        return array_bytes(parts[1] if len(parts) > 1 else parts[0])
    return array_bytes(ins.shape)


def dot_flops(ins: Instruction, shapes: dict[str, str]) -> int:
    """2 x multiply-adds of a dot or a cuBLAS matmul call (0 for anything else)."""
    if ins.op == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    elif ins.op == "custom-call" and ("matmul" in ins.attrs or "gemm" in ins.attrs):
        dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    else:
        return 0
    lhs_shape = shape_of(ins.operands[0], shapes) if ins.operands else ""
    if not dims or not lhs_shape:
        return 0
    lhs = [int(d) for d in (_ARRAY.findall(lhs_shape) or [("", "")])[0][1].split(",") if d]
    k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", dims.group(1)) if int(d) < len(lhs))
    out = _ARRAY.findall(ins.shape)[0][1]
    return 2 * k * math.prod(int(d) for d in out.split(",") if d)


SLICING = {"dynamic-slice", "slice", "gather"}


def hbm_bytes(ins: Instruction, computations: dict[str, list[Instruction]],
              shapes: dict[str, str]) -> int:
    """What a top-level instruction reads and writes in HBM: its operands and its result,
    but, as XLA counts them, only the part a slice reads of its operand, and only the
    update an in-place dynamic-update-slice writes into its buffer (one layer's weights
    read from the stack of all of them, its gradient written back into one)."""
    if ins.op in SLICING:
        return 2 * array_bytes(ins.shape)
    if ins.op == "dynamic-update-slice":
        return 2 * array_bytes(shape_of(ins.operands[1], shapes))
    called = re.search(r"calls=%([\w.\-]+)", ins.attrs) if ins.op == "fusion" else None
    body = {i.name: i for i in computations.get(called.group(1), [])} if called else {}

    def origin(name: str) -> str:  # through bitcasts, which move nothing
        while name in body and body[name].op == "bitcast":
            name = body[name].operands[0]
        return name

    params = {i.name: int(i.args) for i in body.values()
              if i.op == "parameter" and i.args.isdigit()}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for i in body.values():
        for o in i.operands if i.op != "bitcast" else ():
            users[origin(o)].append(i)
    root = next((i for i in body.values() if i.root), None)
    outputs = ([body.get(origin(o)) for o in root.operands] if root and root.op == "tuple"
               else [body.get(origin(root.name))] if root else [])
    written, in_place = 0, set()
    for out, shape in zip(outputs, elements(ins.shape)) if outputs else ():
        if out and out.op == "dynamic-update-slice" and origin(out.operands[0]) in params:
            in_place.add(params[origin(out.operands[0])])  # written in place, not copied
            written += array_bytes(body[out.operands[1]].shape if out.operands[1] in body
                                   else "")
        else:
            written += array_bytes(shape)
    if not outputs:
        written = array_bytes(ins.shape)
    by_number = {k: n for n, k in params.items()}
    read = 0
    for k, o in enumerate(ins.operands):
        uses = users.get(by_number.get(k, ""), [])
        if k in in_place:
            continue
        read += (sum(array_bytes(u.shape) for u in uses)
                 if uses and all(u.op in SLICING for u in uses) else
                 array_bytes(shape_of(o, shapes)))
    return written + read


def _crosses_hosts(ins: Instruction, members: list[int], per_host: int) -> bool:
    if ins.op.startswith("collective-permute"):
        pairs = re.findall(r"\{(\d+),(\d+)\}", ins.attrs.split("source_target_pairs=")[-1])
        return any(int(a) // per_host != int(b) // per_host for a, b in pairs)
    return len({m // per_host for m in members}) > 1


# Body instructions that name or move data without computing on it.
NO_OPS = FREE | {"broadcast", "reshape", "slice", "dynamic-slice", "transpose", "copy",
                 "concatenate", "pad", "reverse", "gather", "dynamic-update-slice", "scatter",
                 "dot", "fusion", "custom-call", "iota"}
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                  "logistic", "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan",
                  "atan2", "erf", "erf-inv"}
_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


@dataclass(frozen=True)
class Kernel:
    """One top-level instruction that does work (a fusion, a dot, a copy, a collective, a
    custom call), per device, per run."""

    name: str
    runs: int  # times per step
    flops: int  # matmul FLOPs
    f32_flops: int  # the part of them on float32 operands
    dtype: str  # its matmul operands' ("float32", "bfloat16", ...; "" without a matmul)
    ops: int  # cheap elementwise operations (elements x operations)
    transcendentals: int
    bytes: int  # memory read and written
    collective: str = ""  # its kind, for a collective over two devices or more
    sent_bytes: float = 0.0  # one device's share
    link: str = ""  # "nvlink" within a host, "network" across
    # the transcendentals by op (("power", n), ...): a power costs several tanh
    transcendental_ops: tuple[tuple[str, int], ...] = ()
    dots: tuple[tuple[str, int], ...] = ()  # each dot's signature and FLOPs


def element_count(shape: str) -> int:
    """Elements of every array in a shape (a tuple's summed)."""
    return sum(math.prod(int(n) for n in dims.split(",") if n)
               for _, dims in _ARRAY.findall(shape))


@dataclass
class _Work:
    """What a kernel's instructions compute, summed while they are read."""

    flops: int = 0
    f32_flops: int = 0
    dtype: str = ""
    ops: int = 0
    transcendentals: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dots: list[tuple[str, int]] = field(default_factory=list)


def dot_signature(ins: Instruction, shapes: dict[str, str]) -> str:
    """A dot as `pdecomp.gate.microbench.dot_seconds` rebuilds it: its operands' and
    result's types and shapes, layouts dropped, and its contracting and batch dimensions
    (`lhs;rhs;result;lhs_contracting;rhs_contracting;lhs_batch;rhs_batch`)."""

    def array(shape: str) -> str:
        t, dims = (_ARRAY.findall(shape) or [("", "")])[0]
        return f"{t}[{dims}]"

    def dims(key: str) -> str:
        m = re.search(key + r"=\{([\d,]*)\}", ins.attrs)
        return m.group(1) if m else ""

    return ";".join([array(shape_of(ins.operands[0], shapes)),
                     array(shape_of(ins.operands[1], shapes)), array(ins.shape),
                     *(dims(f"{side}_{kind}_dims") for kind in ("contracting", "batch")
                       for side in ("lhs", "rhs"))])


# Body ops that read every element of their operands whatever they are asked for.
_WHOLE = {"dot", "custom-call", "fusion", "scatter", "sort"}


def demanded(body: list[Instruction], shapes: dict[str, str]) -> dict[str, float]:
    """Of each instruction of a fusion's body, the share of its elements the fusion computes:
    a loop fusion computes each element of its result from just the elements of its
    operands that one needs (XLA's elemental emitter), so ops before a slice run on the
    slice's window only (TMS 40-10's backward splits one
    [4096, 200] expression into twenty fusions of [4096, 10], each computing a twentieth).
    A reduce needs its operand's whole rows, a dot or a custom call all of them. Users that
    read a value element for element ask it for the same elements, the most any of them
    asks (a value read by three ops, each on one window, is computed once on it: threefry's
    rounds reread each value); slices ask for windows of their own, added up, to its size
    at most (two windows may not overlap)."""
    size = {i.name: max(element_count(i.shape), 1) for i in body}
    same: dict[str, float] = defaultdict(float)  # the most any element-for-element user asks
    windows: dict[str, float] = defaultdict(float)  # what slicing users ask, summed
    root = next((i for i in body if i.root), body[-1] if body else None)
    for ins in reversed(body):  # users after what they read: each is asked before it asks
        own = (size[ins.name] if ins is root or ins.op in _WHOLE else
               min(max(same[ins.name], windows[ins.name]), size[ins.name]))
        same[ins.name] = own
        for name in (o.split("#")[0] for o in ins.operands if o.split("#")[0] in size):
            if ins.op in _WHOLE:
                same[name] = size[name]
            elif ins.op in ("reduce", "reduce-window"):
                same[name] = max(same[name], own * size[name] / size[ins.name])
            elif ins.op in SLICING:
                windows[name] += own
            else:  # elementwise, or a broadcast's source (capped when it asks in turn)
                same[name] = max(same[name], own)
    return {n: same[n] / size[n] for n in size}


def _compute(body: list[Instruction], computations: dict[str, list[Instruction]],
             shapes: dict[str, str], work: _Work, share: float = 1.0) -> _Work:
    """Adds what a kernel's instructions compute, a fusion nested in them included, to
    `work`: matmul FLOPs (their float32 part, their operands' dtype, each dot's signature),
    cheap ops, transcendentals by op; each op at the share of its elements the kernel
    computes (`demanded`, in a fusion's body; `share` of them in a nested one)."""
    parts = demanded(body, shapes)
    for i in body:
        part = share * parts.get(i.name, 1.0)
        if f := dot_flops(i, shapes):
            t = shape_of(i.operands[0], shapes).split("[")[0]
            work.flops, work.dtype = work.flops + f, _DTYPES.get(t, t)
            work.f32_flops += f if t == "f32" else 0
            if i.op == "dot" and len(i.operands) == 2:
                work.dots.append((dot_signature(i, shapes), f))
        elif i.op == "fusion" and (called := re.search(r"calls=%([\w.\-]+)", i.attrs)):
            _compute(computations.get(called.group(1), []), computations, shapes, work, part)
        elif i.op in ("reduce", "reduce-window"):
            work.ops += round(part * element_count(shape_of(i.operands[0], shapes))
                              if i.operands else 0)
        elif i.op in TRANSCENDENTAL:
            work.transcendentals[i.op] += round(part * element_count(i.shape))
        elif i.op not in NO_OPS:
            work.ops += round(part * element_count(i.shape))
    return work


def kernels(text: str, n_devices: int, hosts: int = 1) -> list[Kernel]:
    """Every kernel of one step of the module `text`, per device: a computation's
    instructions as often as it runs, a fusion's body inside its fusion's kernel."""
    computations, entry = parse(text)
    runs, inner = multipliers(computations, entry)
    shapes = {i.name: i.shape for c in computations.values() for i in c}
    per_host = max(n_devices // max(hosts, 1), 1)
    out = []
    for name, instructions in computations.items():
        times = runs.get(name, 0)
        for ins in instructions if times and name not in inner else ():
            if ins.op in FREE:
                continue
            w = _compute([ins], computations, shapes, _Work())
            kind, sent, link = COLLECTIVES.get(ins.op, ""), 0.0, ""
            members = group_members(ins.attrs, n_devices) if kind else []
            if len(members) >= 2:
                sent = sent_bytes(kind, _result_bytes(ins, shapes), len(members))
                link = "network" if _crosses_hosts(ins, members, per_host) else "nvlink"
            out.append(Kernel(ins.name, times, w.flops, w.f32_flops, w.dtype, w.ops,
                              sum(w.transcendentals.values()),
                              hbm_bytes(ins, computations, shapes), kind if link else "",
                              sent, link, tuple(sorted(w.transcendentals.items())),
                              tuple(w.dots)))
    return out


def totals(ks: list[Kernel]) -> dict[str, Any]:
    """gate.json's `step` figures of one step's kernels: `flops` (`f32_flops` of them),
    `hbm_bytes`, and per collective kind its `count`, `bytes` sent (as many received) and
    the part of them that crosses hosts."""
    moved: dict[str, dict[str, float]] = {}
    for k in ks:
        if k.collective:
            row = moved.setdefault(k.collective, {"count": 0, "bytes": 0.0,
                                                  "network_bytes": 0.0})
            row["count"] += k.runs
            row["bytes"] += k.runs * k.sent_bytes
            row["network_bytes"] += k.runs * k.sent_bytes if k.link == "network" else 0.0
    return {"flops": sum(k.runs * k.flops for k in ks),
            "f32_flops": sum(k.runs * k.f32_flops for k in ks),
            "hbm_bytes": sum(k.runs * k.bytes for k in ks),
            "collectives": {kind: {"count": int(v["count"]), "bytes": int(v["bytes"]),
                                   "network_bytes": int(v["network_bytes"])}
                            for kind, v in sorted(moved.items())}}


def measure(text: str, n_devices: int, hosts: int = 1) -> dict[str, Any]:
    """Per device, one step: `totals` of its `kernels`."""
    return totals(kernels(text, n_devices, hosts))


def roofline(cost: dict[str, Any], spec: Any) -> dict[str, Any]:
    """The step's time at `spec`'s published rates (hardware.GpuSpec): compute, HBM and
    network each alone, the largest of them (full overlap) and its name, and compute plus
    network (none)."""
    moved = cost["collectives"].values()
    network = sum(c["network_bytes"] for c in moved)
    nvlink = sum(c["bytes"] for c in moved) - network
    f32 = cost.get("f32_flops", 0)
    times = {"compute": (cost["flops"] - f32) / spec.bf16_flops + f32 / spec.tf32_flops,
             "hbm": cost["hbm_bytes"] / spec.memory_bandwidth,
             "network": nvlink / spec.nvlink_bandwidth + network / spec.network_bandwidth}
    bound = max(times, key=lambda k: times[k])
    return {"compute_s": times["compute"], "hbm_s": times["hbm"],
            "network_s": times["network"], "roofline_s": times[bound], "bound": bound,
            "serial_s": times["compute"] + times["network"],
            "rates": {"bf16_flops": spec.bf16_flops, "tf32_flops": spec.tf32_flops,
                      "hbm": spec.memory_bandwidth,
                      "nvlink": spec.nvlink_bandwidth, "network": spec.network_bandwidth}}
