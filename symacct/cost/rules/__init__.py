"""Per-op cost rules; importing this package registers all of them."""

from symacct.cost.rules import attention, collectives, matmul, memory_ops, optimizer, pointwise, reductions
from symacct.cost.rules.registry import Call, Cost, default_bytes, lookup, registered_ops, rule

__all__ = [
    "Call",
    "Cost",
    "attention",
    "collectives",
    "default_bytes",
    "lookup",
    "matmul",
    "memory_ops",
    "optimizer",
    "pointwise",
    "reductions",
    "registered_ops",
    "rule",
]
