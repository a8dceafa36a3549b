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

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import sympy

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

    import symacct
    from symacct.models.presets import PRESETS

    cls, make = PRESETS[model]
    cfg = make()
    for k, v in overrides:
        setattr(cfg, k, v)
    if "fp32_grads" in kw:
        kw["optimizer_options"] = {"fp32_grads": kw.pop("fp32_grads")}
    with torch.device("meta"):
        m = cls(cfg)
    return symacct.derive(m, **kw)


def _gpt2(**kw: Any) -> Any:
    over = tuple(sorted(kw.pop("config", {}).items()))
    return _derive("gpt2", over, **kw)


def _linear() -> Any:
    import torch

    import symacct

    return symacct.derive(
        lambda D, K: torch.nn.Linear(D, K, bias=False),
        dims={"D": 64, "K": 48},
        inputs=lambda m, B, S: (torch.randn(B, m.in_features),),
        loss=lambda out: out.sum(),
    )


def _dt(name: str | None) -> str:
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", None: "fp32"}.get(name, str(name))


def _e(x: float) -> str:
    return f"{x:.3g}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def _formula(expr: Any) -> str:
    """A formula in the fixed text layout, as inline code (Markdown shows '*' and '**' as written)."""
    from symacct.formula import text

    return f"`{text(expr)}`"


# ---- FLOPs -----------------------------------------------------------------------------------


def six_nd() -> list[Claim]:
    from symacct.symbols import B, D, S

    B_, S_ = 8, 1024
    acct = _gpt2()
    at = acct.at(B=B_, S=S_)
    tokens = B_ * S_
    rule = 6 * at.params * tokens
    ratio = at.flops.total / rule
    scores = sympy.expand(acct.flops.total).coeff(S, 2) * S**2  # the S^2 terms: attention scores
    dense = sympy.expand(acct.flops.total - scores)
    dense_at = _val(acct, dense, B_, S_)
    from symacct.plots import crossover

    cross = crossover(acct)
    out = [
        Claim(
            "6nd",
            "training FLOPs = 6 N D (N parameters, D tokens)",
            "000: forward 2ND + backward 4ND = 6ND; 003: 6 x N x tokens per step",
            f"gpt2 (124M, tied head) at B={B_}, S={S_}: {_e(at.flops.total)} matmul FLOPs per step; "
            f"6ND = {_e(rule)}; ratio {ratio:.3f}",
            judge(at.flops.total, rule, assumption_holds=rel(dense_at, rule) <= LOOSE),
            f"derived: {_formula(acct.flops.total)}; per token 6 N_matmul + 12 L S D (attention scores), "
            "where N_matmul excludes the position table and counts a tied embedding once (as the head)",
            [
                f"attention-score terms {_formula(scores)} are {_e(_val(acct, scores, B_, S_))} "
                f"FLOPs ({_val(acct, scores, B_, S_) / at.flops.total:.1%} of the step)",
                f"the S^2 terms of one layer equal its D^2 terms at S = {cross:,.0f} (= 6D for gpt2); "
                "below that 6ND undercounts by S/(6D) of the layer FLOPs",
            ],
            {"flops": at.flops.total, "rule": rule, "ratio": ratio, "dense": dense_at, "crossover": cross},
        )
    ]
    # embeddings: an untied model's token table is a lookup, not a matmul
    un = _gpt2(config={"tie_weights": False})
    at_u = un.at(B=B_, S=S_)
    rule_u = 6 * at_u.params * tokens
    rule_ne = 6 * (at_u.params - at_u.params_embedding) * tokens
    out.append(
        Claim(
            "6nd-embeddings",
            "6ND with N counting every parameter, embedding tables included",
            "000: N is the parameter count",
            f"gpt2 untied at B={B_}, S={S_}: N = {at_u.params:,} of which {at_u.params_embedding:,} in embedding "
            f"tables (0 FLOPs: lookups); derived {_e(at_u.flops.total)} vs 6ND {_e(rule_u)} "
            f"(ratio {at_u.flops.total / rule_u:.3f}); with N without embeddings {_e(rule_ne)} "
            f"(ratio {at_u.flops.total / rule_ne:.3f})",
            judge(at_u.flops.total, rule_u, assumption_holds=rel(at_u.flops.total, rule_ne) <= LOOSE),
            "count N without the embedding tables (as Kaplan et al. do); add the attention terms 12 L B S^2 D",
            numbers={"flops": at_u.flops.total, "rule": rule_u, "rule_no_embedding": rule_ne},
        )
    )
    # the first layer whose input needs no gradient: cruncher (L Linear layers on a plain input)
    cr = _derive("cruncher")
    first = sympy.expand(cr.flops.total - 6 * cr.params * B)
    at_c = cr.at(B=8)
    out.append(
        Claim(
            "6nd-first-layer",
            "backward = 2 x forward for every layer",
            "000: backward needs dL/dW and dL/dx, 2ND each",
            f"cruncher (L Linear D x D + head, input needs no grad): flops.total - 6 N B = {_formula(first)}; "
            f"at D={cr.symbols['D']}, L={cr.symbols['L']}, B=8: {at_c.flops.total:,} vs 6NB {6 * at_c.params * 8:,}",
            judge(at_c.flops.total, 6 * at_c.params * 8, assumption_holds=sympy.expand(first).has(D)),
            "the first layer skips dL/dx: subtract 2 B D_in D_out once (relative error 1/(3L) for L equal layers)",
            numbers={"flops": at_c.flops.total, "rule": 6 * at_c.params * 8, "difference": str(first)},
        )
    )
    fw = at.flops.forward
    fw_dense = _val(
        acct, sympy.expand(acct.flops.forward - sympy.expand(acct.flops.forward).coeff(S, 2) * S**2), B_, S_
    )
    rule_fw = 2 * at.params * tokens
    out += [
        Claim(
            "2nd-forward",
            "forward FLOPs = 2 N D",
            "000: forward pass 2ND",
            f"gpt2 at B={B_}, S={S_}: {_e(fw)} vs 2ND {_e(rule_fw)} (ratio {fw / rule_fw:.3f})",
            judge(fw, rule_fw, assumption_holds=rel(fw_dense, rule_fw) <= LOOSE),
            f"derived: {_formula(acct.flops.forward)} (2ND holds for the non-attention terms, S << 6D)",
            numbers={"flops": fw, "rule": rule_fw, "dense": fw_dense},
        ),
        Claim(
            "4nd-backward",
            "backward FLOPs = 4 N D (twice the forward)",
            "000: dL/dW 2ND + dL/dx 2ND",
            f"gpt2: backward - 2 x forward = {_formula(sympy.expand(acct.flops.backward - 2 * acct.flops.forward))}; "
            f"cruncher: {_formula(sympy.expand(cr.flops.backward - 2 * cr.flops.forward))}",
            HOLDS if sympy.expand(acct.flops.backward - 2 * acct.flops.forward) == 0 else ASSUMING,
            "exactly twice the forward when every layer's input needs a gradient; the first layer of a "
            "network on raw inputs skips dL/dx",
            numbers={
                "gpt2_difference": str(sympy.expand(acct.flops.backward - 2 * acct.flops.forward)),
                "cruncher_difference": str(sympy.expand(cr.flops.backward - 2 * cr.flops.forward)),
            },
        ),
    ]
    return out


def _val(acct: Any, expr: Any, B: int, S: int) -> int:
    """A formula of ``acct`` at B, S and the model's own sizes."""
    from symacct.symbols import evaluate

    return evaluate(expr, {**acct.symbols, "B": B, "S": S})


def two_bdk() -> Claim:
    from symacct.symbols import B, sym

    acct = _linear()
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


def elementwise() -> Claim:
    B_, S_ = 8, 1024
    acct = _gpt2()
    at = acct.at(B=B_, S=S_)
    share_flops = at.flops.other / (at.flops.total + at.flops.other)
    moved = mm_moved = 0
    for _, a in at.graph.nodes(data=True):
        if a["phase"] == "input":
            continue
        b = (a["bytes_read"] + a["bytes_written"]) * a["count"]
        moved += b
        if a["flops"]:
            mm_moved += b
    share_bytes = 1 - mm_moved / moved
    from symacct.timing import roofline

    roof = roofline(acct, "H100-SXM", B=B_, S=S_)
    share_time = roof.memory_bound_seconds / roof.seconds
    return Claim(
        "elementwise-negligible",
        "elementwise ops (adds, activations) are negligible next to the matmuls",
        "000: O(BD) against O(BDK), negligible",
        f"gpt2 (fp32, AdamW) at B={B_}, S={S_}: non-matmul ops do {share_flops:.2%} of the FLOPs but move "
        f"{share_bytes:.1%} of the bytes; on an H100 roofline the memory-bound ops take {share_time:.0%} "
        "of the step time",
        ASSUMING if share_flops < TOL else WRONG,
        "negligible in FLOPs only; in bytes moved (and so in time, unless fused) they dominate",
        numbers={"share_flops": share_flops, "share_bytes": share_bytes, "share_time": share_time},
    )


# ---- bytes per parameter ------------------------------------------------------------------------


def bytes_per_param() -> list[Claim]:
    fp32 = _gpt2(optimizer="adamw")
    mixed = _gpt2(optimizer="mixed_adamw", params_dtype="bf16")
    mixed18 = _gpt2(optimizer="mixed_adamw", params_dtype="bf16", fp32_grads=True)
    infer = _gpt2(step="forward", params_dtype="bf16")
    inf_bpp = sympy.simplify(infer.memory.params / infer.params)
    rows = [
        ("16-bytes-fp32", "AdamW in fp32: 16 bytes per parameter", "000: 4 weights + 4 grads + 4 m + 4 v", fp32, 16),
        (
            "16-bytes-mixed",
            "bf16 mixed precision with fp32 master, m, v: 16 bytes per parameter",
            "003: bf16 weights 2 + bf16 grads 2 + fp32 master/m/v 12",
            mixed,
            16,
        ),
        ("18-bytes-fp32-grads", "the same with fp32 gradients: 18 bytes", "003: 18 with fp32 grads", mixed18, 18),
    ]
    out = []
    for cid, claim, seed, acct, want in rows:
        got = acct.bytes_per_param()
        parts = ", ".join(f"{k} {_formula(v)}" for k, v in sorted(acct.memory.optimizer_by_state.items()))
        out.append(
            Claim(
                cid,
                claim,
                seed,
                f"gpt2, {acct.options['optimizer']}, params {_dt(acct.options['params_dtype'])}: "
                f"(params + grads + states) / N leading terms = {got}; states: {parts}",
                HOLDS if got == want else WRONG,
                "" if got == want else f"{got} bytes per parameter",
                numbers={"bytes_per_param": float(got) if got is not None else None, "claimed": want},
            )
        )
    out.append(
        Claim(
            "2-bytes-inference",
            "bf16 inference: 2 bytes per parameter",
            "003: 7B -> 14 GB",
            f"gpt2, forward only, bf16 parameters: memory.params / N = {inf_bpp}",
            HOLDS if inf_bpp == 2 else WRONG,
            "the weights only: activations of the forward (and a KV cache when generating) come on top",
            numbers={"bytes_per_param": float(inf_bpp)},
        )
    )
    return out


# ---- activations --------------------------------------------------------------------------------


def activations() -> list[Claim]:
    from symacct.symbols import B, D, H, L, S

    B_, S_ = 4, 1024
    acct = _gpt2(config=GPT2_1B3, autocast="bf16")
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
            f"gpt2 at the seed's 1.3B shape (D=2048, L=24, H=16; bf16 autocast, dropout) at B={B_}, S={S_}: "
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
            f"gpt2 per layer under bf16 autocast with dropout: {_formula(per_layer)}; B S D coefficient {c_bsd} "
            f"(paper 34), B H S^2 coefficient {c_bhs2} (paper 5); at the 1.3B shape, B={B_}, S={S_}: "
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


# ---- number formats ----------------------------------------------------------------------------


SEED_FORMATS = (  # 000's table: name, bytes, sign / exponent / mantissa bits, what it says of range
    ("FP32", "float32", 4, (1, 8, 23), "high precision, large range"),
    ("FP16", "float16", 2, (1, 5, 10), "5 exponent bits: narrow range, overflows and underflows"),
    ("BF16", "bfloat16", 2, (1, 8, 7), "FP32's 8 exponent bits: the same range, less precision"),
    ("FP8", "float8_e4m3fn", 1, (1, 4, 3), "E4M3"),
)


def formats() -> list[Claim]:
    import torch

    f32 = torch.finfo(torch.float32)
    out = []
    for name, tname, nbytes, bits, says in SEED_FORMATS:
        fi = torch.finfo(getattr(torch, tname))
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
    ii = torch.iinfo(torch.int8)
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


def worked_numbers() -> list[Claim]:
    from symacct.timing import estimate, max_params

    out = []
    mixed = _gpt2(config=GPT2_1B3, optimizer="mixed_adamw", params_dtype="bf16")
    at = mixed.at(B=4, S=1024)
    static = at.memory.params + at.memory.grads + at.memory.optimizer
    out.append(
        Claim(
            "1.3b-static",
            "1.3B model, bf16 mixed precision AdamW: about 20 GB static",
            "003: parameters + gradients + optimizer states about 20 GB",
            f"gpt2 at D=2048, L=24 (N = {at.params:,}), mixed_adamw: {_gb(static)}; 1.3e9 x 16 = {_gb(1.3e9 * 16)}",
            judge(static, 20e9),
            f"{_gb(static)}: 16 bytes x {at.params / 1e9:.2f}B parameters (the seed rounds N down and 20.8 GB to 20)",
            numbers={"static": static, "claimed": 20e9, "params": at.params},
        )
    )
    ac = _gpt2(config=GPT2_1B3, autocast="bf16")
    arith = 4 * 1024 * 2048 * 154
    derived = ac.at(B=4, S=1024).memory.activations
    out.append(
        Claim(
            "1.3b-activations",
            "1.3B, micro batch 4, seq 1024: activations about 1.29 GB (16 x 2048: 10.3 GB)",
            "003: 4 x 1024 x 2048 x 154 = 1.29 GB",
            f"the seed's arithmetic gives {_gb(arith)}; derived (bf16 autocast, dropout): {_gb(derived)}; "
            f"at B=16, S=2048: {_gb(ac.at(B=16, S=2048).memory.activations)} (seed: 10.3 GB)",
            judge(derived, 1.29e9),
            f"{_gb(derived)} at B=4, S=1024: the rule multiplies by L in the wrong place (see activations-seed-rule)",
            numbers={"derived": derived, "claimed": 1.29e9, "arithmetic": arith},
        )
    )
    at32 = ac.at(B=32, S=1024)
    out.append(
        Claim(
            "1.3b-step-flops",
            "1.3B, batch 32 x 1024 tokens: 6 x 1.3e9 x 32768 = 2.56e14 FLOPs per step",
            "003: about 2.56e14 FLOPs, 2.56 s at 1e14 FLOP/s",
            f"derived matmul FLOPs per step: {_e(at32.flops.total)} (N = {at32.params:,}); "
            f"the arithmetic 6 x 1.3e9 x 32768 = {_e(6 * 1.3e9 * 32768)}",
            judge(at32.flops.total, 2.56e14),
            f"{_e(at32.flops.total)}: add the attention terms (S/(6D) = {1024 / (6 * 2048):.1%} of the layers)",
            numbers={"derived": at32.flops.total, "claimed": 2.56e14},
        )
    )
    est = estimate(params=70e9, tokens=15e12, hardware="H100-SXM", gpus=1024, mfu=0.5)
    out.append(
        Claim(
            "146-days",
            "70B parameters, 15T tokens, 1024 H100 at MFU 0.5: about 146 days",
            "000: 6.3e24 / 5e17 = 1.26e7 s = 146 days",
            f"6ND / (989e12 x 0.5 x 1024) = {est.days:.1f} days (the seed rounds the denominator to 5e17)",
            judge(est.days, 146),
            numbers={"days": est.days, "claimed": 146},
        )
    )
    n40 = max_params(hardware="H100-SXM", gpus=8, bytes_per_param=16, reserve=0)
    out.append(
        Claim(
            "40b-on-8xh100",
            "8 x H100 80 GB with AdamW at 16 bytes/param: about 40B parameters",
            "000: 640e9 / 16 = 40B",
            f"capacity / bytes per parameter (derived 16, claim 16-bytes-fp32) = {n40 / 1e9:.1f}B; "
            f"with a 15 % reserve {max_params(hardware='H100-SXM', gpus=8, bytes_per_param=16) / 1e9:.1f}B",
            judge(n40, 40e9),
            "static memory only: activations and the reserve for the CUDA context and workspaces come on top",
            numbers={"params": n40, "claimed": 40e9},
        )
    )
    llama = _derive("llama", optimizer="mixed_adamw", params_dtype="bf16")
    at7 = llama.at(B=1, S=4096)
    static7 = at7.memory.params + at7.memory.grads + at7.memory.optimizer
    out.append(
        Claim(
            "7b-112gb",
            "7B model: 7e9 x 16 = 112 GB static",
            "003: static cost about 112 GB",
            f"Llama 2 7B (N = {at7.params:,}), mixed_adamw: {_gb(static7)}",
            judge(static7, 112e9),
            numbers={"static": static7, "claimed": 112e9, "params": at7.params},
        )
    )
    inf = _derive("llama", step="forward", params_dtype="bf16")
    w = inf.at(B=1, S=4096).memory.params
    out.append(
        Claim(
            "7b-14gb-inference",
            "7B model, bf16 inference: about 14 GB",
            "003: 2 bytes per parameter",
            f"Llama 2 7B bf16 weights: {_gb(w)}",
            judge(w, 14e9),
            numbers={"weights": w, "claimed": 14e9},
        )
    )
    return out


def catalog() -> list[Claim]:
    """Every claim with its derived verdict (about 20 s: a dozen derivations)."""
    return [*six_nd(), two_bdk(), elementwise(), *bytes_per_param(), *activations(), *formats(), *worked_numbers()]


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
