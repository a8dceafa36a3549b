"""Probe sizes, and how a traced integer becomes a product of symbols.

Each symbol gets a probe value that carries a prime of its own (233 and up in the first probe), so a
traced dimension factors uniquely into symbols: 2*D/H, 3*D, B*S... The small
primes 2, 3, 5, 7 are left for constants. Structure the models need is
built in: k (experts per token) below every other size (E), H a multiple of
H_kv, D a multiple of 8*H (a head width divisible by 4: rotary halves, and
the quarter or half widths of partial rotary embeddings), S_max the largest value (positions >= S). Heads are as wide as
real ones (D/H = 8*29 = 232 in the first probe, see ``HEAD_PRIMES``): kernels
pick their path by the head width.

A dimension that leaves a foreign prime after division by the symbols' own
primes is not a product of the model's symbols; :func:`Probe.to_expr`
returns None for it, and derive raises naming the tensor. A second probe
with other primes checks every formula against a second trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from symacct.symbols import sym

SMALL_PRIMES = (2, 3, 5, 7)
HEAD_WIDTHS = ("head_dim", "kv_channels", "d_kv", "head_size", "attention_head_size")
OFFSETS = (-4, -3, -2, -1, 1, 2, 3, 4)  # a size may be a symbol plus one of these (S - 1, S_max + 2)


def _offset_safe(p: int, others: set[int]) -> bool:
    """Whether every p + c (c in OFFSETS) has a prime factor above 7 that is neither p nor in ``others``."""
    return all(
        any(q > SMALL_PRIMES[-1] and q != p and q not in others for q in sympy.factorint(p + c)) for c in OFFSETS
    )


def offset_safe_primes(n: int, start: int = 11) -> tuple[int, ...]:
    """The first ``n`` primes from ``start`` whose neighbours p + c all carry a foreign prime (see Probe.to_expr)."""
    out: list[int] = []
    p = start - 1
    while len(out) < n:
        p = int(sympy.nextprime(p))
        if _offset_safe(p, set(out)):
            out.append(p)
    assert all(_offset_safe(p, set(out) - {p}) for p in out)
    return tuple(out)


# first probe: primes whose neighbours p + c are never products of symbols and small constants, so that
# S - 1 or S_max + 2 cannot be read as a constant by accident (see Probe.to_expr)
FIRST_PRIMES = offset_safe_primes(11)  # 233, 263, 307, ...
SECOND_PRIMES = (53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101)
# own primes of the per-head width D/H (and of a head width of its own, head_dim): small, so that a head is
# 8*29 = 232 or 8*31 = 248 wide as real heads are (64..256). Kernels choose their path by the head width
# (transformers' SDPA uses grouped-query SDPA only up to 256, flash kernels stop at 256): a probe head wider
# than any real one would trace another path than the user's model takes.
HEAD_PRIMES = ((29, 23, 19), (31, 17, 13))  # first probe, second probe
LAYERS = (4, 5)  # probe values of L in the first and second trace
# the second trace's lengths are even (the first's are odd primes), each twice a small prime of its own: a step
# whose path turns on a length's parity (``if S % 2``, a pad to an even length) then traces other ops or
# sizes in the second trace, which refuses it, where two odd probes would derive the odd side for the even
# sizes users run. The primes are small so that the lengths stay as long as the other primes of the second
# trace make its sizes (74 ... 94): a size threshold between the two probes' lengths is refused the same way.
# They are the tensor-parallel degrees' primes that neither probe's degree takes (TP_PRIMES), and never a
# prime of the first probe, so the two probes share none; a length left without one stays odd.
EVEN_LENGTHS = ("S", "C")
# own primes of a tensor-parallel degree tp in the first and second trace (fake process groups of that many
# ranks): small, as no head width takes them; and the sizes besides the heads that a plan may split
TP_PRIMES = (11, 37, 41, 43, 47)  # the first two not taken by a constant
TP_SPLIT = ("F", "V")
TP_SEQUENCE = ("S", "S_max")  # split by sequence parallelism only


def _factor(v: int, primes: list[int]) -> tuple[dict[int, int], int]:
    vec: dict[int, int] = {}
    for p in primes:
        while v % p == 0:
            vec[p] = vec.get(p, 0) + 1
            v //= p
    return vec, v


@dataclass
class Probe:
    """Probe values for a set of symbols (L excluded: it is structural)."""

    values: dict[str, int]
    own: dict[str, int]  # symbol -> its own prime
    vectors: dict[str, dict[int, int]]  # symbol -> prime exponents of its value
    order: list[str]  # construction order (later symbols may contain earlier ones)
    layers: int | None = None
    strict: bool = True  # False: a foreign factor is kept as a constant (models without config)
    constants: tuple[int, ...] = SMALL_PRIMES  # primes that constants may carry
    _cache: dict[int, sympy.Expr | None] = field(default_factory=dict)

    offsets: bool = False  # read m * (X + c) too (the first probe's primes are chosen for it)
    cuts: tuple[int, ...] = ()  # widths kept at their values: m * (X - k) read too (a head less its rotary part)
    # sizes a kernel rounds up: value -> (multiple, the size it rounds), read as multiple*ceiling(X/multiple)
    padded: dict[int, tuple[int, int]] = field(default_factory=dict)

    def pad(self, sizes: dict[int, tuple[int, int]]) -> None:
        """Read each of ``sizes`` (a traced value -> (multiple, the traced size it rounds up)) as that size
        rounded up: the trace says which op made it (``symacct.trace.record.padded_sizes``), so a value no
        product of symbols gives (the memory-efficient kernel's logsumexp rows, 32*ceiling(S/32)) is read
        only where such a kernel ran; a genuine constant of the same value is then misread, and the second
        trace refuses it."""
        for v, how in sizes.items():
            if self.padded.get(v, how) != how:
                self._cache[v] = None  # two roundings to one value: no reading
                continue
            self.padded[v] = how
            self._cache.pop(v, None)

    def to_expr(self, v: int) -> sympy.Expr | None:
        """The monomial (rational constant times symbol powers) equal to ``v``, else ``m * (X + c)``, else None.

        ``m * (X + c)``: a monomial times one symbol shifted by a small constant
        (``B*(S - 1)`` from a shifted causal-LM loss, ``S_max + 2`` from OPT's
        position table). The first probe's primes are chosen so that every
        ``p + c`` carries a prime of no symbol: such a value never factors as a
        plain monomial, and a plain monomial never as a shifted one. When more
        than one reading fits, none is taken. The second trace checks every
        reading either way.
        """
        if v in self._cache:
            return self._cache[v]
        if v in self.padded:  # a kernel's rounded-up size (see ``pad``)
            multiple, of = self.padded[v]
            x = self.to_expr(of)
            self._cache[v] = None if x is None else multiple * sympy.ceiling(x / multiple)
            return self._cache[v]
        expr = self._monomial(v)
        if expr is None and self.offsets:
            expr = self._shifted(v)
        self._cache[v] = expr
        return expr

    def _shifted(self, v: int) -> sympy.Expr | None:
        """``m * (X + c)`` or ``m * (X + k*Y)`` equal to ``v``: the reading whose monomial ``m`` has the smallest
        constant.

        ``X + c``: a symbol shifted by a small constant (S - 1), or a whole quotient
        of two symbols or its square (a ViT's (image_size/patch_size)**2 patches
        and its class token). ``X + k*Y``: two
        symbols (a fused QKV projection with grouped heads has (H + 2*H_kv)*D/H
        outputs). Neighbours of two probe primes can share a prime (262 = 2*131
        and 655 = 5*131), so a value may divide by a wrong ``X + c`` and leave
        small constants behind (10*D*(X - 1) for 4*D*(S_max + 2)): the reading
        in the fewest symbols is taken, then the one that leaves the least
        constant, none on a tie (a multi-query QKV width D + 2*D/H is also
        3*D/(8*H) * (S + V) at the first probe); the second trace refuses a
        wrong one.
        """
        shifts: list[tuple[int, sympy.Expr]] = []
        shiftable = [n for n in self.order if n != "tp"]  # a degree is never shifted (tp - 1 is 2*5 at 11)
        bases = [(self.values[n], sym(n)) for n in shiftable]
        for name in shiftable:  # whole quotients (patches per side: image_size/patch_size) and their squares
            for other in shiftable:
                if other != name and self.values[name] % self.values[other] == 0:
                    q = self.values[name] // self.values[other]
                    bases += [(q, sym(name) / sym(other)), (q * q, (sym(name) / sym(other)) ** 2)]
        for base, form in bases:  # a ViT's patches plus its class token: (image_size/patch_size)**2 + 1
            shifts += [(base + c, form + c) for c in (*OFFSETS, *(-k for k in self.cuts))]
        for name in shiftable:
            for other in shiftable:
                if other != name:
                    shifts += [(self.values[name] + k * self.values[other], sym(name) + k * sym(other)) for k in (1, 2)]
        found: dict[sympy.Expr, sympy.Expr] = {}
        for q, form in shifts:
            if q > 1 and v % q == 0:
                m = self._monomial(v // q)
                if m is not None and m != 0:
                    expr = sympy.expand(m * form)
                    found[expr] = (len(expr.free_symbols), sympy.Abs(m.as_coeff_Mul()[0]))
        if not found:
            return None
        best = min(found.values())
        top = [e for e, k in found.items() if k == best]
        return top[0] if len(top) == 1 else None

    def _monomial(self, v: int) -> sympy.Expr | None:
        expr: sympy.Expr | None
        if v <= 0:
            expr = sympy.Integer(v)
        else:
            big = sorted(set(self.own.values()))
            vec, rest = _factor(v, big)
            small, rest = _factor(rest, list(self.constants))
            if rest != 1 and self.strict:
                expr = None
            else:
                for p, e in small.items():
                    vec[p] = vec.get(p, 0) + e
                expr = sympy.Integer(1)
                for name in reversed(self.order):
                    e = vec.get(self.own[name], 0)
                    if e:
                        expr = expr * sym(name) ** e
                        for p, k in self.vectors[name].items():
                            vec[p] = vec.get(p, 0) - e * k
                const = sympy.Rational(1)
                for p, e in vec.items():
                    if e and p not in self.constants:  # cannot happen: own primes are unique
                        raise AssertionError(f"probe factorisation left prime {p}")
                    const *= sympy.Rational(p) ** e
                expr = const * rest * expr
        return expr
        return expr


def make_probe(
    names: list[str],
    primes: tuple[int, ...],
    layers: int | None,
    strict: bool = True,
    avoid: set[int] | None = None,
    offsets: bool = False,
    head_primes: tuple[int, ...] = HEAD_PRIMES[0],
    heads: int = 1,
    scale: dict[str, int] | None = None,
    tp_prime: int | None = None,
    tp_sequence: bool = True,
    cuts: tuple[int, ...] = (),
    even: tuple[str, ...] = (),
) -> Probe:
    """Probe values for ``names``; H_kv | H, 8H | D, patch_size | image_size, S_max largest.

    ``avoid``: primes of constants (fixed fields' values) that no symbol may use.
    ``offsets``: read shifted sizes (``S - 1``); every prime then keeps the
    property of :func:`offset_safe_primes` against the constants' primes too.
    ``head_primes``: the own primes of the head widths (D/H, head_dim), in
    that order: D/H = 8 * head_primes[0].
    ``heads``: the head count when it is not a symbol (kept at its value):
    D is then 8 * heads * its prime, so that D/H stays a whole, even width.
    ``scale``: a constant factor of a symbol's value (S = 64 * prime for a
    network that halves its image side: strided convolutions and pooling
    then give S/2, S/4, ... instead of rounded sizes).
    ``tp_prime``: the own prime of ``tp`` (a tensor-parallel degree, in
    ``names``): small, as it is a fake process group's world size; the
    sizes a plan may split (the key/value heads, or the heads, F, V, S and
    S_max) are multiples of it, so that every rank's shard is whole.
    ``tp_sequence``: whether S and S_max are among them (a plan that may
    split the sequence); without, S stays a prime of its own, as small as
    without tensor parallelism (a sliding window's side is the user's).
    ``cuts``: widths kept at their values (``offsets`` only): a head width
    less one of them (GPT-J's head less its rotary part, 256 - 64) is read as
    such, so the head primes whose widths less each cut keep a prime above 7
    come first (8 * 29 - 64 = 168 would read as a constant).
    ``even``: sizes probed even, each twice a prime of ``TP_PRIMES`` that no
    degree and no constant takes (the second trace's lengths, see
    ``EVEN_LENGTHS``).
    """
    avoid = avoid or set()
    widths = [n for n in ("D", *HEAD_WIDTHS) if n in names]

    def cut_safe(p: int) -> bool:
        return all(
            any(q > SMALL_PRIMES[-1] and q not in avoid for q in sympy.factorint(8 * p - k)) for k in cuts if k < 8 * p
        )

    head_pool = sorted((p for p in head_primes if p not in avoid), key=lambda p: not cut_safe(p))  # stable
    if len(head_pool) < len(widths):
        widths = widths[: len(head_pool)]  # the rest take large primes (wide heads), the second trace checks them
    head_own = dict(zip(widths, head_pool))
    avoid_all = avoid | set(head_own.values()) | ({tp_prime} if tp_prime is not None else set())  # tp: S - 1 too

    def usable(p: int, taken: set[int]) -> bool:
        return p not in avoid_all and (not offsets or _offset_safe(p, taken | avoid_all))

    pool = [p for p in primes if usable(p, set(primes) - {p})]
    extra = primes[-1]
    while len(pool) < len(names) + 1:
        extra = int(sympy.nextprime(extra))
        if usable(extra, set(pool)):
            pool.append(extra)
    # the degrees' primes no degree takes: with a degree, the two probes' are 11 and 37 (37 and 41 where a
    # constant takes 11), so the first two from 37 on are skipped; never a prime of the first probe, whose
    # other primes are its head widths' and larger ones
    free = [q for q in TP_PRIMES if q not in avoid and q >= 37]
    evens = [q for q in free[2 if tp_prime is not None else 0 :] if q not in avoid_all]
    even_own = dict(zip([n for n in even if n in names], evens))
    firsts = [n for n in ("tp", "patch_size", "k", "H_kv", "H", "D") if n in names]  # k (experts per token) < E
    heads_tp = next((n for n in ("H_kv", "H") if n in names), None)
    split = {heads_tp, *TP_SPLIT, *(TP_SEQUENCE if tp_sequence else ())} if tp_prime is not None else set()
    middle = sorted(n for n in names if n not in firsts and n != "S_max")
    order = firsts + middle + (["S_max"] if "S_max" in names else [])
    own: dict[str, int] = {}
    vectors: dict[str, dict[int, int]] = {}
    values: dict[str, int] = {}
    small = iter(pool[:-1])
    for name in order:
        if name == "tp":
            if tp_prime is None:
                raise AssertionError("probe: tp needs tp_prime")
            p = tp_prime
        else:
            p = pool[-1] if name == "S_max" else head_own[name] if name in head_own else next(small)
        p = even_own.get(name, p)
        own[name] = p
        vec = {p: 1}
        if name in even_own:
            vec[2] = 1
        if name in split:  # a size a tensor-parallel plan may split: whole shards
            vec[tp_prime] = vec.get(tp_prime, 0) + 1  # type: ignore[index]
        if name == "image_size" and "patch_size" in values:  # whole patches: image_size / patch_size a prime
            vec.update(vectors["patch_size"])
        if name == "H" and "H_kv" in values:
            vec.update(vectors["H_kv"])
        if name == "D":
            if "H" in values:
                vec.update(vectors["H"])
            else:  # heads kept at their value: a constant factor of D
                for q, e in sympy.factorint(heads).items():
                    vec[q] = vec.get(q, 0) + e
            vec[2] = vec.get(2, 0) + 3  # D/H a multiple of 8: rotary halves and quarter (partial) rotary widths
        if name in HEAD_WIDTHS:  # a head width of its own (head_dim != D/H): a multiple of 8 as D/H is
            vec[2] = vec.get(2, 0) + 3
        for q, e in sympy.factorint((scale or {}).get(name, 1)).items():
            vec[q] = vec.get(q, 0) + e
        vectors[name] = vec
        values[name] = int(sympy.prod(q**e for q, e in vec.items()))
    if "S_max" in values and "S" in values and values["S_max"] <= values["S"]:
        raise AssertionError("probe: S_max must exceed S")
    constants = tuple(sorted(set(SMALL_PRIMES) | avoid))  # avoid: the constants' primes, never a head's
    return Probe(values, own, vectors, order, layers, strict, constants, offsets=offsets and strict, cuts=cuts)
