"""symacct: symbolic resource accounting for PyTorch training steps.

``symacct.derive(model)`` traces one training step on fake tensors and
returns an :class:`Accounting` whose FLOP, byte and parameter counts are
sympy formulas in the model's own dimensions.
"""

from symacct.accounting import Accounting
from symacct.derive import derive
from symacct.errors import SymacctError
from symacct.timing import estimate, fit, max_params, mfu, roofline
from symacct.track import track

__all__ = ["Accounting", "SymacctError", "derive", "estimate", "fit", "max_params", "mfu", "roofline", "track"]
__version__ = "0.1.0"
