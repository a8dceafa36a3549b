"""The FLOPs PyTorch counts for one op, from shapes: ``torch.utils.flop_counter``'s registry (what
``FlopCounterMode`` counts: matmuls, convolutions, the SDPA kernels it knows), and the CPU flash-attention
kernel and its backward, which ``FlopCounterMode`` leaves out, by flop_counter's own SDPA formulas (the
backward's five products include the recomputed scores).

Tensors or shapes (``torch.Size``) alike: the trace counts an op of the user's model as it runs it, and
the sameness check an op of the probe's at other sizes, from shapes alone (``symacct.sameness``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _shape(x: Any) -> Any:
    return x.shape if isinstance(x, torch.Tensor) else x


def counts_flops(op: Any) -> bool:
    """Whether PyTorch counts FLOPs for ``op`` (``counted_flops`` gives a number for it)."""
    return op in (FLASH_CPU, FLASH_CPU_BACKWARD) or getattr(op, "overloadpacket", None) in flop_registry


def counted_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int | None:
    """The FLOPs of ``func(*args, **kwargs)`` returning ``out`` as flop_counter counts them (tensors or their
    shapes in place of them); None for an op it does not count."""
    if func is FLASH_CPU:
        q, k, v = args[:3]
        return int(sdpa_flop_count(_shape(q), _shape(k), _shape(v)))
    if func is FLASH_CPU_BACKWARD:
        grad_out, q, k, v = args[:4]
        return int(sdpa_backward_flop_count(_shape(grad_out), _shape(q), _shape(k), _shape(v)))
    count = flop_registry.get(getattr(func, "overloadpacket", None))
    return None if count is None else int(count(*args, **kwargs, out_val=out))
