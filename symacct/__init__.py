"""symacct: symbolic resource accounting for PyTorch training steps.

``symacct.derive(model)`` traces one training step on fake tensors and
returns an :class:`Accounting` whose FLOP, byte and parameter counts are
sympy formulas in the model's own dimensions.

The names below load their module on first use (PEP 562), so that importing
one stage of the pipeline (``symacct.trace.record``, ``symacct.cost.graph``, ...) loads
no stage above it (``tests/test_layers.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from symacct.accounting import Accounting
    from symacct.cost.fx import annotate
    from symacct.errors import SymacctError
    from symacct.measure.track import track
    from symacct.pipeline import derive
    from symacct.time.model import estimate, fit, max_params, mfu, roofline

_WHERE = {
    "Accounting": "symacct.accounting",
    "annotate": "symacct.cost.fx",
    "SymacctError": "symacct.errors",
    "derive": "symacct.pipeline",
    "estimate": "symacct.time.model",
    "fit": "symacct.time.model",
    "max_params": "symacct.time.model",
    "mfu": "symacct.time.model",
    "roofline": "symacct.time.model",
    "track": "symacct.measure.track",
}

__all__ = [
    "Accounting",
    "SymacctError",
    "annotate",
    "derive",
    "estimate",
    "fit",
    "max_params",
    "mfu",
    "roofline",
    "track",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'symacct' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
