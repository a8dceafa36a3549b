"""The one public exception type of symacct."""

from __future__ import annotations

from collections.abc import Sequence


class SymacctError(Exception):
    """Raised when symacct cannot give a correct number.

    The message names where it happened (node, module path, op, shapes) and
    what the user can do about it, in one paragraph.

    ``internal`` is True when symacct itself failed (a cost rule that
    crashed, an exception it did not expect): a bug to report, as opposed to
    a refusal by design (bad input, data-dependent control flow, an op with
    no rule, a size that is not a product of the model's symbols).

    ``sizes``: the symbols a refusal is about, where it names some (the sizes a
    loop walks): a retry that changes none of them cannot get past it.
    """

    def __init__(
        self,
        what: str,
        *,
        node: str | None = None,
        module: str | None = None,
        op: str | None = None,
        shapes: Sequence[object] | None = None,
        hint: str | None = None,
        internal: bool = False,
        sizes: Sequence[str] = (),
    ) -> None:
        self.what = what
        self.internal = internal
        self.sizes = tuple(sizes)
        self.node = node
        self.module = module
        self.op = op
        self.shapes = shapes
        self.hint = hint
        where = []
        if node is not None:
            where.append(f"node {node}")
        if module is not None:
            where.append(f"module '{module or '<root>'}'")
        if op is not None:
            where.append(f"op {op}")
        if shapes is not None:
            where.append("shapes " + ", ".join(str(s) for s in shapes))
        msg = what
        if where:
            msg += " [" + "; ".join(where) + "]"
        if hint:
            msg += ". " + hint
        super().__init__(msg)

    def restated(self, what: str, hint: str | None, sizes: Sequence[str] = ()) -> SymacctError:
        """Another refusal at the same place (node, module, op, shapes): a cause put in the words of what it
        means for the derivation."""
        return SymacctError(
            what, node=self.node, module=self.module, op=self.op, shapes=self.shapes, hint=hint, sizes=sizes
        )
