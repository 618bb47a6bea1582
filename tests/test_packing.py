"""bench/packing.py: a step's kernels' one-core seconds packed on its cores by the kernels
each one reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "packing", Path(__file__).parents[1] / "bench" / "packing.py")
packing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(packing)

# Two kernels on the parameter, a third reading both through a tuple and a bitcast, and a
# last one XLA split in two, reading the third.
MODULE = """HloModule m, is_scheduled=true

%body (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0} negate(%p)
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %a = f32[1024]{0} fusion(%x), kind=kLoop, calls=%body
  %b = f32[1024]{0} fusion(%x), kind=kLoop, calls=%body
  %t = (f32[1024]{0}, f32[1024]{0}) tuple(%a, %b)
  %e = f32[1024]{0} get-tuple-element(%t), index=1
  %v = f32[1024]{0} bitcast(%a)
  %c = f32[1024]{0} fusion(%v, %e), kind=kLoop, calls=%body
  ROOT %d = f32[1024]{0} fusion(%c), kind=kLoop, calls=%body, backend_config={"outer_dimension_partitions":["2"]}
}
"""
TIMES = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}


@pytest.mark.parametrize("cores, seconds", [(1, 5.0), (2, 3.0), (4, 3.0)])
def test_independent_kernels_share_the_cores_and_a_split_one_spreads(cores, seconds):
    """a and b side by side on two cores, c after both, d's two halves side by side: 1 + 1
    + 1; on one core the sum; more cores than tasks gain nothing."""
    assert packing.packed_s(MODULE, TIMES, cores) == pytest.approx(seconds)


def test_a_kernel_waits_for_what_it_reads_through_tuples_and_bitcasts():
    """c reads b only through the tuple's element: were that edge lost, c would start
    beside b, and a slow b would not delay it."""
    slow_b = {**TIMES, "b": 3.0}
    assert packing.packed_s(MODULE, slow_b, 2) == pytest.approx(3.0 + 1.0 + 1.0)


def test_each_task_pays_its_hop():
    """On two cores the longest path is a (beside b), c, then a half of d (beside the
    other): three tasks, three hops."""
    assert packing.packed_s(MODULE, TIMES, 2, hop_s=0.5) == pytest.approx(3.0 + 3 * 0.5)
