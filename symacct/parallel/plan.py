"""Step time of a parallel layout, and the planner: every valid layout of a job on N GPUs, ranked.

Step time of the slowest rank (docs/distributed.md):

- compute: each rank's model FLOPs at ``efficiency`` of the accelerator's dense peak of the step's dtype;
  a pipeline's makespan comes from PyTorch's action lists (``symacct.parallel.schedule``), each forward
  and backward of a stage chunk taking its FLOPs' time, plus the send of the boundary activations;
- communication: each collective's wire bytes (ring: ``(n-1)/n`` of the payload for all-gather and
  reduce-scatter, ``2(n-1)/n`` for all-reduce) over the group's link: NVLink (``interconnect_gbs``) when
  the group lies in one node, the network (``network_gbs``, per GPU) when it spans nodes; ranks numbered
  tensor-parallel innermost, then data-parallel, then the pipeline (``symacct.parallel.layout``);
- overlap (an option, on by default, printed with the result): forward collectives hide behind the
  forward's compute and backward ones behind the backward's; what is longer than the compute is exposed;
  the optimizer phase's all-gather (ZeRO-1/2) and a tied weight's all-reduce are never hidden, nor are
  tensor parallelism's collectives (each sits between two matmuls that wait for it). With a pipeline, the
  data-parallel reduction overlaps the last micro-batch's backward only; FSDP2 over a pipeline: its
  all-gathers hide behind the forwards and backwards that issue them, its reduce-scatters (once every
  backward is done, ``perform_reduce_grad``) behind nothing;
- the optimizer: its bytes (read and written in the single-device step) scaled by the rank's share of the
  optimizer states, at the memory bandwidth.

MFU of the whole job: the model FLOPs of the step (``flops.total`` at the micro-batch, times ``m * dp``, and
times ``tp`` for a tensor-parallel rank's derivation) over the step time times the peak times the GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from symacct.errors import SymacctError
from symacct.parallel import rank as _rank
from symacct.parallel import schedule as _schedule
from symacct.parallel.layout import Layout, make_layout
from symacct.parallel.rank import Parallel, Rank, compiled, derive_parallel, optimizer_bytes
from symacct.parallel.schedule import actions, makespan
from symacct.pipeline import no_cycle_collection
from symacct.time.hardware import Accelerator, get
from symacct.time.model import fits_at_most, most

if TYPE_CHECKING:
    from symacct.accounting import Accounting

GIGA = 10**9


@dataclasses.dataclass
class StepTime:
    """Seconds of one step of the slowest rank, and what they are made of."""

    seconds: float
    compute: float  # the rank's forward and backward (a pipeline: the makespan, bubble included)
    bubble: float  # makespan less the rank's own busy time (0 without a pipeline)
    exposed: float  # communication not hidden behind compute
    comm: dict[str, float]  # seconds of each group's collectives, hidden or not
    optimizer: float
    tokens_per_s: float
    mfu: float
    assumptions: list[str]


def clear_caches() -> None:
    """Forget what the schedules' module caches keep from one layout to the next (action lists, their orders,
    a stage's points, makespans): a benchmark's first planner call, as a fresh process has it. The formulas
    and evaluations kept on a derivation stay with it, and so do the caches of compiled formulas
    (``exact_form``, ``integer_forms``) and sympy's own, which a process's first call fills."""
    for fn in (
        actions,
        _schedule.runtime_holds,
        _schedule.interleaved_holds,
        _schedule.fsdp_lowering,
        _schedule.interleaved_fsdp_points,
        _schedule.chunk_gathers,
        _schedule.chunk_unshards,
        _rank._points,
        _rank._peak_points,
        _rank._chunk_peak_points,
        _rank._chunk_fsdp_peak_points,
        _makespan,
    ):
        fn.cache_clear()
    _schedule._MEMO.clear()


def _link(hw: Accelerator, group: str, lay: Layout) -> float:
    """Bytes/s of one GPU's link for a group: NVLink inside a node, the network across nodes. Ranks are
    numbered tensor-parallel innermost, then context-parallel, then data-parallel, then the pipeline
    (``Layout``): a group spans its size times its stride."""
    stride = lay.tp * lay.cp  # of the data-parallel ranks
    span = {
        "tp": lay.tp,
        "cp": stride,
        "dp": lay.dp * stride,
        "dp_cp": lay.dp * stride,
        "dp_shard": lay.shard * stride,
        "dp_shard_cp": lay.shard * stride,
        "dp_replicate": lay.dp * stride,
        "pp": lay.dp * stride * lay.pp,
        "tied": lay.dp * stride * lay.pp,
    }[group]
    if span <= hw.gpus_per_node and hw.interconnect_gbs > 0:
        return hw.interconnect_gbs * GIGA
    if hw.network_gbs is None:
        raise SymacctError(
            f"the {group} group spans {span} GPUs, more than {hw.name}'s node of {hw.gpus_per_node}, and the "
            f"catalog has no network figure for {hw.name}",
            hint="add network_gbs and gpus_per_node to a hardware file (symacct.time.hardware.load)",
        )
    return hw.network_gbs * GIGA


@functools.lru_cache(maxsize=4096)
def _makespan(
    schedule: str, pp: int, m: int, v: int, chunk: tuple[tuple[str, float], ...], peak: float, transfer: float
) -> tuple[float, tuple[float, ...]]:
    """``makespan`` of the schedule's actions, each forward and backward of a stage chunk taking its FLOPs'
    time at ``peak`` (the first stage's and the last's with the model's parts before and after the stack)."""
    ch = dict(chunk)
    last = pp * v - 1

    def duration(a: Any) -> float:
        kind = "forward" if a.kind == "F" else "backward"
        f = ch[kind] + (ch[f"before_{kind}"] if a.stage == 0 else 0) + (ch[f"after_{kind}"] if a.stage == last else 0)
        return f / peak

    span, busy = makespan(actions(schedule, pp, m, v), duration, transfer)
    return span, tuple(busy)


def step_time(
    par: Parallel, hardware: str | Accelerator, *, efficiency: float = 0.5, overlap: bool = True, dtype: str = "bf16"
) -> StepTime:
    """Step time of an evaluated layout (``parallel.at(B=..., S=...)``); see the module docstring."""
    if par.values is None:
        raise SymacctError("step_time needs numbers: pass parallel.at(B=..., S=...)")
    if not 0 < efficiency <= 1:
        raise SymacctError(f"efficiency must be in (0, 1], not {efficiency}")
    hw = get(hardware)
    lay = par.layout
    peak = hw.peak_flops(dtype) * efficiency
    m = lay.micro_batches
    slowest: tuple[float, float, float, float, dict[str, float], float] | None = None  # ..., total
    single_opt = float(par.optimizer_bytes)
    fsdp_pipe = lay.pp > 1 and lay.dp_mode == "fsdp" and lay.replicas > 1
    blocks = par.values.get("L", 1) // (lay.pp * lay.stages_per_rank)
    for r in par.ranks:
        ch = r.chunk
        gathers = {"forward": 0.0, "backward": 0.0}
        comm: dict[str, float] = {}
        by_phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        in_line = 0.0  # tensor parallelism's collectives: between a layer's matmuls, never hidden
        transfer = 0.0
        for c in r.collectives:
            bw = _link(hw, c.group, lay)
            t = float(c.wire) * c.count / bw
            if c.group == "pp":
                transfer = float(c.payload) / bw
                continue
            comm[c.group] = comm.get(c.group, 0.0) + t
            if c.group in ("tp", "cp"):  # between a layer's kernels (the ring waits for its keys and values)
                in_line += t
                continue
            # never hidden: a tied weight's all-reduce; FSDP2's reduce-scatters over a pipeline, which
            # perform_reduce_grad issues once every backward is done
            after = c.group == "tied" or (fsdp_pipe and c.op == "reduce_scatter")
            by_phase["optimizer" if after else c.phase] += t
            if fsdp_pipe and c.op == "all_gather" and c.what == "block parameters":
                gathers[c.phase] = c.count / blocks  # the actions that gather the stage's blocks
        if lay.pp > 1:
            # every rank runs the same schedule: simulated once per schedule, chunk FLOPs and transfer (layouts
            # that differ in their data-parallel mode only share it)
            span, busy = _makespan(
                lay.schedule, lay.pp, m, lay.stages_per_rank, tuple(sorted(ch.items())), peak, transfer
            )
            compute = span
            bubble = span - max(busy)
            fwd_hide = 0.0
            bwd_hide = ch["backward"] / peak if overlap else 0.0  # the last micro-batch's backward of a chunk
            if fsdp_pipe and overlap:  # FSDP2's all-gathers behind the forwards and backwards that issue them
                fwd_hide = gathers["forward"] * ch["forward"] / peak
                bwd_hide = gathers["backward"] * ch["backward"] / peak
        else:
            fwd = m * (ch["forward"] + ch["before_forward"] + ch["after_forward"]) / peak
            bwd = m * (ch["backward"] + ch["before_backward"] + ch["after_backward"]) / peak
            compute, bubble = fwd + bwd, 0.0
            fwd_hide, bwd_hide = (fwd, bwd) if overlap else (0.0, 0.0)
        exposed = (
            max(0.0, by_phase["forward"] - fwd_hide)
            + max(0.0, by_phase["backward"] - bwd_hide)
            + by_phase["optimizer"]
            + in_line
        )
        opt = single_opt * (r.optimizer / par.acct_optimizer) / hw.bandwidth if par.acct_optimizer else 0.0
        total = compute + exposed + opt
        if slowest is None or total > slowest[-1]:
            slowest = (compute, bubble, exposed, opt, comm, total)
    assert slowest is not None
    compute, bubble, exposed, opt, comm, total = slowest
    vals = par.values
    tokens = vals.get("B", 1) * vals.get("S", 1) * m * lay.dp
    job_flops = par.job_flops
    assumptions = [
        f"compute at {efficiency:.0%} of the {dtype} dense peak of {hw.name}",
        "collectives overlap the compute of their phase" if overlap else "no communication overlaps compute",
        *(["tensor-parallel collectives overlap nothing (each sits between two matmuls)"] if lay.tp > 1 else []),
        f"links: NVLink {hw.interconnect_gbs} GB/s inside a node of {hw.gpus_per_node}; network "
        + (f"{hw.network_gbs} GB/s per GPU" if hw.network_gbs else "none in the catalog"),
    ]
    return StepTime(
        total,
        compute,
        bubble,
        exposed,
        comm,
        opt,
        tokens / total,
        job_flops / (total * hw.peak_flops(dtype) * lay.world),
        assumptions,
    )


@dataclasses.dataclass
class PlanRow:
    layout: Layout
    micro_batch: int  # B: sequences per data-parallel rank per micro-batch
    peak: int  # bytes of the worst rank
    worst_stage: str
    fits: bool
    seconds: float
    tokens_per_s: float
    mfu: float
    variant: str | None = None  # which derivation of the model (the CLI's --try-checkpointing), None: the only one

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "dp": lay.dp,
            "tp": lay.tp,
            "sequence_parallel": lay.sequence_parallel,
            "pp": lay.pp,
            "cp": lay.cp,
            "dp_mode": lay.dp_mode,
            "hsdp_shard": lay.hsdp_shard,
            "schedule": lay.schedule if lay.pp > 1 else None,
            "micro_batches": lay.micro_batches,
            "v": lay.stages_per_rank,
            "micro_batch": self.micro_batch,
            "peak_bytes": self.peak,
            "worst_stage": self.worst_stage,
            "fits": self.fits,
            "step_seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "variant": self.variant,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_valid(acct: Accounting, tp: int, seq: int | None) -> str | None:
    """Why ``acct`` (one tensor-parallel rank's derivation) cannot run tp ranks, or None: its constraints
    (tp dividing the heads, F, V, S with sequence parallelism)."""
    return _sizes_refused(acct, {"tp": tp, "B": 1, **({"S": seq} if seq is not None else {})})


def _sizes_refused(acct: Accounting, values: dict[str, int]) -> str | None:
    """Why the derivation's constraints refuse these sizes (a context-parallel rank's: S into 2 cp chunks),
    or None."""
    try:
        acct._validate(values)
    except SymacctError as e:
        return e.what
    return None


def layouts(
    acct: Accounting,
    gpus: int,
    global_batch: int,
    *,
    dp_modes: tuple[str, ...] | None = None,
    return_outputs: bool = False,
    tensor_parallel: Mapping[int, Accounting] | None = None,
    seq: int | None = None,
    context_parallel: Mapping[int, Accounting] | None = None,
    fsdp_policy: tuple[str, str | None] | None = None,
    context_tensor_parallel: Mapping[tuple[int, int], Accounting] | None = None,
) -> list[tuple[Layout, int]]:
    """Every valid (layout, micro-batch) of ``gpus`` GPUs for ``global_batch`` sequences a step; refused with
    the reasons when there is none. A pipeline's last stage keeps its outputs only with ``return_outputs``
    (``schedule.step(return_outputs=False)``, what a training loop passes, is the default here).
    ``tensor_parallel``: tensor-parallel degrees to try, each with its rank's derivation (``derive(...,
    tensor_parallel=plan, tp=degree)``); ``context_parallel``: context-parallel degrees, each with its ring
    rank's derivation (``derive(..., context_parallel=degree)``), laid out as the others are (the
    gradients reduced over ``dp x cp`` ranks; HSDP's shard group from 1 x cp). A degree that does not
    divide the GPUs (or, for cp, S into 2 cp chunks) or that the derivation's constraints refuse is left
    out, with the reason.
    ``context_tensor_parallel``: (tp, cp) pairs, each with its rank's derivation (``derive(...,
    tensor_parallel=plan, tp=tp, context_parallel=cp)``), tried as the context-parallel degrees are.
    ``fsdp_policy``: (param_dtype, reduce_dtype) of FSDP2's MixedPrecisionPolicy, on every FSDP2 and HSDP
    layout."""
    from symacct.parallel.layout import DP_MODES

    modes = dp_modes or DP_MODES
    L = acct.symbols.get("L") if acct.per_layer else None
    out: list[tuple[Layout, int]] = []
    reasons: list[str] = []
    degrees = [(1, acct)] + sorted((tensor_parallel or {}).items())
    for tp, rank_acct in degrees:
        if gpus % tp:
            reasons.append(f"tp={tp}: does not divide {gpus} GPUs")
            continue
        why = _tp_valid(rank_acct, tp, seq) if tp > 1 else None
        if why is not None:
            reasons.append(f"tp={tp}: {why}")
            continue
        sp = tp > 1 and rank_acct.options.get("tensor_parallel") == "megatron-sp"
        out += _layouts_at(L, gpus // tp, tp, sp, global_batch, modes, return_outputs, reasons, policy=fsdp_policy)
    rings = {(1, cp): a for cp, a in (context_parallel or {}).items()} | dict(context_tensor_parallel or {})
    for (tp, cp), rank_acct in sorted(rings.items()):
        name = f"cp={cp}" + (f" x tp={tp}" if tp > 1 else "")
        traced = rank_acct.options.get("context_parallel")
        if traced != cp or (tp > 1) != bool(rank_acct.options.get("tensor_parallel")):
            raise SymacctError(
                f"the derivation given for {name} is one of cp={traced or 1}"
                + (", tensor parallel" if rank_acct.options.get("tensor_parallel") else ""),
                hint=f"derive(model, context_parallel={cp}"
                + (f", tensor_parallel=plan, tp={tp}" if tp > 1 else "")
                + ", ...)",
            )
        if gpus % (cp * tp):
            reasons.append(f"{name}: does not divide {gpus} GPUs")
            continue
        sizes = {"B": 1, **({"tp": tp} if tp > 1 else {}), **({"S": seq} if seq is not None else {})}
        why = _sizes_refused(rank_acct, sizes)
        if why is not None:
            reasons.append(f"{name}: {why}")
            continue
        sp = tp > 1 and rank_acct.options.get("tensor_parallel") == "megatron-sp"
        out += _layouts_at(
            L, gpus // (cp * tp), tp, sp, global_batch, modes, return_outputs, reasons, cp=cp, policy=fsdp_policy
        )
    if not out:
        raise SymacctError(
            f"no valid layout of {gpus} GPUs for a global batch of {global_batch}: " + "; ".join(reasons[:6]),
            hint="choose a global batch and a GPU count whose divisors fit the model's layers",
        )
    return out


def _layouts_at(
    L: int | None,
    gpus: int,
    tp: int,
    sp: bool,
    global_batch: int,
    modes: tuple[str, ...],
    return_outputs: bool,
    reasons: list[str],
    cp: int = 1,
    policy: tuple[str, str | None] | None = None,
) -> list[tuple[Layout, int]]:
    """The (layout, micro-batch) pairs of ``gpus`` groups of ``tp x cp`` ranks (tensor-parallel groups, each
    in a context-parallel ring of ``cp``): data parallelism, HSDP and pipelines over them; ``policy`` on the
    FSDP2 ones."""
    out: list[tuple[Layout, int]] = []
    deg: dict[str, Any] = {"tp": tp, "sequence_parallel": sp} | ({"cp": cp} if cp > 1 else {})
    mixed = {"param_dtype": policy[0], "reduce_dtype": policy[1]} if policy else {}
    hsdp_from = 0 if cp > 1 else 1  # with cp, a shard group of 1 x cp (sharded over the ring, replicated over dp)
    for pp in _divisors(gpus):
        if pp > 1 and (L is None or L % pp):
            reasons.append(f"pp={pp}: does not divide the {L} layers" if L else f"pp={pp}: no layer stack")
            continue
        dp = gpus // pp
        if global_batch % dp:
            reasons.append(f"dp={dp}: does not divide the global batch {global_batch}")
            continue
        for b in _divisors(global_batch // dp):
            m = global_batch // (dp * b)
            for mode in modes:
                piped_fsdp = pp > 1 and dp * cp > 1 and mode == "fsdp"  # FSDP2 (or HSDP) over a pipeline's stages
                if dp * cp == 1 and mode != "ddp" or pp > 1 and mode == "zero2" and dp * cp > 1:
                    continue
                if tp > 1 and dp * cp > 1 and mode != "fsdp":  # data parallelism over tp ranks: FSDP2's
                    continue
                own = mixed if mode == "fsdp" else {}
                if pp == 1:
                    out.append((make_layout(dp=dp, dp_mode=mode, micro_batches=m, **deg, **own), b))
                    if mode == "fsdp":  # HSDP: sharded over each proper divisor of dp (x cp), replicated
                        for shard in _divisors(dp)[hsdp_from:-1]:
                            lay = make_layout(dp=dp, dp_mode=mode, micro_batches=m, hsdp_shard=shard, **deg, **own)
                            out.append((lay, b))
                    continue
                kw = {"dp": dp, "pp": pp, "dp_mode": mode, "micro_batches": m, "return_outputs": return_outputs, **own}
                # HSDP over each stage too: sharded over each proper divisor of dp, replicated
                shards = [None, *_divisors(dp)[hsdp_from:-1]] if piped_fsdp else [None]
                for shard in shards:
                    hsdp = {"hsdp_shard": shard} if shard else {}
                    out.append((make_layout(schedule="gpipe", **kw, **hsdp, **deg), b))
                    if m >= pp:
                        out.append((make_layout(schedule="1f1b", **kw, **hsdp, **deg), b))
                    if L and L % (2 * pp) == 0 and m % pp == 0:
                        out.append((make_layout(schedule="interleaved", stages_per_rank=2, **kw, **hsdp, **deg), b))
    return out


def plan(
    acct: Accounting,
    *,
    gpus: int,
    hardware: str | Accelerator,
    global_batch: int,
    seq: int,
    efficiency: float = 0.5,
    overlap: bool = True,
    reserve: float = 0.15,
    dtype: str = "bf16",
    dp_modes: tuple[str, ...] | None = None,
    return_outputs: bool = False,
    tensor_parallel: Mapping[int, Accounting] | None = None,
    context_parallel: Mapping[int, Accounting] | None = None,
    fsdp_policy: tuple[str, str | None] | None = None,
    compute: Mapping[tuple[int, int], Accounting] | None = None,
    context_tensor_parallel: Mapping[tuple[int, int], Accounting] | None = None,
) -> list[PlanRow]:
    """Every valid layout, evaluated and ranked: fitting ones first, then by step time (see the module
    docstring); ``reserve`` is the fraction of memory kept free (allocator, workspaces); ``tensor_parallel``,
    ``context_parallel`` and ``context_tensor_parallel`` as for ``layouts``.

    ``fsdp_policy`` (param_dtype, reduce_dtype): FSDP2 with its MixedPrecisionPolicy, the layouts FSDP2 and
    HSDP only (the other modes would train in another precision); ``acct`` and the rank derivations are the
    model in its own dtype (the shards', the optimizer's), and ``compute[(tp, cp)]`` the same rank traced with
    its parameters in param_dtype as FSDP2's policy runs them (``derive(..., params_dtype=...,
    fsdp_policy=True)``, ``derive_parallel``'s ``compute``), for (1, 1) and each degree given."""
    hw = get(hardware)
    capacity = hw.memory_bytes * (1 - reserve)
    if fsdp_policy is not None:
        if dp_modes is not None and tuple(dp_modes) != ("fsdp",):
            raise SymacctError(
                "an FSDP2 MixedPrecisionPolicy plans FSDP2 and HSDP only", hint="drop dp_modes (or pass ('fsdp',))"
            )
        dp_modes = ("fsdp",)
    elif compute:
        raise SymacctError("compute= is FSDP2's mixed-precision trace: it goes with fsdp_policy=")
    # many short-lived objects: the cycle collector would take a fifth of the time
    with no_cycle_collection():
        rows = []
        accts = {(1, 1): acct}
        accts |= {(tp, 1): a for tp, a in (tensor_parallel or {}).items()}
        accts |= {(1, cp): a for cp, a in (context_parallel or {}).items()}
        accts |= dict(context_tensor_parallel or {})
        fast = {key: _Fast(a, seq) for key, a in accts.items()}
        found = layouts(
            acct, gpus, global_batch, dp_modes=dp_modes, return_outputs=return_outputs, tensor_parallel=tensor_parallel,
            seq=seq, context_parallel=context_parallel, fsdp_policy=fsdp_policy,
            context_tensor_parallel=context_tensor_parallel,
        )  # fmt: skip
        for lay, b in found:
            key = (lay.tp, lay.cp)
            run = None
            if lay.param_dtype is not None:
                run = (compute or {}).get(key)
                if run is None:
                    raise SymacctError(
                        f"the FSDP2 policy's layouts with tp={lay.tp}, cp={lay.cp} need that rank traced with its "
                        f"parameters in {lay.param_dtype}",
                        hint=f"compute={{{key}: derive(model, params_dtype={lay.param_dtype!r}, fsdp_policy=True, "
                        "...)}} (the CLI does it for --fsdp-param-dtype)",
                    )
            par = fast[key].at(derive_parallel(accts[key], lay, run, peak_formulas=False), b)
            t = step_time(par, hw, efficiency=efficiency, overlap=overlap, dtype=dtype)
            worst = max(par.ranks, key=lambda r: r.peak)
            rows.append(
                PlanRow(lay, b, worst.peak, worst.stage, worst.peak <= capacity, t.seconds, t.tokens_per_s, t.mfu)
            )
        rows.sort(key=lambda r: (not r.fits, r.seconds, r.peak))
        return rows


class _Fast:
    """Parallel formulas evaluated exactly, each compiled to Python once (``exact_form``): the planner's path."""

    def __init__(self, acct: Accounting, seq: int) -> None:
        self.acct = acct
        self.seq = seq
        self._sizes: dict[tuple[int, int], dict[str, int]] = {}

    def at(self, par: Parallel, B: int) -> Parallel:
        """``par.at(B=B, S=seq)``: the same figures (peaks exactly where ``Parallel.at`` evaluates them so)."""
        values = {**self.acct.symbols, "B": B, "S": self.seq, **par.degrees()}
        lay = par.layout
        ranks = par.evaluated_ranks(values, self._ev)
        if par.replicated():  # as Parallel.at: every op, exactly
            ranks = par.replica_peaks(ranks, self._model_sizes(B, lay))
        elif par.overlay is not None:  # FSDP2: exactly, at every point (Parallel.at)
            ranks = par.overlay_peaks(ranks, {**self._model_sizes(B, lay), **par.degrees()})
        elif lay.pp > 1:  # a pipeline: exactly, at every point of the schedule (Parallel.at)
            ranks = par.pipeline_peaks(ranks, {**self._model_sizes(B, lay), **par.degrees()})
        out = dataclasses.replace(par, ranks=ranks, values=values)
        model_flops = (par.compute or self.acct).flops.total  # FSDP2's policy: the trace forward and backward run
        out.job_flops = self._ev(model_flops, values) * lay.micro_batches * lay.dp * lay.tp * lay.cp
        out.optimizer_bytes = self._ev(optimizer_bytes(self.acct), values)
        out.acct_optimizer = self._ev(self.acct.memory.optimizer, values)
        return out

    def _model_sizes(self, B: int, lay: Layout) -> dict[str, int]:
        key = (B, lay.tp)
        if key not in self._sizes:
            tp = {"tp": lay.tp} if lay.tp > 1 else {}
            self._sizes[key] = self.acct.values_at(B=B, S=self.seq, **tp)
        return self._sizes[key]

    def _ev(self, e: Any, vals: dict[str, int]) -> Any:
        if isinstance(e, int):
            return e
        got = compiled(self.acct, e)(vals)  # by identity: comparing two large formulas costs
        return got if isinstance(got, int) else round(got)


@dataclasses.dataclass
class LayoutFit:
    """The largest micro-batch B of one data-parallel rank whose worst rank fits, and the peaks around it."""

    layout: Layout
    micro_batch: int  # 0: not even B = 1 fits
    peak: int  # worst rank's peak at micro_batch (at B = 1 when nothing fits)
    next_peak: int | None  # at micro_batch + 1; None where micro_batch is the largest B the formulas hold at
    budget: int
    worst_stage: str
    global_batch: int  # micro_batch * m * dp
    notes: list[str] = dataclasses.field(default_factory=list)


def fit_layout(
    acct: Accounting,
    layout: Layout,
    *,
    hardware: str | Accelerator,
    seq: int,
    reserve: float = 0.15,
    limit: int = 1 << 20,
    compute: Accounting | None = None,
) -> LayoutFit:
    """Largest B (per data-parallel rank and micro-batch) whose worst rank's peak fits the accelerator's memory
    less ``reserve``; peaks are evaluated exactly (``Parallel.at``) and grow with B. ``compute``: FSDP2's
    mixed-precision trace (``derive_parallel``)."""
    hw = get(hardware)
    par = derive_parallel(acct, layout, compute, peak_formulas=False)
    budget = int(hw.memory_bytes * (1 - reserve))

    def worst(B: int) -> Rank:
        return max(par.at(B=B, S=seq).ranks, key=lambda r: r.peak)

    top = most(acct, "B")  # the largest B the formulas hold at (above it the model takes another path)
    lo, hi, capped = 0, 1, False
    while hi <= limit:
        if top is not None and hi >= top:  # doubling reached the bound: B = top fits, or the answer is below
            capped = worst(top).peak <= budget
            lo, hi = (top, top) if capped else (lo, top)
            break
        if worst(hi).peak > budget:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if worst(mid).peak <= budget:
            lo = mid
        else:
            hi = mid
    at = worst(max(lo, 1))
    nxt = None if capped else int(worst(lo + 1).peak)
    notes = [fits_at_most("B", lo)] if capped else []
    global_batch = lo * layout.micro_batches * layout.dp
    return LayoutFit(layout, lo, int(at.peak), nxt, budget, at.stage, global_batch, notes)
