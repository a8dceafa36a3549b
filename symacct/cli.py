"""Command line: argument parsing and printing only.

``symacct derive MODEL [--config KEY=VALUE ...] [--batch B] [--seq S] [--optimizer NAME] [--json]``
``symacct estimate [MODEL] --tokens T --hardware NAME [--params N] [--gpus G] [--mfu M] [--json]``
``symacct fit [MODEL] --hardware NAME [--gpus G] [--optimizer NAME] [--reserve R] [--solve batch|seq|layers]``
``symacct sheet MODEL [--format text|md|tex|json] [--out DIR] ...`` / ``symacct check [--json]``
``symacct list`` / ``symacct hardware``
``symacct derive MODEL --dp N [--pp N --schedule S --micro-batches M ...] [--hardware NAME]``: per-rank figures
``symacct plan MODEL --gpus N --hardware NAME --seq S --global-batch G [--json] [--out DIR]``

MODEL is a built-in name (``symacct list``) or ``package.module:factory``
(a callable returning an ``nn.Module`` with a ``config`` and
``example_inputs``). Errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symacct.errors import SymacctError
from symacct.models.loading import UsageError, load_model, overrides_of


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (exit code 2) like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"symacct: error: {self.prog.removeprefix('symacct ')}: {message}", file=sys.stderr)
        sys.exit(2)


def _derive_report(args: argparse.Namespace) -> dict[str, Any]:
    from symacct.pipeline import derive
    from symacct.report.summary import reserved_summary, summary
    from symacct.time.hardware import get as get_hardware

    model = load_model(args.model, overrides_of(args.config))
    acct = derive(model, causal_discount=args.causal_discount, **_step_options(args))
    B = args.batch
    S = args.seq if args.seq is not None else acct.symbols.get("S_max", 1)
    report = summary(acct, B=B, S=S, name=args.model)
    if args.reserved:
        sizes = {"B": B, "S": S} if "S" in acct.free_symbols() else {"B": B}
        r = acct.reserved(steps=args.reserved, hardware=args.hardware, **sizes)
        source = get_hardware(args.hardware).cuda_context_source if args.hardware else ""
        report["reserved"] = reserved_summary(r, source)
    return report


def _step_options(args: argparse.Namespace) -> dict[str, Any]:
    """derive's keyword arguments for the traced step, from --step, --optimizer, --autocast, --params-dtype."""
    return {
        "step": args.step,
        "optimizer": args.optimizer if args.step == "train" else None,
        "autocast": args.autocast,
        "params_dtype": args.params_dtype,
        "device": args.device,
        "sdpa_backend": args.sdpa_backend,
        # on CUDA, the GPU named by --hardware chooses the kernels (SDPA) as PyTorch does on it
        "hardware": getattr(args, "hardware", None) if args.device.startswith("cuda") else None,
    }


def _writable(out: str) -> Path:
    """Create --out (and check it can be written) before any work, so nothing is written half-way."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"cannot write to --out {out!r}: {e.strerror or e}") from e
    return path


def _sheet(args: argparse.Namespace) -> int:
    from symacct.report import sheet
    from symacct.report.reference import SheetConfig, make_sheet
    from symacct.time.hardware import get

    if args.batch <= 0 or args.seq is not None and args.seq <= 0:
        raise UsageError("--batch and --seq must be positive integers")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu:g}")
    get(args.hardware)  # an unknown accelerator fails before the derivation
    out = _writable(args.out) if args.out else None
    from symacct.report.terminal import progress

    C = args.context - 1 if args.context is not None else None
    if args.step == "decode" and args.seq is not None:
        raise UsageError("a decode step runs one new token: give the context with --context, not --seq")
    cfg = SheetConfig(args.model, args.batch, args.seq, _step_options(args), overrides_of(args.config), C=C)
    with progress(f"deriving {args.model}"):
        acct, sh = make_sheet(cfg, hardware=args.hardware, mfu=args.mfu)
    if out is None:
        if args.format == "text":
            from symacct.report.terminal import print_sheet

            print_sheet(sh)
        else:
            sys.stdout.write(sheet.RENDERERS[args.format](sh))
        return 0
    formats = list(sheet.RENDERERS) if args.format == "text" else [args.format]
    written = sheet.write(acct, sh, out, formats=formats, plots=not args.no_plots)
    for p in written:
        print(p)
    return 0


def _check(args: argparse.Namespace) -> int:
    from symacct.report.check import catalog, render_md
    from symacct.report.terminal import print_claims, progress

    with progress("deriving the reference models"):
        claims = [c.as_dict() for c in catalog(args.device)]
    if args.json:
        print(json.dumps(claims, indent=2, sort_keys=True))
    elif args.format == "md":
        sys.stdout.write(render_md(claims))
    else:
        print_claims(claims)
    return 0


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite non-negative number: {text!r}")
    return v


def _count(text: str) -> int:
    """--gpus: a positive whole number, as ``symacct.time.model.check_gpus`` rules in Python."""
    from symacct.time.model import check_gpus

    try:
        return check_gpus(float(text))
    except (ValueError, SymacctError):
        raise argparse.ArgumentTypeError(f"must be a positive whole number: {text!r}") from None


def _json(report: Any) -> str:
    """Strict JSON: a NaN or infinity is refused (json.dumps would write bare NaN / Infinity, which is not JSON)."""
    try:
        return json.dumps(report, indent=2, sort_keys=True, allow_nan=False)
    except ValueError as e:
        raise SymacctError(f"a figure is not finite, and cannot be written as JSON: {e}") from e


def _print(report: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(_json(report))
    else:
        width = max(len(k) for k in report)
        for k, v in report.items():
            print(f"{k:<{width}}  {v}")
    return 0


def _dtype(name: str | None) -> Any:
    from symacct.options import torch_dtype

    return torch_dtype("dtype", name) if name else None


def _estimate(args: argparse.Namespace) -> dict[str, Any]:
    from symacct.time.model import estimate, train_time

    gpus = args.gpus
    if args.model is None:
        if args.params is None:
            raise UsageError("estimate needs --params (6ND form) or a MODEL")
        est = estimate(
            params=args.params, tokens=args.tokens, hardware=args.hardware, gpus=gpus, mfu=args.mfu, dtype=args.dtype
        )
        flops_per_token = 6 * args.params
    else:
        from symacct.pipeline import derive

        acct = derive(load_model(args.model, overrides_of(args.config)))
        S = args.seq if args.seq is not None else acct.symbols.get("S_max", 1)
        est = train_time(
            acct,
            hardware=args.hardware,
            tokens=args.tokens,
            gpus=gpus,
            mfu=args.mfu,
            dtype=args.dtype,
            B=args.batch,
            S=S,
        )
        flops_per_token = est.flops / args.tokens
    return {
        "formula": est.formula,
        "flops": est.flops,
        "flops_per_token": flops_per_token,
        "seconds": est.seconds,
        "days": est.days,
        "hardware": est.inputs["hardware"],
        "gpus": gpus,
        "mfu": args.mfu,
    }


def _fit(args: argparse.Namespace) -> dict[str, Any]:
    from symacct.pipeline import derive
    from symacct.time.hardware import get
    from symacct.time.model import fit, max_params

    hw = get(args.hardware)
    gpus = args.gpus
    if args.model is None and args.allocator:
        raise UsageError("--allocator needs a model: the bare rule has no step to replay")
    if args.model is None:
        # bytes per parameter read off a derived step (a small reference model), not a table
        from symacct.models import Cruncher, CruncherConfig

        probe = derive(Cruncher(CruncherConfig()), optimizer=args.optimizer, params_dtype=_dtype(args.params_dtype))
        bpp = probe.bytes_per_param()
        n = max_params(hardware=hw, gpus=gpus, bytes_per_param=float(bpp), reserve=args.reserve)
        return {
            "formula": "params = capacity * gpus * (1 - reserve) / bytes_per_param (static memory only)",
            "bytes_per_param": float(bpp),
            "params": n,
            "capacity_bytes": hw.memory_bytes * gpus,
            "reserve": args.reserve,
            "hardware": hw.name,
            "gpus": gpus,
        }
    if gpus > 1:  # data-parallel replicas are PyTorch's DDP: each device also holds its gradient buckets
        if args.solve != "batch" or args.allocator:
            raise UsageError(
                f"--gpus {gpus} with a model fits the batch under DDP (its gradient buckets counted), as --dp {gpus} "
                "--dp-mode ddp does: drop --solve and --allocator, or give --gpus 1"
            )
        args.dp, args.dp_mode = gpus, "ddp"
        out = _fit_layout(args)
        out["notes"] = [
            f"--gpus {gpus}: data parallelism as PyTorch's DDP over {gpus} replicas (--dp {gpus} --dp-mode ddp): "
            "each device holds the whole model, its gradients, optimizer states and DDP's gradient buckets; "
            "--dp-mode zero1, zero2 or fsdp for sharded data parallelism"
        ]
        return out
    model = load_model(args.model, overrides_of(args.config))
    acct = derive(
        model, optimizer=args.optimizer, autocast=_dtype(args.autocast), params_dtype=_dtype(args.params_dtype)
    )
    symbol = {"batch": "B", "seq": "S", "layers": "L"}[args.solve]
    sizes: dict[str, int] = {}
    if symbol != "B":
        sizes["B"] = args.batch
    if symbol != "S":
        sizes["S"] = args.seq if args.seq is not None else acct.symbols.get("S_max", 1)
    res = fit(acct, symbol, hardware=hw, gpus=gpus, reserve=args.reserve, allocator=args.allocator, **sizes)
    return {
        "formula": res.formula,
        "solve": symbol,
        "value": res.value,
        "peak_bytes": res.peak_bytes,
        "next_peak_bytes": res.next_peak_bytes,
        "budget_bytes": res.budget_bytes,
        "reserve": args.reserve,
        "hardware": hw.name,
        "gpus": gpus,
        "global_batch": res.global_batch,
        "notes": res.notes,
        **{k: v for k, v in sizes.items()},
    }


def _verify(args: argparse.Namespace) -> int:
    import torch
    from torch.utils._pytree import tree_map

    from symacct.measure.capacity import RUN_SMALLER, require
    from symacct.measure.verify import _step_of, profile_match, render, step_need, verify
    from symacct.options import optimizer_factory
    from symacct.pipeline import derive

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available here; use --device cpu")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    meta = load_model(args.model, overrides_of(args.config))
    if args.predict is not None and not args.device.startswith("cuda"):
        raise UsageError("--predict chooses how a CUDA step is predicted; it needs --device cuda")
    route: dict[str, Any] = {}
    if args.device.startswith("cuda") and args.predict in (None, "no-gpu"):
        from symacct.measure.verify import device_hardware
        from symacct.time.hardware import get

        # the prediction a machine without a GPU makes for this one (symacct.trace.engine, SDPA by the rules)
        route = {"hardware": get(args.hardware or device_hardware()).name, "without_gpu": True}
    acct = derive(meta, optimizer=args.optimizer, autocast=_dtype(args.autocast), device=args.device, **route)
    S = args.seq if args.seq is not None else acct.symbols.get("S_max", 1)
    at = acct.at(B=args.batch, S=S)
    what = f"the real run of {args.model} at B={args.batch}, S={S}"
    if args.device.startswith("cuda"):  # built on the host, then moved
        require(int(at.memory.params + at.memory.buffers), "cpu", f"{what} (its model built on the host)", RUN_SMALLER)
    require(step_need(acct, at, args.steps, {"B": args.batch, "S": S}), args.device, what, RUN_SMALLER)
    torch.manual_seed(0)
    model = type(meta)(meta.config)
    rows = verify(
        model,
        acct,
        B=args.batch,
        S=S,
        device=args.device,
        optimizer=optimizer_factory(args.optimizer, None),
        autocast=_dtype(args.autocast),
        steps=args.steps,
        hardware=args.hardware,
    )
    del model  # --profile builds its own
    notes = at.notes
    prof_rows, unmatched = [], {}
    if args.profile:
        torch.manual_seed(0)
        real = type(meta)(meta.config).to(args.device)
        make, loss = _step_of(real, None, None)
        inputs = tree_map(lambda a: a.to(args.device) if isinstance(a, torch.Tensor) else a, make(real, args.batch, S))
        prof_rows, unmatched = profile_match(real, inputs, at, autocast=_dtype(args.autocast), loss=loss)
    if args.json:
        report = {"model": args.model, "B": args.batch, "S": S, "rows": [r.as_dict() for r in rows], "notes": notes}
        if args.profile:
            report["profile"] = [r.__dict__ for r in prof_rows]
            report["unpredicted_allocations"] = unmatched
        print(json.dumps(report, indent=2))
    else:
        print(render(rows))
        for n in notes:
            print(f"note: {n}")
        if args.profile:
            print("\ntorch.profiler, forward + backward: bytes allocated per op (predicted vs measured)")
            for r in prof_rows:
                print(f"  {r.op:<40} {r.predicted:>14,}  {r.measured:>14,}")
            for name, b in unmatched.items():
                print(f"  allocated under a name the graph does not have: {name} {b:,} bytes")
    return 0 if all(r.ok for r in rows) else 1


def _serve(args: argparse.Namespace) -> int:
    """symacct serve: a prefill and a decode step derived, the serving figures at --context and --batch."""
    import torch

    from symacct.options import dtype_key
    from symacct.pipeline import derive
    from symacct.time.serving import as_dict, serve

    out = _writable(args.out) if args.out else None
    with torch.device("meta"):  # nothing of real size: the reference models build on meta
        model = load_model(args.model, overrides_of(args.config))
    kw = {"params_dtype": args.params_dtype, "cache_dtype": args.cache_dtype}
    prefill = derive(model, step="prefill", **kw)
    decode = derive(model, step="decode", **kw)
    s = serve(
        prefill,
        decode,
        hardware=args.hardware,
        context=args.context,
        batch=args.batch,
        prompt=args.prompt,
        reserve=args.reserve,
        weight_bits=args.weight_bits,
        group_size=args.group_size,
    )
    if out is not None:
        from symacct.report.plots import serving_memory
        from symacct.time.hardware import get

        budget = int(get(args.hardware).memory_bytes * (1 - args.reserve))
        name = Path(args.model).name
        batches = tuple(sorted({1, args.batch, 8 * args.batch}))
        for path in serving_memory(decode, out, name=name, batches=batches, budget=budget):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(_json(as_dict(s)))
        return 0
    gib = 2**30
    t = s.decode_traffic
    # the weights' dtype, which the figures follow: --params-dtype, else the model's own (the reference models'
    # fp32: a reader takes an unlabelled 7B model's 25 GiB for a bf16 one's 13)
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    dtype = args.params_dtype or f"{dtype_key(own)} (the model's own; --params-dtype bf16 for bf16)"
    rows = {
        "model": f"{args.model} on {s.hardware}, batch {s.batch}, context {s.context} (prompt {s.prompt})",
        "weights": f"{s.weights_bytes / gib:.2f} GiB, "
        + (
            f"linear weights int{s.weight_bits} ({s.bytes_per_weight:.4f} bytes each: re-priced), the rest {dtype}"
            if s.weight_bits
            else dtype
        ),
        "KV cache a token": f"{s.cache_bytes_per_token:,} bytes = {s.cache_formula} "
        f"(2*L*H_kv*d_head*bytes: {s.textbook_bytes_per_token:,})",
        "KV cache": f"{s.cache_bytes / gib:.2f} GiB",
        "decode peak": f"{s.peak_bytes / gib:.2f} GiB",
        "prefill peak": f"{s.prefill_peak_bytes / gib:.2f} GiB (the batch's prompts at once)",
        "time to first token": f"{s.ttft_seconds * 1e3:.1f} ms",
        "decode step": f"{s.decode_seconds * 1e3:.2f} ms ({s.decode_bound}-bound)",
        "decode step reads": f"weights {t['weights_read'] / gib:.2f} GiB, cache {t['cache_read'] / gib:.2f} GiB, "
        f"other {t['other_read'] / gib:.2f} GiB; writes cache {t['cache_written'] / gib:.2f} GiB, "
        f"other {t['other_written'] / gib:.2f} GiB",
        "tokens/s": f"{s.tokens_per_second:,.1f} ({s.tokens_per_second_per_sequence:,.1f} a sequence)",
        "compute-bound from batch": str(s.compute_bound_batch or "-"),
        "largest batch": str(s.max_batch or "-"),
        "longest context": str(s.max_context or "-"),
        "longest prompt": f"{s.max_prompt or '-'} (prefilled whole, one prompt)",
    }
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"{k:<{width}}  {v}")
    for note in s.notes:
        print(f"note: {note}")
    return 0


def _annotate(args: argparse.Namespace) -> int:
    """symacct annotate: load a saved torch.export program, cost its nodes, print the sheet or JSON."""
    import torch

    from symacct.cost.fx import annotate

    dims = {}
    for item in args.dims:
        name, eq, letter = item.partition("=")
        if not eq or not name or not letter:
            raise UsageError(f"--dims takes NAME=LETTER (batch=B), got {item!r}")
        dims[name] = letter
    if not Path(args.program).is_file():
        raise UsageError(f"no such file: {args.program}")
    quiet = logging.getLogger("torch.export")  # it logs a traceback before raising; the error says it all
    was, quiet.disabled = quiet.disabled, True
    try:
        program = torch.export.load(args.program)
    except Exception as e:
        raise UsageError(
            f"cannot load {args.program} as a torch.export program: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from e
    finally:
        quiet.disabled = was
    costs = annotate(program, dims=dims)
    print(_json(costs.to_dict()) if args.json else costs.sheet(), end="\n" if args.json else "")
    return 0


def _layout_args(p: argparse.ArgumentParser) -> None:
    """A parallel layout (symacct.parallel.layout): data and pipeline degrees and options."""
    from symacct.parallel.layout import DP_MODES, MIXED_DTYPES, SCHEDULES

    g = p.add_argument_group("parallel layout (per-rank figures)")
    g.add_argument("--dp", type=_count, default=None, help="data-parallel degree")
    g.add_argument(
        "--tp", type=_count, default=1, help="tensor-parallel degree (the model's Megatron plan, traced per rank)"
    )
    g.add_argument("--sp", action="store_true", help="sequence parallelism with --tp (the megatron-sp plan)")
    g.add_argument("--pp", type=_count, default=1, help="pipeline stages")
    g.add_argument("--cp", type=_count, default=1, help="context-parallel degree (ring attention; the model's SDPA)")
    g.add_argument("--dp-mode", choices=DP_MODES, default="fsdp", help="ddp, zero1, zero2 or fsdp (default)")
    g.add_argument("--hsdp-shard", type=_count, default=None, help="HSDP: the sharding group's size")
    g.add_argument("--no-reshard", action="store_true", help="FSDP2 reshard_after_forward=False")
    g.add_argument(
        "--fsdp-param-dtype",
        choices=MIXED_DTYPES,
        default=None,
        help="FSDP2 MixedPrecisionPolicy(param_dtype=...): forward and backward in this dtype, shards in the model's",
    )
    g.add_argument(
        "--fsdp-reduce-dtype",
        choices=MIXED_DTYPES,
        default=None,
        help="FSDP2 MixedPrecisionPolicy(reduce_dtype=...): the gradients' reduce-scatter (default: param dtype)",
    )
    g.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    g.add_argument("--micro-batches", type=_count, default=1, help="m: micro-batches per step")
    g.add_argument("--stages-per-rank", type=_count, default=1, help="v: interleaved schedule's stages per rank")
    g.add_argument(
        "--no-return-outputs", action="store_true", help="schedule.step(return_outputs=False): no kept outputs"
    )


def _layout_of(args: argparse.Namespace) -> Any:
    from symacct.parallel.layout import make_layout

    return make_layout(
        dp=args.dp or 1,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        dp_mode=args.dp_mode,
        hsdp_shard=args.hsdp_shard,
        reshard_after_forward=not args.no_reshard,
        bucket_view=args.bucket_view,
        schedule=args.schedule,
        micro_batches=args.micro_batches,
        stages_per_rank=args.stages_per_rank,
        return_outputs=not args.no_return_outputs,
        sequence_parallel=args.sp,
        param_dtype=args.fsdp_param_dtype,
        reduce_dtype=args.fsdp_reduce_dtype,
    )


def _own_seq(acct: Any) -> int:
    """The S a layout is evaluated at without --seq: the model's table rows (S_max; with context parallelism S,
    which the tables are)."""
    return int(acct.symbols.get("S_max", acct.symbols.get("S", 1)))


def _wants_layout(args: argparse.Namespace) -> bool:
    wanted = (args.dp is not None, args.tp > 1, args.sp, args.pp > 1, args.cp > 1, args.micro_batches > 1)
    return any(wanted) or bool(args.hsdp_shard)


def _parallel(args: argparse.Namespace) -> int:
    """derive with a layout: per-rank formulas and values, the collectives, the step time with --hardware."""
    from symacct.parallel.plan import step_time
    from symacct.parallel.rank import derive_compute, derive_parallel
    from symacct.pipeline import derive
    from symacct.report.parallel import print_ranks, rank_report

    lay = _layout_of(args)
    if args.step != "train":
        raise UsageError("a parallel layout is a training step: drop --step or the layout flags")
    model = load_model(args.model, overrides_of(args.config))
    options = dict(causal_discount=args.causal_discount, **_step_options(args), **lay.rank_options)
    acct = derive(model, **options)
    par = derive_parallel(acct, lay, derive_compute(model, lay, **options))
    S = args.seq if args.seq is not None else _own_seq(acct)
    at = par.at(B=args.batch, S=S)
    t = None
    if args.hardware is not None:
        t = step_time(at, args.hardware, efficiency=args.efficiency, overlap=not args.no_overlap)
    report = rank_report(par, at, t)
    if args.json:
        print(_json(report))
    else:
        print_ranks(report)
    return 0


def _fit_layout(args: argparse.Namespace) -> dict[str, Any]:
    """fit with a layout: the largest micro-batch B per data-parallel rank whose worst rank fits."""
    from symacct.parallel.plan import fit_layout
    from symacct.parallel.rank import derive_compute
    from symacct.pipeline import derive

    lay = _layout_of(args)
    if args.gpus != 1 and args.gpus != lay.world:
        raise UsageError(f"--gpus {args.gpus} is not the layout's {lay.world} ranks (dp*tp*pp*cp)")
    if args.solve != "batch":
        raise UsageError("with a layout, fit solves for the micro-batch B: drop --solve")
    if not 0 <= args.reserve < 1:
        raise UsageError("--reserve must be in [0, 1)")
    model = load_model(args.model, overrides_of(args.config)) if args.model else None
    if model is None:
        raise UsageError("fit with a layout needs a MODEL")
    options = dict(
        optimizer=args.optimizer,
        autocast=_dtype(args.autocast),
        params_dtype=_dtype(args.params_dtype),
        **lay.rank_options,
    )
    acct = derive(model, **options)
    S = args.seq if args.seq is not None else _own_seq(acct)
    compute = derive_compute(model, lay, **options)
    res = fit_layout(acct, lay, hardware=args.hardware, seq=S, reserve=args.reserve, compute=compute)
    if res.micro_batch == 0:  # as fit without a layout: a refusal, not a batch of 0
        raise SymacctError(
            f"nothing fits: B=1 already needs {res.peak / 1e9:.1f} GB of {res.budget / 1e9:.1f} GB on the worst rank "
            f"(stage: {res.worst_stage}) of {lay.describe()}",
            hint="use more memory per device, more pipeline stages or tensor-parallel ranks, or a lower reserve",
        )
    return {
        "layout": lay.describe(),
        "solve": "B (per data-parallel rank and micro-batch)",
        "value": res.micro_batch,
        "global_batch": res.global_batch,
        "peak_bytes": res.peak,
        "next_peak_bytes": res.next_peak,
        "budget_bytes": res.budget,
        "worst_stage": res.worst_stage,
        "reserve": args.reserve,
        "S": S,
        "notes": res.notes,
    }


def _verify_parallel(args: argparse.Namespace) -> int:
    """verify --parallel: the layout on world-size real gloo processes (CPU), every row exact but the peak."""
    from symacct.measure.parallel import verify_parallel
    from symacct.measure.verify import render

    if args.device != "cpu":
        raise UsageError("verify --parallel runs gloo processes on the CPU: drop --device")
    lay = _layout_of(args)
    model = load_model(args.model, overrides_of(args.config))
    S = args.seq if args.seq is not None else 16
    rows = verify_parallel(model, lay, args.batch, S, args.optimizer)
    print(render(rows))
    return 0 if all(r.ok for r in rows) else 1


def _plan(args: argparse.Namespace) -> int:
    import dataclasses

    from symacct.report.parallel import plot_plan, print_plan
    from symacct.time.hardware import get

    hw = get(args.hardware)
    if not 0 < args.efficiency <= 1 or not 0 <= args.reserve < 1:
        raise UsageError("--efficiency must be in (0, 1] and --reserve in [0, 1)")
    out = _writable(args.out) if args.out else None
    policy = None
    if args.fsdp_param_dtype is not None:  # FSDP2's MixedPrecisionPolicy: the model in its own dtype, traced again
        if args.params_dtype is not None:
            raise UsageError("--fsdp-param-dtype keeps the model in its own dtype (the shards'): drop --params-dtype")
        policy = (args.fsdp_param_dtype, args.fsdp_reduce_dtype)
    elif args.fsdp_reduce_dtype is not None:
        raise UsageError("--fsdp-reduce-dtype goes with --fsdp-param-dtype")
    overrides = overrides_of(args.config)
    variants: list[tuple[str | None, dict[str, str]]] = [(None, {})]
    if args.try_checkpointing:  # the model derived with and without activation checkpointing, ranked together
        if "checkpoint" in overrides:
            raise UsageError("--try-checkpointing sets the config's checkpoint field: drop --config checkpoint=...")
        variants = [("checkpointed", {"checkpoint": "true"}), ("not checkpointed", {"checkpoint": "false"})]
    rows, left_out = [], []
    for name, extra in variants:
        got, refused = _planned(args, hw, load_model(args.model, {**overrides, **extra}), policy)
        rows += [dataclasses.replace(r, variant=name) for r in got]
        left_out += [f"{name}: {w}" if name else w for w in refused]
    rows.sort(key=lambda r: (not r.fits, r.seconds, r.peak))
    mixed = f", FSDP2 MixedPrecisionPolicy({policy[0]}, reduce {policy[1] or policy[0]})" if policy else ""
    header = (
        f"{args.model} on {args.gpus} x {hw.name}{mixed}, S={args.seq}, global batch {args.global_batch}: "
        f"{len(rows)} layouts, {sum(r.fits for r in rows)} fit" + "".join(f"; {w}" for w in left_out)
    )
    if args.json:
        print(_json({"header": header, "layouts": [r.to_dict() for r in rows]}))
    else:
        print_plan(rows, args.top, header)
    if out is not None:
        for p in plot_plan(rows, hw.memory_bytes * (1 - args.reserve), out / "plan", header):
            print(p)
    return 0


def _planned(
    args: argparse.Namespace, hw: Any, model: Any, policy: tuple[str, str | None] | None
) -> tuple[Any, list[str]]:
    """The planner's rows for one model: its derivation, one per tensor- and context-parallel degree (and, with
    FSDP2's policy, each traced again as the policy runs it); the degrees the model refuses, with the reason."""
    from symacct.parallel.plan import plan
    from symacct.pipeline import derive

    own = None if policy else _dtype(args.params_dtype or "bf16")
    options = {"optimizer": args.optimizer, "params_dtype": own}
    acct = derive(model, **options)
    compute = {}

    def traced(key: tuple[int, int], **rank: Any) -> None:  # the rank as FSDP2's policy runs it
        if policy is not None:
            compute[key] = derive(model, **{**options, "params_dtype": policy[0], "fsdp_policy": True}, **rank)

    traced((1, 1))
    plan_name = "megatron-sp" if args.sp else "megatron"
    degrees = args.tp or [2**k for k in range(1, hw.gpus_per_node.bit_length()) if 2**k <= hw.gpus_per_node]
    tensor_parallel = {}
    left_out = []
    for tp in (d for d in degrees if d > 1):
        try:
            tensor_parallel[tp] = derive(model, **options, tensor_parallel=plan_name, tp=tp)
            traced((tp, 1), tensor_parallel=plan_name, tp=tp)
        except SymacctError as e:  # a degree the model cannot be split by: the others are still planned
            left_out.append(e.what if e.what.startswith(f"tp={tp} ") else f"tp={tp}: {e.what}")
    context_parallel, context_tensor_parallel = {}, {}
    for cp in sorted({d for d in args.cp or [] if d > 1}):
        try:
            context_parallel[cp] = derive(model, **options, context_parallel=cp)
            traced((1, cp), context_parallel=cp)
        except SymacctError as e:  # a degree the model cannot run (no SDPA, S not in 2 cp chunks): planned without
            left_out.append(f"cp={cp}: {e.what}")
            continue
        for tp in tensor_parallel:  # the ring's ranks tensor-parallel too
            both = {"tensor_parallel": plan_name, "tp": tp, "context_parallel": cp}
            try:
                context_tensor_parallel[(tp, cp)] = derive(model, **options, **both)
                traced((tp, cp), **both)
            except SymacctError as e:
                left_out.append(f"cp={cp} x tp={tp}: {e.what}")
    rows = plan(
        acct,
        gpus=args.gpus,
        hardware=hw,
        global_batch=args.global_batch,
        seq=args.seq,
        efficiency=args.efficiency,
        overlap=not args.no_overlap,
        reserve=args.reserve,
        dp_modes=tuple(args.dp_mode) if args.dp_mode else None,
        return_outputs=args.return_outputs,
        tensor_parallel=tensor_parallel,
        context_parallel=context_parallel,
        fsdp_policy=policy,
        compute=compute or None,
        context_tensor_parallel=context_tensor_parallel,
    )
    return rows, left_out


def _step_args(p: argparse.ArgumentParser, steps: tuple[str, ...] = ("train", "forward")) -> None:
    from symacct.options import LOW_PRECISION

    """The model and the step to derive: shared by derive and sheet."""
    p.add_argument("model", help="built-in name (symacct list) or package.module:factory")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", type=int, default=8, help="B at which to evaluate (default 8)")
    p.add_argument("--seq", type=int, default=None, help="S at which to evaluate (default: S_max)")
    p.add_argument("--step", choices=steps, default="train")
    p.add_argument("--optimizer", default="adamw", help="optimizer traced in the step (default adamw)")
    p.add_argument("--autocast", choices=LOW_PRECISION, default=None, help="forward under torch.autocast")
    p.add_argument("--params-dtype", choices=LOW_PRECISION, default=None, help="parameters in this dtype")
    p.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda: CUDA's kernels (the CUDA build of torch, no GPU needed)"
    )
    p.add_argument(
        "--sdpa-backend",
        choices=("flash", "cudnn", "efficient", "math"),
        default=None,
        help="the kernel scaled_dot_product_attention runs (default: as PyTorch chooses on --hardware with --device "
        "cuda, on this GPU, or on the CPU; the CPU runs flash or math)",
    )


def _main(argv: Sequence[str] | None) -> int:
    from symacct.options import CACHE_DTYPES, DTYPES, LOW_PRECISION
    from symacct.parallel.layout import DP_MODES, MIXED_DTYPES

    parser = _Parser(prog="symacct", description="Symbolic resource accounting for PyTorch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("derive", help="derive and print the FLOP, byte and parameter formulas of a model")
    _step_args(d)
    d.add_argument("--causal-discount", action="store_true", help="halve attention-score FLOPs (Megatron)")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    _layout_args(d)
    d.add_argument(
        "--hardware",
        default=None,
        help="with a layout: the step time on this accelerator; with --reserved: its cuBLAS workspace; with "
        "--device cuda: the GPU whose kernel choices (SDPA) the step follows",
    )
    d.add_argument(
        "--reserved",
        type=_count,
        nargs="?",
        const=3,
        default=None,
        metavar="STEPS",
        help="replay STEPS steps (default 3) through the CUDA caching-allocator model: reserved and allocated bytes",
    )
    d.add_argument("--efficiency", type=_number, default=0.5, help="with a layout: compute at this share of the peak")
    d.add_argument("--no-overlap", action="store_true", help="with a layout: no communication hides behind compute")
    pl = sub.add_parser(
        "plan", help="every valid dp x tp x pp (x cp) layout of a job on N GPUs: memory, step time, ranked"
    )
    pl.add_argument("model", help="built-in name (symacct list) or package.module:factory")
    pl.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    pl.add_argument("--gpus", type=_count, required=True, help="GPUs of the job")
    pl.add_argument("--hardware", required=True, help="accelerator name (see symacct hardware)")
    pl.add_argument("--seq", type=_count, required=True, help="S: tokens per sequence")
    pl.add_argument("--global-batch", type=_count, required=True, help="sequences per optimizer step")
    pl.add_argument("--optimizer", default="adamw")
    pl.add_argument(
        "--params-dtype", choices=LOW_PRECISION, default=None, help="parameters in this dtype (default bf16)"
    )
    pl.add_argument(
        "--fsdp-param-dtype",
        choices=MIXED_DTYPES,
        default=None,
        help="plan FSDP2 and HSDP with MixedPrecisionPolicy(param_dtype=...): the model in its own dtype (the "
        "shards', the optimizer's), forward and backward traced again in this one",
    )
    pl.add_argument(
        "--fsdp-reduce-dtype",
        choices=MIXED_DTYPES,
        default=None,
        help="with --fsdp-param-dtype: MixedPrecisionPolicy(reduce_dtype=...) (default: the param dtype)",
    )
    pl.add_argument("--efficiency", type=_number, default=0.5, help="compute at this share of the peak (0.5)")
    pl.add_argument("--no-overlap", action="store_true", help="no communication hides behind compute")
    pl.add_argument("--reserve", type=_number, default=0.15, help="fraction of memory kept free (0.15)")
    pl.add_argument("--dp-mode", action="append", choices=DP_MODES, default=None, help="only these (repeatable)")
    pl.add_argument(
        "--return-outputs", action="store_true", help="a pipeline's last stage keeps its m outputs (step's default)"
    )
    pl.add_argument(
        "--tp",
        type=_count,
        action="append",
        default=None,
        help="tensor-parallel degrees to try (repeatable; default 1 and every power of two up to a node's GPUs)",
    )
    pl.add_argument("--sp", action="store_true", help="tensor parallelism with sequence parallelism (megatron-sp)")
    pl.add_argument(
        "--cp",
        type=_count,
        action="append",
        default=None,
        help="context-parallel degrees to try with data and tensor parallelism (repeatable; default none: each is "
        "one more derivation of a ring rank, and one for each tp, which need the model's SDPA)",
    )
    pl.add_argument(
        "--try-checkpointing",
        action="store_true",
        help="rank every layout with and without activation checkpointing (the config's checkpoint field: the "
        "model derived twice)",
    )
    pl.add_argument("--top", type=_count, default=15, help="rows printed (default 15)")
    pl.add_argument("--json", action="store_true", help="every layout as JSON")
    pl.add_argument("--out", default=None, help="write the Pareto plot (plan.png, plan.svg) here")
    sh = sub.add_parser("sheet", help="formula sheet: notation, per-component tables, totals, time; plots with --out")
    _step_args(sh, ("train", "forward", "prefill", "decode"))
    sh.add_argument("--context", type=_count, default=None, help="decode: sequence length at the new token (C + 1)")
    sh.add_argument("--hardware", default="H100-SXM", help="accelerator for the time rows (default H100-SXM)")
    sh.add_argument("--mfu", type=_number, default=0.5, help="MFU for the step time (default 0.5)")
    sh.add_argument(
        "--format", choices=("text", "md", "tex", "json"), default="text", help="text: rich tables (default)"
    )
    sh.add_argument("--out", default=None, help="write MODEL.md/.tex/.json (or --format) and the plots here")
    sh.add_argument("--no-plots", action="store_true", help="with --out: write the sheet only")
    ck = sub.add_parser("check", help="verdicts on the seeds' rules of thumb, each derived on the reference models")
    ck.add_argument("--json", action="store_true")
    ck.add_argument("--format", choices=("text", "md"), default="text", help="md: the docs/rules-of-thumb.md page")
    ck.add_argument(
        "--device",
        default="cpu",
        help="cuda: add the claims derived on CUDA's kernels beside the CPU's (the CUDA build of torch, no GPU)",
    )
    sub.add_parser("list", help="list the built-in models")
    e = sub.add_parser("estimate", help="training time by the 6ND rule, or from a model's derived FLOPs")
    e.add_argument("model", nargs="?", help="optional: derive the step FLOPs of this model instead of 6ND")
    e.add_argument("--params", type=_number, help="parameter count N (6ND form), e.g. 70e9")
    e.add_argument("--tokens", type=_number, required=True, help="training tokens, e.g. 15e12")
    e.add_argument("--hardware", required=True, help="accelerator name (see symacct hardware)")
    e.add_argument("--gpus", type=_count, default=1, help="devices, a positive whole number")
    e.add_argument("--mfu", type=_number, default=0.5, help="model FLOPs utilisation in (0, 1]")
    e.add_argument("--dtype", default="bf16", help="peak to use: " + ", ".join([*DTYPES, "tf32"]))
    e.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--seq", type=int, default=None)
    e.add_argument("--json", action="store_true")
    f = sub.add_parser("fit", help="what fits: largest model (bytes/param rule) or largest batch / sequence")
    f.add_argument("model", nargs="?", help="optional: solve on this model's derived peak")
    f.add_argument("--hardware", required=True)
    f.add_argument(
        "--gpus", type=_count, default=1, help="devices: data-parallel replicas with a model (global batch B x gpus)"
    )
    f.add_argument("--optimizer", default="adamw")
    f.add_argument("--params-dtype", choices=LOW_PRECISION, default=None)
    f.add_argument("--autocast", choices=LOW_PRECISION, default=None)
    f.add_argument("--reserve", type=_number, default=0.15, help="fraction kept for what formulas cannot see")
    f.add_argument(
        "--allocator",
        action="store_true",
        help="fit what the CUDA caching allocator reserves (a model of it, 2 steps), not the live peak",
    )
    f.add_argument("--solve", choices=("batch", "seq", "layers"), default="batch")
    f.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    f.add_argument("--batch", type=int, default=8)
    f.add_argument("--seq", type=int, default=None)
    f.add_argument("--json", action="store_true")
    _layout_args(f)
    sub.add_parser("hardware", help="list the accelerator catalog")
    df = sub.add_parser("diff", help="compare two resource logs written by symacct.track, phase by phase")
    df.add_argument("log_a")
    df.add_argument("log_b")
    df.add_argument("--json", action="store_true")
    v = sub.add_parser("verify", help="run the real model and compare every prediction with a measurement")
    v.add_argument("model")
    v.add_argument("--device", default="cpu", help="cpu or cuda")
    v.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    v.add_argument("--batch", type=int, default=2)
    v.add_argument("--seq", type=int, default=None)
    v.add_argument("--optimizer", default="adamw")
    v.add_argument("--autocast", choices=LOW_PRECISION, default=None)
    v.add_argument(
        "--steps",
        type=int,
        default=1,
        help="training steps to run; steps 2.. are checked against "
        "the steady state (optimizer states alive from the start)",
    )
    v.add_argument("--hardware", default=None, help="CUDA: catalog entry for the time rows (default: this GPU)")
    v.add_argument(
        "--predict",
        choices=("no-gpu", "gpu"),
        default=None,
        help="CUDA: the predicted side as a machine without a GPU derives it for this GPU (default: the backward "
        "by symacct's engine, SDPA by symacct's reading of PyTorch's rules), or as this GPU traces the step",
    )
    v.add_argument("--profile", action="store_true", help="match torch.profiler's per-op memory to graph nodes")
    v.add_argument("--parallel", action="store_true", help="run the layout on real gloo processes and compare")
    _layout_args(v)
    v.add_argument("--json", action="store_true")
    sv = sub.add_parser("serve", help="serving on one device: KV cache, time to first token, tokens/s, what fits")
    sv.add_argument("model", help="built-in name (symacct list) or package.module:factory")
    sv.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    sv.add_argument("--hardware", required=True, help="accelerator name (see symacct hardware)")
    sv.add_argument("--context", type=_count, required=True, help="sequence length at the last generated token")
    sv.add_argument("--batch", type=_count, default=1, help="sequences decoded together (default 1)")
    sv.add_argument("--prompt", type=_count, default=None, help="prompt tokens (default: context - 1)")
    sv.add_argument("--params-dtype", choices=LOW_PRECISION, default=None, help="weights (and so the cache) dtype")
    sv.add_argument("--cache-dtype", choices=CACHE_DTYPES, default=None, help="KV cache dtype (default: the weights')")
    sv.add_argument("--reserve", type=_number, default=0.15, help="fraction of memory kept free (default 0.15)")
    sv.add_argument("--weight-bits", type=int, choices=(8, 4), default=None, help="weight-only quantization")
    sv.add_argument("--group-size", type=_count, default=128, help="weights a scale (default 128)")
    sv.add_argument("--out", default=None, help="write the plot of memory against context and batch here")
    sv.add_argument("--json", action="store_true")
    an = sub.add_parser("annotate", help="costs of a saved torch.export program (torch.export.save): a Markdown sheet")
    an.add_argument("program", help="a .pt2 file written by torch.export.save")
    an.add_argument("--dims", action="append", default=[], metavar="NAME=LETTER", help="rename a dynamic dim (batch=B)")
    an.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "annotate":
            return _annotate(args)
        if args.cmd == "serve":
            return _serve(args)
        if args.cmd == "list":
            from symacct.models.presets import PRESETS

            print("\n".join(PRESETS))
            return 0
        if args.cmd == "hardware":
            from symacct.time.hardware import CATALOG

            for a in CATALOG.values():
                peaks = ", ".join(f"{k} {v:g}" for k, v in a.peak.items())
                print(
                    f"{a.name:<14} {a.memory_gb:g} GB, {a.bandwidth_tbs:g} TB/s, dense TFLOP/s: {peaks}  [{a.source}]"
                )
            return 0
        if args.cmd == "estimate":
            return _print(_estimate(args), args.json)
        if args.cmd == "fit":
            return _print(_fit_layout(args) if _wants_layout(args) else _fit(args), args.json)
        if args.cmd == "verify":
            return _verify_parallel(args) if args.parallel else _verify(args)
        if args.cmd == "sheet":
            return _sheet(args)
        if args.cmd == "check":
            return _check(args)
        if args.cmd == "diff":
            from symacct.measure.track import diff

            return _print(diff(args.log_a, args.log_b), args.json)
        if args.cmd == "plan":
            return _plan(args)
        if args.batch is not None and args.batch <= 0 or args.seq is not None and args.seq <= 0:
            raise UsageError("--batch and --seq must be positive integers")
        if _wants_layout(args):
            return _parallel(args)
        report = _derive_report(args)
    except (SymacctError, UsageError) as e:
        print(f"symacct: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(_json(report))
    else:
        from symacct.report.summary import render_text

        print(render_text(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``symacct`` command: 0 done, 1 a verify row out of tolerance, 2 bad input (one line on stderr)."""
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a full disk or device shows here, not at interpreter exit
        return rc
    except BrokenPipeError:  # the reader (head, less) closed the pipe early: stop quietly, no traceback
        _silence_stdout()
        return 1
    except OSError as e:  # stdout cannot be written (a full disk: ENOSPC)
        _silence_stdout()
        print(f"symacct: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush raises nothing."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
