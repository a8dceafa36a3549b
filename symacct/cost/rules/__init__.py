"""Per-op cost rules; importing this package registers all of them."""

from symacct.cost.rules import attention, matmul, memory_ops, optimizer, pointwise, reductions
from symacct.cost.rules.registry import Call, Cost, default_bytes, lookup, registered_ops, rule

__all__ = [
    "Call",
    "Cost",
    "attention",
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
