"""The seeds' rules of thumb as claims, each given a verdict by derivation.

Every claim states what a seed says (``../shared/seeds``: 000 is the CS336
lecture-2 article, 003 the memory-accounting article), what symacct derives
on the reference models, and a verdict computed from the two:

- ``holds``: the derived figure is within ``TOL`` (5 %) of the claim, or equal
  where the claim is exact (a formula, a byte count);
- ``holds under stated assumptions``: it holds only in a regime or with a
  convention the claim does not say (the assumption is written next to it);
  the derived figure is within ``LOOSE`` (25 %) at the reference config;
- ``wrong``: further off than that, or the formula has the wrong shape; the
  corrected formula is given.

A worked number the seed calls approximate ("about 20 GB") is judged on its
own arithmetic (does the rule give that number?) and against the derived
figure, with the same tolerances. Nothing here is a typed-in answer: each
derived figure comes from ``symacct.derive`` (or ``torch.finfo`` /
``torch.iinfo`` for the number formats) at the stated config.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import sympy

from symacct.cost.graph import records
from symacct.options import dtype_key

TOL = 0.05
LOOSE = 0.25

HOLDS = "holds"
ASSUMING = "holds under stated assumptions"
WRONG = "wrong"

# the seeds' 1.3B example: hidden 2048, 24 layers (003); GPT-3 XL's 16 heads of 128 (the seed gives no head count)
GPT2_1B3 = {"n_embd": 2048, "n_layer": 24, "n_head": 16}


@dataclass
class Claim:
    id: str
    claim: str
    seed: str  # what the seed says (and which seed)
    derived: str  # what derivation gives, with the config
    verdict: str
    correction: str = ""  # when the verdict is not 'holds': the formula or figure that holds
    details: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)  # the figures the verdict was computed from

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rel(a: float, b: float) -> float:
    """Relative difference |a - b| / |b|."""
    return abs(a - b) / abs(b) if b else math.inf


def judge(derived: float, claimed: float, *, assumption_holds: bool = False) -> str:
    """The verdict rule of the module docstring, on two numbers."""
    r = rel(derived, claimed)
    if r <= TOL:
        return HOLDS
    if r <= LOOSE or assumption_holds:
        return ASSUMING
    return WRONG


# ---- derivations (cached: one trace per config) --------------------------------------------


@functools.cache
def _derive(model: str, overrides: tuple[tuple[str, Any], ...] = (), **kw: Any) -> Any:
    import torch

    from symacct.models.presets import PRESETS
    from symacct.pipeline import derive

    cls, make = PRESETS[model]
    cfg = make()
    for k, v in overrides:
        setattr(cfg, k, v)
    if "fp32_grads" in kw:
        kw["optimizer_options"] = {"fp32_grads": kw.pop("fp32_grads")}
    with torch.device("meta"):
        m = cls(cfg)
    return derive(m, **kw)


def _gpt2(**kw: Any) -> Any:
    over = tuple(sorted(kw.pop("config", {}).items()))
    return _derive("gpt2", over, **kw)


def _dt(name: str | None) -> str:
    return dtype_key(name)


def _e(x: float) -> str:
    return f"{x:.3g}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def _formula(expr: Any) -> str:
    """A formula in the fixed text layout, as inline code (Markdown shows '*' and '**' as written)."""
    from symacct.formula import text

    return f"`{text(expr)}`"


# ---- FLOPs -----------------------------------------------------------------------------------
#
# Each claim function takes the accounting (and sizes) it judges, defaulting to the reference
# model, so that the verdict follows the model: tests pass models where a claim really holds and
# models where it really fails.


def _s2_terms(expr: Any) -> Any:
    """The S^2 terms of a formula (attention scores)."""
    from symacct.symbols import S

    return sympy.expand(expr).coeff(S, 2) * S**2


def _per_token(acct: Any, expr: Any) -> Any:
    from symacct.symbols import B, S

    return sympy.expand(expr / (B * S)) if sympy.expand(expr).has(S) else sympy.expand(expr / B)


def six_nd(acct: Any = None, *, B_: int = 8, S_: int = 1024, label: str = "gpt2 (124M, tied head)") -> Claim:
    """6ND on ``acct`` at (B, S): holds within TOL; under the stated assumption when the terms other than the
    attention scores are within LOOSE of it; else wrong."""
    acct = acct if acct is not None else _gpt2()
    at = acct.at(B=B_, S=S_)
    tokens = B_ * S_
    rule = 6 * at.params * tokens
    ratio = at.flops.total / rule
    scores = _s2_terms(acct.flops.total)
    dense_at = _val(acct, sympy.expand(acct.flops.total - scores), B_, S_)
    scores_at = _val(acct, scores, B_, S_)

    cross = acct.crossover()
    per_token = _per_token(acct, acct.flops.total)
    extra = sympy.expand(per_token - 6 * acct.params)
    details = [
        f"attention-score terms {_formula(scores)} are {_e(scores_at)} FLOPs ({scores_at / at.flops.total:.1%} "
        "of the step)"
    ]
    if cross is not None:
        details.append(
            f"the S^2 terms of one layer equal its other matmul terms at S = {cross:,.0f}; below that 6ND "
            "undercounts by about S/crossover of the layer FLOPs"
        )
    return Claim(
        "6nd",
        "training FLOPs = 6 N D (N parameters, D tokens)",
        "000: forward 2ND + backward 4ND = 6ND; 003: 6 x N x tokens per step",
        f"{label} at B={B_}, S={S_}: {_e(at.flops.total)} matmul FLOPs per step; 6ND = {_e(rule)}; ratio {ratio:.3f}",
        judge(at.flops.total, rule, assumption_holds=rel(dense_at, rule) <= LOOSE),
        f"derived per token: {_formula(per_token)} = 6N + {_formula(extra)}, N = {_formula(acct.params)} "
        "(assumption: the attention-score terms are small, S well below the crossover)",
        details,
        {"flops": at.flops.total, "rule": rule, "ratio": ratio, "dense": dense_at, "crossover": cross},
    )


def six_nd_embeddings(acct: Any = None, *, B_: int = 8, S_: int = 1024, label: str = "gpt2 untied") -> Claim:
    """6ND with N counting the embedding tables (lookups, 0 FLOPs): under the stated assumption when 6ND holds
    with N without them."""
    acct = acct if acct is not None else _gpt2(config={"tie_weights": False})
    at_u = acct.at(B=B_, S=S_)
    tokens = B_ * S_
    rule_u = 6 * at_u.params * tokens
    rule_ne = 6 * (at_u.params - at_u.params_embedding) * tokens
    scores = _s2_terms(acct.flops.total)
    return Claim(
        "6nd-embeddings",
        "6ND with N counting every parameter, embedding tables included",
        "000: N is the parameter count",
        f"{label} at B={B_}, S={S_}: N = {at_u.params:,} of which {at_u.params_embedding:,} in embedding "
        f"tables (0 FLOPs: lookups); derived {_e(at_u.flops.total)} vs 6ND {_e(rule_u)} "
        f"(ratio {at_u.flops.total / rule_u:.3f}); with N without embeddings {_e(rule_ne)} "
        f"(ratio {at_u.flops.total / rule_ne:.3f})",
        judge(at_u.flops.total, rule_u, assumption_holds=rel(at_u.flops.total, rule_ne) <= LOOSE),
        f"count N without the embedding tables ({_formula(acct.params_embedding)}), as Kaplan et al. do"
        + (f"; add the attention-score terms {_formula(scores)}" if scores != 0 else ""),
        numbers={"flops": at_u.flops.total, "rule": rule_u, "rule_no_embedding": rule_ne},
    )


def _module_ratios(acct: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Matmul FLOPs per concrete module path, forward and backward (with multiplicities)."""
    fwd: dict[str, Any] = {}
    bwd: dict[str, Any] = {}
    for _, a in records(acct.graph):
        if a.phase in ("forward", "backward") and a.cost.flops != 0 and a.count != 0:
            target = fwd if a.phase == "forward" else bwd
            target[a.module] = target.get(a.module, 0) + a.cost.flops * a.count
    return fwd, bwd


def _reads_raw_input(acct: Any, module: str) -> bool:
    """Whether a forward matmul of ``module`` reads a step input (through views only): its input needs no grad."""
    g = acct.graph
    for n, a in records(g):
        if a.phase != "forward" or a.module != module or a.cost.flops == 0:
            continue
        stack = list(g.predecessors(n))
        seen = set()
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if str(m).startswith("input:"):
                return True
            b = g.nodes[m]["node"]
            if b.phase == "forward" and b.cost.flops == 0 and b.cost.bytes_read == 0 and b.cost.bytes_written == 0:
                stack.extend(g.predecessors(m))  # a view: look through it
    return False


def first_layer(acct: Any = None, *, B_: int = 8, label: str = "cruncher (L Linear D x D + head)") -> Claim:
    """'backward = 2 x forward for every layer', module by module: holds when every module's matmul backward is
    twice its forward; under the stated assumption (every layer's input needs a gradient) when the modules that
    differ are exactly those whose input is the raw step input and whose backward equals their forward (dL/dW
    only); wrong otherwise."""
    acct = acct if acct is not None else _derive("cruncher")
    fwd, bwd = _module_ratios(acct)
    differ = sorted(m for m in fwd if sympy.expand(bwd.get(m, 0) - 2 * fwd[m]) != 0)
    raw = [m for m in differ if sympy.expand(bwd.get(m, 0) - fwd[m]) == 0 and _reads_raw_input(acct, m)]
    verdict = HOLDS if not differ else ASSUMING if raw == differ else WRONG
    diff = sympy.expand(acct.flops.backward - 2 * acct.flops.forward)
    from symacct.symbols import B, S

    has_s = "S" in acct.free_symbols()
    at = acct.at(B=B_, S=1) if has_s else acct.at(B=B_)
    rule = 6 * at.params * B_
    rule_expr = 6 * acct.params * B * (S if has_s else 1)
    error = sympy.factor(sympy.expand(rule_expr - acct.flops.total) / acct.flops.total)
    correction = ""
    if verdict != HOLDS:
        correction = f"backward - 2 x forward = {_formula(diff)}"
        if raw:
            correction += f": {', '.join(repr(m) for m in raw)} read(s) the raw input and skip dL/dx"
        if error != 0:
            correction += f"; 6ND is off by a relative {_formula(error)}"
    return Claim(
        "6nd-first-layer",
        "backward = 2 x forward for every layer",
        "000: backward needs dL/dW and dL/dx, 2ND each",
        f"{label}: modules whose matmul backward is not twice their forward: "
        f"{', '.join(repr(m) for m in differ) or 'none'}; at B={B_}: {at.flops.total:,} vs 6NB {rule:,}",
        verdict,
        correction,
        numbers={"flops": at.flops.total, "rule": rule, "difference": str(diff), "differ": differ, "raw": raw},
    )


def two_nd_forward(acct: Any = None, *, B_: int = 8, S_: int = 1024, label: str = "gpt2") -> Claim:
    acct = acct if acct is not None else _gpt2()
    at = acct.at(B=B_, S=S_)
    fw = at.flops.forward
    fw_dense = _val(acct, sympy.expand(acct.flops.forward - _s2_terms(acct.flops.forward)), B_, S_)
    rule_fw = 2 * at.params * B_ * S_

    cross = acct.crossover()
    return Claim(
        "2nd-forward",
        "forward FLOPs = 2 N D",
        "000: forward pass 2ND",
        f"{label} at B={B_}, S={S_}: {_e(fw)} vs 2ND {_e(rule_fw)} (ratio {fw / rule_fw:.3f})",
        judge(fw, rule_fw, assumption_holds=rel(fw_dense, rule_fw) <= LOOSE),
        f"derived: {_formula(acct.flops.forward)}"
        + (f" (2ND holds for the terms without S^2, S well below {cross:,.0f})" if cross else ""),
        numbers={"flops": fw, "rule": rule_fw, "dense": fw_dense},
    )


def four_nd_backward(acct: Any = None, *, B_: int = 8, S_: int = 1024, label: str = "gpt2") -> Claim:
    """Backward = 2 x forward over the whole step, judged on the numbers (TOL / LOOSE)."""
    acct = acct if acct is not None else _gpt2()
    at = acct.at(B=B_, S=S_)
    diff = sympy.expand(acct.flops.backward - 2 * acct.flops.forward)
    verdict = judge(at.flops.backward, 2 * at.flops.forward)
    return Claim(
        "4nd-backward",
        "backward FLOPs = 4 N D (twice the forward)",
        "000: dL/dW 2ND + dL/dx 2ND",
        f"{label}: backward - 2 x forward = {_formula(diff)}; at B={B_}, S={S_}: backward {_e(at.flops.backward)} "
        f"vs 2 x forward {_e(2 * at.flops.forward)}",
        verdict,
        "" if verdict == HOLDS else f"derived backward: {_formula(acct.flops.backward)}",
        numbers={"backward": at.flops.backward, "forward": at.flops.forward, "difference": str(diff)},
    )


def _val(acct: Any, expr: Any, B: int, S: int) -> int:
    """A formula of ``acct`` at B, S and the model's own sizes."""
    from symacct.symbols import evaluate

    return evaluate(expr, acct.with_defaults(B=B, S=S))


def _linear(factory: Any = None) -> Any:
    import torch

    from symacct.pipeline import derive

    return derive(
        factory or (lambda D, K: torch.nn.Linear(D, K, bias=False)),
        dims={"D": 64, "K": 48},
        inputs=lambda m, B, S: (torch.randn(B, next(x for x in m.modules() if hasattr(x, "in_features")).in_features),),
        loss=lambda out: out.sum(),
    )


def two_bdk(acct: Any = None) -> Claim:
    """Exact: the forward matmul FLOPs of a (B, D) @ (D, K) layer equal 2BDK, or the claim is wrong."""
    from symacct.symbols import B, sym

    acct = acct if acct is not None else _linear()
    D, K = sym("D"), sym("K")
    fw, bw = acct.flops.forward, acct.flops.backward
    exact = sympy.expand(fw - 2 * B * D * K) == 0
    return Claim(
        "2bdk",
        "X (B x D) @ W (D x K) costs 2 B D K FLOPs",
        "000: each of the B K outputs takes D multiplies and D adds",
        f"nn.Linear(D, K, bias=False) on (B, D): forward {_formula(fw)}, backward {_formula(bw)} "
        "(flop_counter's convention: 2 per multiply-add)",
        HOLDS if exact else WRONG,
        "" if exact else f"derived: {_formula(fw)}",
        numbers={"forward": str(fw), "backward": str(bw)},
    )


def elementwise(
    acct: Any = None, *, B_: int = 8, S_: int = 1024, label: str = "gpt2 (fp32, AdamW)", **sizes: int
) -> Claim:
    """Holds when non-matmul ops take under TOL of both the FLOPs and the roofline time; under the stated
    assumption (counting FLOPs, not time) when only their FLOP share is under TOL; wrong otherwise."""
    acct = acct if acct is not None else _gpt2()
    at = acct.at(B=B_, S=S_, **sizes)
    share_flops = at.flops.other / (at.flops.total + at.flops.other)
    moved = mm_moved = 0
    for _, a in records(at.graph):
        if a.phase == "input":
            continue
        b = (a.cost.bytes_read + a.cost.bytes_written) * a.count
        moved += b
        if a.cost.flops:
            mm_moved += b
    share_bytes = 1 - mm_moved / moved
    from symacct.time.model import roofline

    roof = roofline(acct, "H100-SXM", B=B_, S=S_, **sizes)
    share_time = roof.memory_bound_seconds / roof.seconds
    verdict = WRONG if share_flops >= TOL else HOLDS if share_time < TOL else ASSUMING
    return Claim(
        "elementwise-negligible",
        "elementwise ops (adds, activations) are negligible next to the matmuls",
        "000: O(BD) against O(BDK), negligible",
        f"{label} at B={B_}, S={S_}: non-matmul ops do {share_flops:.2%} of the FLOPs but move "
        f"{share_bytes:.1%} of the bytes; on an H100 roofline the memory-bound ops take {share_time:.0%} "
        "of the step time",
        verdict,
        ""
        if verdict == HOLDS
        else f"negligible in FLOPs only ({share_flops:.2%}); memory-bound ops take {share_time:.0%} of the time"
        if verdict == ASSUMING
        else f"{share_flops:.1%} of the FLOPs are not matmuls",
        numbers={"share_flops": share_flops, "share_bytes": share_bytes, "share_time": share_time},
    )


# ---- bytes per parameter ------------------------------------------------------------------------


def bytes_per_param_claim(
    cid: str, claim: str, seed: str, want: int, acct: Any = None, *, make: dict[str, Any] | None = None
) -> Claim:
    """Exact: the derived bytes per parameter between steps equal the claim's, or it is wrong; the optimizer
    step's own peak per parameter is shown beside it."""
    acct = acct if acct is not None else _gpt2(**(make or {}))
    got = acct.bytes_per_param()
    peak = acct.bytes_per_param_peak()
    parts = ", ".join(f"{k} {_formula(v)}" for k, v in sorted(acct.memory.optimizer_by_state.items()))
    return Claim(
        cid,
        claim,
        seed,
        f"gpt2, {acct.options['optimizer']}, params {_dt(acct.options['params_dtype'])}: "
        f"(params + grads + states) / N leading terms = {got} between steps, {peak} at the optimizer step's "
        f"peak; states: {parts}",
        HOLDS if got == want else WRONG,
        "" if got == want else f"{got} bytes per parameter",
        numbers={
            "bytes_per_param": float(got) if got is not None else None,
            "bytes_per_param_peak": float(peak) if peak is not None else None,
            "claimed": want,
        },
    )


BPP_CLAIMS = (
    ("16-bytes-fp32", "AdamW in fp32: 16 bytes per parameter", "000: 4 weights + 4 grads + 4 m + 4 v", 16,
     {"optimizer": "adamw"}),
    ("16-bytes-mixed", "bf16 mixed precision with fp32 master, m, v: 16 bytes per parameter",
     "003: bf16 weights 2 + bf16 grads 2 + fp32 master/m/v 12", 16,
     {"optimizer": "mixed_adamw", "params_dtype": "bf16"}),
    ("18-bytes-fp32-grads", "the same with fp32 gradients: 18 bytes", "003: 18 with fp32 grads", 18,
     {"optimizer": "mixed_adamw", "params_dtype": "bf16", "fp32_grads": True}),
)  # fmt: skip


def inference_bytes(acct: Any = None) -> Claim:
    acct = acct if acct is not None else _gpt2(step="forward", params_dtype="bf16")
    inf_bpp = sympy.simplify(acct.memory.params / acct.params)
    return Claim(
        "2-bytes-inference",
        "bf16 inference: 2 bytes per parameter",
        "003: 7B -> 14 GB",
        f"gpt2, forward only, params {_dt(acct.options['params_dtype'])}: memory.params / N = {inf_bpp}",
        HOLDS if inf_bpp == 2 else WRONG,
        "the weights only: activations of the forward (and a KV cache when generating) come on top"
        if inf_bpp == 2
        else f"{inf_bpp} bytes per parameter",
        numbers={"bytes_per_param": float(inf_bpp)},
    )


def bytes_per_param() -> list[Claim]:
    out = [bytes_per_param_claim(cid, claim, seed, want, make=make) for cid, claim, seed, want, make in BPP_CLAIMS]
    return [*out, inference_bytes()]


# ---- activations --------------------------------------------------------------------------------


def activations(acct: Any = None, *, B_: int = 4, S_: int = 1024) -> list[Claim]:
    """The seed's activation rule and Korthikanti's, on ``acct`` (a gpt2-like model: a 'blocks' stack with D, L, H)."""
    from symacct.symbols import B, D, H, L, S

    acct = acct if acct is not None else _gpt2(config=GPT2_1B3, autocast="bf16")
    at = acct.at(B=B_, S=S_)
    vals = at.values
    hidden, layers, heads = vals["D"], vals["L"], vals["H"]
    seed_rule = B_ * S_ * hidden * (34 + 5 * layers)
    korth = layers * S_ * B_ * hidden * (34 + 5 * heads * S_ / hidden)
    derived = at.memory.activations
    per_layer = acct.memory.activations_per_layer["blocks"]
    names = []
    for mod, expr in sorted(acct.memory.activations_by_module.items()):
        if mod.startswith("blocks.*"):
            names.append(f"`{mod}` {_formula(sympy.expand(expr / L))}")
    poly = sympy.Poly(per_layer, B, S, D, H)
    c_bsd, c_bhs2 = poly.coeff_monomial(B * S * D), poly.coeff_monomial(B * H * S**2)
    seed_expr = B * S * D * (34 + 5 * L)
    total_poly = sympy.expand(acct.memory.activations)
    seed_shape = sympy.expand(seed_expr).coeff(L, 1) - sympy.expand(total_poly).coeff(L, 1)
    out = [
        Claim(
            "activations-seed-rule",
            "activation bytes = batch x seq x hidden x (34 + 5 x num_layers)",
            "003: 4 x 1024 x 2048 x (34 + 5 x 24) = 1.29 GB for the 1.3B example",
            f"gpt2 (D={hidden}, L={layers}, H={heads}; autocast {_dt(acct.options['autocast'])}) at B={B_}, S={S_}: "
            f"{_gb(derived)} saved for backward; the seed's rule gives {_gb(seed_rule)}; Korthikanti's "
            f"L s b h (34 + 5 a s / h) gives {_gb(korth)}",
            judge(derived, seed_rule),
            "per layer s b h (34 + 5 a s / h) (Korthikanti et al. 2022), times L: the layer count multiplies "
            "the whole bracket, and the second term grows with S^2 and the head count, not with L. "
            f"Derived for this model: {_formula(acct.memory.activations)}",
            [f"the rule's per-layer term minus the derived one: {_formula(seed_shape)}"],
            {"derived": derived, "seed_rule": seed_rule, "korthikanti": korth},
        ),
        Claim(
            "activations-korthikanti",
            "activation bytes per layer = s b h (34 + 5 a s / h) (Korthikanti et al. 2022)",
            "REFERENCES.md (the rule the seed misquotes)",
            f"gpt2 per layer, autocast {_dt(acct.options['autocast'])}: {_formula(per_layer)}; B S D coefficient "
            f"{c_bsd} (paper 34), B H S^2 coefficient {c_bhs2} (paper 5); at D={hidden}, H={heads}, B={B_}, S={S_}: "
            f"{_gb(_val(acct, per_layer, B_, S_))} per layer vs {_gb(korth / layers)}",
            # the paper's two terms are a lower bound of the derived ones: it holds for what it counts
            judge(_val(acct, per_layer, B_, S_), korth / layers, assumption_holds=c_bsd >= 34 and c_bhs2 >= 5),
            "the paper assumes every activation in 16 bits, 1-byte dropout masks, no saved causal mask, "
            "weights counted elsewhere; PyTorch's autocast keeps LayerNorm inputs in fp32 and dropout masks "
            "in 2 bytes, and saves the mask, the bf16 weight copies and LayerNorm's mean and rstd",
            ["per module, per layer: " + ", ".join(names)],
            {"bsd": int(c_bsd), "bhs2": int(c_bhs2), "per_layer": _val(acct, per_layer, B_, S_), "paper": korth},
        ),
    ]
    return out


def korthikanti_cuda(cpu: Any = None, cuda: Any = None, *, B_: int = 4, S_: int = 1024) -> Claim:
    """Korthikanti's rule in its own setting (bf16 parameters, dropout, eager attention) on CUDA's kernels
    (``derive(device="cuda")``, the CUDA build of torch) beside the CPU's: the paper's two coefficients are
    exact there and the remainder is what PyTorch adds, each term named."""
    from symacct.symbols import B, D, H, S

    cpu = cpu if cpu is not None else _gpt2(config=GPT2_1B3, params_dtype="bf16")
    cuda = cuda if cuda is not None else _gpt2(config=GPT2_1B3, params_dtype="bf16", device="cuda")
    per = {k: sympy.expand(a.memory.activations_per_layer["blocks"]) for k, a in (("cpu", cpu), ("cuda", cuda))}
    paper = 34 * B * S * D + 5 * B * H * S**2
    poly = sympy.Poly(per["cuda"], B, S, D, H)
    c_bsd, c_bhs2 = poly.coeff_monomial(B * S * D), poly.coeff_monomial(B * H * S**2)
    vals = cuda.at(B=B_, S=S_).values
    hidden, heads = vals["D"], vals["H"]
    korth = S_ * B_ * hidden * (34 + 5 * heads * S_ / hidden)
    derived = _val(cuda, per["cuda"], B_, S_)
    return Claim(
        "activations-korthikanti-cuda",
        "activation bytes per layer = s b h (34 + 5 a s / h) (Korthikanti et al. 2022), in Megatron's setting",
        "REFERENCES.md: bf16 parameters, dropout, 1-byte masks, eager attention",
        f"gpt2 (D={hidden}, H={heads}) with bf16 parameters, per layer: CUDA kernels {_formula(per['cuda'])}, "
        f"CPU kernels {_formula(per['cpu'])}; B S D coefficient {c_bsd} (paper 34), B H S^2 coefficient "
        f"{c_bhs2} (paper 5); at B={B_}, S={S_}: {_gb(derived)} per layer vs {_gb(korth)}",
        judge(derived, korth),
        "",
        [
            f"CUDA minus the paper: {_formula(sympy.expand(per['cuda'] - paper))} (LayerNorm's fp32 mean and rstd, "
            "two norms: 16 B S; the bool S x S causal-mask slice masked_fill saves: S^2)",
            f"CUDA minus CPU: {_formula(sympy.expand(per['cuda'] - per['cpu']))} (dropout masks of 1 byte where the "
            "CPU saves bf16 noise; LayerNorm's statistics in fp32 on CUDA, bf16 on the CPU)",
        ],
        {"bsd": int(c_bsd), "bhs2": int(c_bhs2), "per_layer": derived, "paper": korth},
    )


def bytes_per_param_cuda(cpu: Any = None, cuda: Any = None) -> Claim:
    """'16 bytes per parameter' for AdamW in fp32 with the optimizer path PyTorch defaults to on CUDA (foreach),
    beside the CPU's (the loop): between steps the claim is judged exactly; the optimizer step's own peak per
    parameter is shown for both, and the path each ran is read off its trace."""
    cpu = cpu if cpu is not None else _gpt2(optimizer="adamw")
    cuda = cuda if cuda is not None else _gpt2(optimizer="adamw", device="cuda")

    def path(acct: Any) -> str:
        ops = [str(r.op) for r in acct.step.ops if r.phase == "optimizer"]
        return "foreach" if any(op.startswith("aten._foreach_") for op in ops) else "the single-tensor loop"

    got, peak, cpu_peak = cuda.bytes_per_param(), cuda.bytes_per_param_peak(), cpu.bytes_per_param_peak()
    cuda_path, cpu_path = path(cuda), path(cpu)
    return Claim(
        "16-bytes-fp32-cuda",
        "AdamW in fp32: 16 bytes per parameter, on CUDA",
        "000: 4 weights + 4 grads + 4 m + 4 v",
        f"gpt2, adamw, fp32 on CUDA's kernels, optimizer path {cuda_path} (PyTorch's default there): {got} "
        f"between steps, {peak} at the optimizer step's peak; on the CPU ({cpu_path}): {cpu_peak} at its peak",
        HOLDS if got == 16 else WRONG,
        "" if got == 16 else f"{got} bytes per parameter",
        [
            f"between steps; inside the optimizer step CUDA ({cuda_path}) holds {peak} per parameter, the CPU "
            f"({cpu_path}) {cpu_peak}"
            + (" (foreach makes sqrt(v) of every parameter at once)" if peak != cpu_peak else "")
        ],
        numbers={
            "bytes_per_param": float(got) if got is not None else None,
            "bytes_per_param_peak": float(peak) if peak is not None else None,
            "cpu_bytes_per_param_peak": float(cpu_peak) if cpu_peak is not None else None,
            "claimed": 16,
        },
    )


def cuda_claims() -> list[Claim]:
    """The claims whose figures differ on CUDA's kernels, derived there (``symacct check --device cuda``)."""
    return [korthikanti_cuda(), bytes_per_param_cuda()]


# ---- number formats ----------------------------------------------------------------------------


SEED_FORMATS = (  # 000's table: name, bytes, sign / exponent / mantissa bits, what it says of range
    ("FP32", "float32", 4, (1, 8, 23), "high precision, large range"),
    ("FP16", "float16", 2, (1, 5, 10), "5 exponent bits: narrow range, overflows and underflows"),
    ("BF16", "bfloat16", 2, (1, 8, 7), "FP32's 8 exponent bits: the same range, less precision"),
    ("FP8", "float8_e4m3fn", 1, (1, 4, 3), "E4M3"),
)


def formats(finfo: Any = None, iinfo: Any = None) -> list[Claim]:
    """The seed's format table against ``finfo`` / ``iinfo`` (torch's by default; a test passes others)."""
    import torch

    finfo = finfo or torch.finfo
    iinfo = iinfo or torch.iinfo
    f32 = finfo(torch.float32)
    out = []
    for name, tname, nbytes, bits, says in SEED_FORMATS:
        fi = finfo(getattr(torch, tname))
        mant = round(-math.log2(fi.eps))
        expo = fi.bits - 1 - mant
        got = (fi.bits // 8, (1, expo, mant))
        ok = got == (nbytes, bits)
        range_note = f"max {fi.max:.4g}, smallest normal {fi.tiny:.4g}, eps {fi.eps:.3g}"
        if name == "BF16":
            same = rel(fi.max, f32.max) < 0.01 and fi.tiny == f32.tiny
            ok = ok and same
            range_note += f" (FP32: max {f32.max:.4g}, smallest normal {f32.tiny:.4g})"
        out.append(
            Claim(
                f"format-{name.lower()}",
                f"{name}: {nbytes} byte{'s' if nbytes > 1 else ''}, "
                f"sign/exponent/mantissa {'/'.join(map(str, bits))}; {says}",
                "000: floating-point format table",
                f"torch.finfo(torch.{tname}): {fi.bits // 8} byte{'s' if fi.bits > 8 else ''}, 1/{expo}/{mant}; "
                f"{range_note}",
                HOLDS if ok else WRONG,
                "" if ok else f"{fi.bits // 8} bytes, 1/{expo}/{mant}",
                numbers={"bytes": fi.bits // 8, "exponent": expo, "mantissa": mant, "max": fi.max},
            )
        )
    ii = iinfo(torch.int8)
    out.append(
        Claim(
            "format-int8",
            "1-byte formats store 256 values (FP8 as int8)",
            "000: FP8 at 1 byte (int8 given here for comparison; the seed's table has no integer row)",
            f"torch.iinfo(torch.int8): {ii.bits // 8} byte, {ii.min}..{ii.max}; "
            f"torch.finfo(torch.float8_e4m3fn) max {torch.finfo(torch.float8_e4m3fn).max:g}",
            HOLDS if ii.bits == 8 and ii.max - ii.min + 1 == 256 else WRONG,
            numbers={"bits": ii.bits, "min": ii.min, "max": ii.max},
        )
    )
    return out


# ---- the seeds' worked numbers ----------------------------------------------------------------


def static_13b(acct: Any = None) -> Claim:
    acct = acct if acct is not None else _gpt2(config=GPT2_1B3, optimizer="mixed_adamw", params_dtype="bf16")
    at = acct.at(B=4, S=1024)
    static = at.memory.params + at.memory.grads + at.memory.optimizer
    bpp = acct.bytes_per_param()
    return Claim(
        "1.3b-static",
        "1.3B model, bf16 mixed precision AdamW: about 20 GB static",
        "003: parameters + gradients + optimizer states about 20 GB",
        f"gpt2 at D={at.values['D']}, L={at.values['L']} (N = {at.params:,}), {acct.options['optimizer']}: "
        f"{_gb(static)}; 1.3e9 x 16 = {_gb(1.3e9 * 16)}",
        judge(static, 20e9),
        f"{_gb(static)}: {bpp} bytes x {at.params / 1e9:.2f}B parameters (the seed's own 1.3e9 x 16 is "
        f"{_gb(1.3e9 * 16)}, {rel(1.3e9 * 16, 20e9):.0%} above its 20 GB)",
        numbers={"static": static, "claimed": 20e9, "params": at.params},
    )


def activations_13b(acct: Any = None) -> Claim:
    acct = acct if acct is not None else _gpt2(config=GPT2_1B3, autocast="bf16")
    arith = 4 * 1024 * 2048 * 154
    derived = acct.at(B=4, S=1024).memory.activations
    s_max = max(acct.symbols.get("S_max", 2048), 2048)  # S = 2048 needs a position table of 2048 rows
    big = acct.at(B=16, S=2048, **({"S_max": s_max} if "S_max" in acct.symbols else {})).memory.activations
    return Claim(
        "1.3b-activations",
        "1.3B, micro batch 4, seq 1024: activations about 1.29 GB (16 x 2048: 10.3 GB)",
        "003: 4 x 1024 x 2048 x 154 = 1.29 GB",
        f"the seed's arithmetic gives {_gb(arith)}; derived (bf16 autocast, dropout): {_gb(derived)}; "
        f"at B=16, S=2048 (S_max {s_max}): {_gb(big)} (seed: 10.3 GB)",
        judge(derived, 1.29e9),
        f"{_gb(derived)} at B=4, S=1024: the rule multiplies by L in the wrong place (see activations-seed-rule)",
        numbers={"derived": derived, "claimed": 1.29e9, "arithmetic": arith, "derived_16x2048": big},
    )


def step_flops_13b(acct: Any = None) -> Claim:
    acct = acct if acct is not None else _gpt2(config=GPT2_1B3, autocast="bf16")
    at32 = acct.at(B=32, S=1024)
    scores = _val(acct, _s2_terms(acct.flops.total), 32, 1024)
    return Claim(
        "1.3b-step-flops",
        "1.3B, batch 32 x 1024 tokens: 6 x 1.3e9 x 32768 = 2.56e14 FLOPs per step",
        "003: about 2.56e14 FLOPs, 2.56 s at 1e14 FLOP/s",
        f"derived matmul FLOPs per step: {_e(at32.flops.total)} (N = {at32.params:,}); "
        f"the arithmetic 6 x 1.3e9 x 32768 = {_e(6 * 1.3e9 * 32768)}",
        judge(at32.flops.total, 2.56e14),
        f"{_e(at32.flops.total)}: the attention-score terms {_formula(_s2_terms(acct.flops.total))} are "
        f"{scores / at32.flops.total:.1%} of it, and N is {at32.params / 1e9:.3f}B",
        numbers={"derived": at32.flops.total, "claimed": 2.56e14},
    )


def days_146(hardware: str = "H100-SXM") -> Claim:
    from symacct.time.model import estimate

    est = estimate(params=70e9, tokens=15e12, hardware=hardware, gpus=1024, mfu=0.5)
    peak = est.inputs["peak"]
    return Claim(
        "146-days",
        "70B parameters, 15T tokens, 1024 H100 at MFU 0.5: about 146 days",
        "000: 6.3e24 / 5e17 = 1.26e7 s = 146 days",
        f"6ND / ({peak:.4g} x 0.5 x 1024) on {est.inputs['hardware']} = {est.days:.1f} days "
        f"(the seed's denominator 5e17 is {rel(5e17, peak * 0.5 * 1024):.1%} off {peak * 0.5 * 1024:.4g})",
        judge(est.days, 146),
        numbers={"days": est.days, "claimed": 146},
    )


def params_on_8xh100(acct: Any = None, hardware: str = "H100-SXM") -> Claim:
    from symacct.time.model import max_params

    acct = acct if acct is not None else _gpt2(optimizer="adamw")
    bpp = float(acct.bytes_per_param())
    n40 = max_params(hardware=hardware, gpus=8, bytes_per_param=bpp, reserve=0)
    reserved = max_params(hardware=hardware, gpus=8, bytes_per_param=bpp)
    return Claim(
        "40b-on-8xh100",
        "8 x H100 80 GB with AdamW at 16 bytes/param: about 40B parameters",
        "000: 640e9 / 16 = 40B",
        f"8 x {hardware} capacity / bytes per parameter (derived {bpp:g} for {acct.options['optimizer']}, between "
        f"steps) = {n40 / 1e9:.1f}B; with a 15 % reserve {reserved / 1e9:.1f}B",
        judge(n40, 40e9),
        "static memory only: activations and the reserve for the CUDA context and workspaces come on top",
        numbers={"params": n40, "claimed": 40e9, "bytes_per_param": bpp},
    )


def static_7b(acct: Any = None) -> Claim:
    acct = acct if acct is not None else _derive("llama", optimizer="mixed_adamw", params_dtype="bf16")
    at7 = acct.at(B=1, S=min(4096, acct.symbols.get("S_max", 4096)))
    static7 = at7.memory.params + at7.memory.grads + at7.memory.optimizer
    return Claim(
        "7b-112gb",
        "7B model: 7e9 x 16 = 112 GB static",
        "003: static cost about 112 GB",
        f"Llama 2 7B config (N = {at7.params:,}), {acct.options['optimizer']}: {_gb(static7)}",
        judge(static7, 112e9),
        numbers={"static": static7, "claimed": 112e9, "params": at7.params},
    )


def inference_7b(acct: Any = None, *, context: int = 4096) -> Claim:
    """The weights alone, and what serving holds: the weights and the KV cache of one sequence at ``context``
    positions, from the derived decode step (its cache and its exact peak)."""
    acct = acct if acct is not None else _derive("llama", step="decode", params_dtype="bf16")
    C = min(context, acct.symbols.get("S_max", context)) - 1  # cached before the last token
    at = acct.at(B=1, C=C)
    w, cache, peak = at.memory.params, at.memory.kv_cache, at.memory.peak
    weights_verdict = judge(w, 14e9)
    verdict = judge(w + cache, 14e9, assumption_holds=weights_verdict == HOLDS)
    return Claim(
        "7b-14gb-inference",
        "7B model, bf16 inference: about 14 GB",
        "003: 2 bytes per parameter",
        f"Llama 2 7B config, params {_dt(acct.options['params_dtype'])}, a decode step at a {C + 1}-token "
        f"context, batch 1: weights {_gb(w)}; KV cache {_gb(cache)} ({_formula(acct.memory.kv_cache)}); "
        f"weights + cache {_gb(w + cache)}; the step's peak {_gb(peak)}",
        verdict,
        ""
        if verdict == HOLDS
        else f"the weights only ({_gb(w)}): serving one {C + 1}-token sequence holds "
        f"{_gb(w + cache)} with its KV cache, and the cache grows with batch and context",
        numbers={"weights": w, "kv_cache": cache, "decode_peak": peak, "context": C + 1, "claimed": 14e9},
    )


def worked_numbers() -> list[Claim]:
    return [
        static_13b(),
        activations_13b(),
        step_flops_13b(),
        days_146(),
        params_on_8xh100(),
        static_7b(),
        inference_7b(),
    ]


def catalog(device: str = "cpu") -> list[Claim]:
    """Every claim with its derived verdict (about 20 s: a dozen derivations, made once a process: the claims
    are about fixed reference models; each call gets its own copies). ``device="cuda"`` adds the claims
    derived on CUDA's kernels beside the CPU's (:func:`cuda_claims`; the CUDA build of torch, no GPU)."""
    from symacct.trace.record import check_device

    check_device(device)
    extra = cuda_claims() if device.startswith("cuda") else []
    return copy.deepcopy([*_catalog(), *extra])


@functools.cache
def _catalog() -> tuple[Claim, ...]:
    return (
        six_nd(),
        six_nd_embeddings(),
        first_layer(),
        two_nd_forward(),
        four_nd_backward(),
        two_bdk(),
        elementwise(),
        *bytes_per_param(),
        *activations(),
        *formats(),
        *worked_numbers(),
    )


def render_md(claims: list[dict[str, Any]]) -> str:
    """docs/rules-of-thumb.md: the table, then each claim's details."""
    counts = {v: sum(c["verdict"] == v for c in claims) for v in (HOLDS, ASSUMING, WRONG)}
    out = [
        "# Rules of thumb, checked by derivation",
        "",
        "Generated by `symacct check --format md` (do not edit: `tests/test_check.py` fails when this page is",
        "stale). Each claim is from the seed articles (`../shared/seeds`, 000: CS336 lecture 2, 003: memory",
        "accounting in practice); each derived figure comes from `symacct.derive` on a reference model, or",
        f"from `torch.finfo` / `torch.iinfo`. Verdicts: within {TOL:.0%} is *holds*; a claim that holds only",
        f"under an assumption it does not state (or within {LOOSE:.0%}) *holds under stated assumptions*;",
        "anything else is *wrong*, with the corrected formula. GB = 10^9 bytes.",
        "",
        f"{counts[HOLDS]} hold, {counts[ASSUMING]} hold under stated assumptions, {counts[WRONG]} are wrong.",
        "",
        "| claim | the seed says | derived | verdict |",
        "|---|---|---|---|",
    ]
    for c in claims:
        verdict = f"**{c['verdict']}**" + (f": {_cell(c['correction'])}" if c["correction"] else "")
        out.append(f"| {_cell(c['claim'])} | {_cell(c['seed'])} | {_cell(c['derived'])} | {verdict} |")
    out += ["", "## Details", ""]
    for c in claims:
        if c["details"]:
            out.append(f"- `{c['id']}`: " + "; ".join(_cell(d) for d in c["details"]))
    return "\n".join(out) + "\n"


def _cell(s: str) -> str:
    """Table-safe Markdown: no pipes; '*' outside inline code escaped (not emphasis)."""
    parts = s.replace("|", "/").split("`")
    return "`".join(p if i % 2 else p.replace("*", r"\*") for i, p in enumerate(parts))
