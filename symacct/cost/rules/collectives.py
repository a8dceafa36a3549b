"""Collectives a rank runs (tensor parallelism's, as DTensor issues them): PyTorch's functional
collectives, 0 FLOPs each.

Bytes are the rank's memory traffic, as for any op: it reads its input and writes its output (an
all-gather's output is the whole gathered tensor, a reduce-scatter's the rank's shard); ``wait_tensor``
only waits. What goes over the wire is the parallel pass's business (``symacct.parallel.rank``), not
these bytes. The reduction an all-reduce or a reduce-scatter performs is not counted as FLOPs, as
flop_counter counts none.
"""

from __future__ import annotations

import torch

from symacct.cost.rules.registry import Call, Cost, rule

c10d = torch.ops._c10d_functional


@rule(
    c10d.all_reduce,
    c10d.all_gather_into_tensor,
    c10d.reduce_scatter_tensor,
    c10d.all_to_all_single,
    c10d.broadcast,
)
def collective(call: Call) -> Cost:
    return Cost()


@rule(c10d.all_reduce_, c10d.broadcast_)
def collective_in_place(call: Call) -> Cost:
    """In place: reads and writes its one tensor."""
    return Cost()


@rule(c10d.wait_tensor)
def wait(call: Call) -> Cost:
    """Waits for a collective's result: touches no data."""
    return Cost(bytes_read=0, bytes_written=0)
