"""Mixture-of-experts layers of a derived step: the routed work, and how it splits over the experts.

A router sends each of the B*S tokens to k of E experts; the experts'
grouped matmuls (``aten._grouped_mm``) then multiply the B*S*k (token,
expert) pairs, each by its expert's weights. Which expert a pair goes to is a
value, never a shape: the FLOPs and the saved bytes of the routed experts are
the same for every routing in which no pair is dropped (no capacity limit),
and derive's totals are those. What the routing does change is the split
over the experts, which decides the load of the busiest one (the straggler
under expert parallelism).

Convention: the split is balanced, B*S*k/E pairs per expert (an average, not
always a whole number), unless ``derive(..., routing=shares)`` gives E
shares (any non-negative numbers; normalised to sum to 1), applied to every
expert layer. :meth:`ExpertLayers.per_expert` evaluates the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import networkx as nx
import sympy

from symacct.cost.graph import records
from symacct.errors import SymacctError
from symacct.symbols import evaluate

GROUPED_MM = "aten._grouped_mm"


@dataclass(frozen=True)
class ExpertShare:
    """One expert's part of an expert layer at given sizes: (token, expert) pairs per layer, and FLOPs."""

    expert: int
    pairs: Fraction  # per layer (balanced: the average B*S*k/E)
    flops: Fraction  # matmul FLOPs of its grouped-matmul rows, every layer, forward + backward


@dataclass(frozen=True)
class ExpertLayers:
    """The expert layers at one module path (``model.layers.*.mlp.experts``): what is routed, how it splits."""

    module: str
    experts: int  # E at the model's value
    pairs: sympy.Expr  # (token, expert) pairs of one layer: the rows of its grouped matmuls, B*S*k
    flops: sympy.Expr  # matmul FLOPs of the grouped matmuls, every layer, forward + backward
    shares: tuple[Fraction, ...] | None  # each expert's share of the pairs; None: balanced (1/E each)
    defaults: dict[str, int] = field(default_factory=dict)  # the model's own sizes (all but B and S)

    def per_expert(self, **sizes: int) -> list[ExpertShare]:
        """Each expert's pairs and FLOPs at ``sizes`` (B and S; other symbols default to the model's values)."""
        at = {**self.defaults, **sizes}
        missing = sorted(s.name for s in (self.pairs + self.flops).free_symbols if s.name not in at)
        if missing:
            raise SymacctError(f"per_expert() needs {', '.join(missing)}", hint="e.g. per_expert(B=8, S=2048)")
        pairs, flops = evaluate(self.pairs, at), evaluate(self.flops, at)
        shares = self.shares or tuple(Fraction(1, self.experts) for _ in range(self.experts))
        return [ExpertShare(e, pairs * s, flops * s) for e, s in enumerate(shares)]


def normalised(routing: Sequence[Any]) -> tuple[Fraction, ...]:
    """Shares from any non-negative numbers (token counts, fractions): exact fractions summing to 1."""
    try:
        parts = [Fraction(x) if not isinstance(x, float) else Fraction(x).limit_denominator(10**9) for x in routing]
    except (TypeError, ValueError) as e:
        raise SymacctError(f"routing= must be a sequence of numbers, got {routing!r}", hint="e.g. [4, 1, 1, 2]") from e
    if not parts or any(p < 0 for p in parts) or sum(parts) == 0:
        raise SymacctError(
            f"routing= must be non-negative shares with a positive sum, got {list(routing)!r}",
            hint="one share per expert, e.g. tokens routed to each: [4, 1, 1, 2]",
        )
    total = sum(parts)
    return tuple(p / total for p in parts)


def no_expert_layers() -> SymacctError:
    return SymacctError(
        "routing= was given, but the step has no expert layers (no grouped matmul over routed tokens)",
        hint="drop routing=, or use it with a mixture of experts on transformers' grouped_mm path",
    )


def wrong_share_count(shares: int, module: str, experts: int) -> SymacctError:
    return SymacctError(
        f"routing= gives {shares} shares, but {module} has {experts} experts",
        module=module,
        hint=f"give one share per expert ({experts})",
    )


def expert_layers(graph: nx.DiGraph, values: dict[str, int], routing: Sequence[Any] | None) -> list[ExpertLayers]:
    """The grouped-matmul layers of the graph, one entry per module path (its ``generic`` path), with
    ``routing`` (E shares) checked against each layer's E."""
    found: dict[str, dict[str, Any]] = {}
    for _, a in records(graph):
        if not a.op.startswith(GROUPED_MM) or not a.count:
            continue
        entry = found.setdefault(a.generic, {"flops": sympy.Integer(0), "pairs": None, "experts": None})
        if a.phase in ("forward", "backward"):
            entry["flops"] += a.cost.flops * a.count
        ins = a.in_shapes
        if a.phase == "forward" and len(ins) >= 3 and len(ins[0]) == 2 and len(ins[1]) == 3:
            entry["pairs"], entry["experts"] = ins[0][0], ins[2][0]  # (pairs, K) rows; offsets (E,)
    shares = normalised(routing) if routing is not None else None
    if routing is not None and not found:
        raise no_expert_layers()
    out = []
    for module, e in sorted(found.items()):
        if e["pairs"] is None:
            continue
        experts = evaluate(e["experts"], values)
        if shares is not None and len(shares) != experts:
            raise wrong_share_count(len(shares), module or "<root>", experts)
        out.append(ExpertLayers(module, experts, e["pairs"], sympy.expand(e["flops"]), shares, dict(values)))
    return out


def note(layers: list[ExpertLayers]) -> str:
    """The convention, for acct.notes."""
    paths = ", ".join(x.module for x in layers)
    split = "the shares given by routing=" if layers[0].shares is not None else "balanced (B*S*k/E pairs each)"
    return (
        f"mixture of experts ({paths}): {layers[0].pairs} (token, expert) pairs a layer go through grouped "
        "matmuls whose FLOPs and saved bytes are the same for any routing that drops no token; the split over "
        f"the experts (acct.experts) is {split}"
    )
