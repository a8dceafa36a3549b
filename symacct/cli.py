"""Command line: argument parsing and printing only.

``symacct derive MODEL [--config KEY=VALUE ...] [--batch B] [--seq S] [--json]``

MODEL is a built-in name (``symacct list``) or ``package.module:factory``
(a callable returning an ``nn.Module`` with a ``config`` and
``example_inputs``). Errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from symacct.errors import SymacctError


class _UsageError(Exception):
    pass


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _overrides(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise _UsageError(f"--config expects KEY=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def load_model(name: str, overrides: dict[str, Any]) -> Any:
    """Build a built-in model (on the meta device: nothing real is allocated) or import a factory."""
    import torch

    from symacct.models.presets import PRESETS

    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise _UsageError(f"cannot import {name!r}: {e}") from e
        with torch.device("meta"):
            model = factory()
        if overrides:
            cfg = model.config
            model = type(model)(_replace_config(cfg, overrides, name))
        return model
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; built-in models: {', '.join(PRESETS)}"
        raise _UsageError(f"unknown model {name!r}{hint}")
    cls, make_config = PRESETS[name]
    config = _replace_config(make_config(), overrides, name)
    with torch.device("meta"):
        return cls(config)


def _replace_config(config: Any, overrides: dict[str, Any], name: str) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    for key in overrides:
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=3)
            raise _UsageError(
                f"{name} has no config field {key!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
            )
    return dataclasses.replace(config, **overrides)


def _derive_report(args: argparse.Namespace) -> dict[str, Any]:
    import symacct
    from symacct.report import summary

    model = load_model(args.model, _overrides(args.config))
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}
    acct = symacct.derive(
        model,
        step=args.step,
        causal_discount=args.causal_discount,
        optimizer=args.optimizer if args.step == "train" else None,
        autocast=dtypes[args.autocast],
        params_dtype=dtypes[args.params_dtype],
    )
    B = args.batch
    S = args.seq if args.seq is not None else acct.symbols.get("S_max", 1)
    return summary(acct, B=B, S=S, name=args.model)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="symacct", description="Symbolic resource accounting for PyTorch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("derive", help="derive and print the FLOP, byte and parameter formulas of a model")
    d.add_argument("model", help="built-in name (symacct list) or package.module:factory")
    d.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    d.add_argument("--batch", type=int, default=8, help="B at which to evaluate (default 8)")
    d.add_argument("--seq", type=int, default=None, help="S at which to evaluate (default: S_max)")
    d.add_argument("--step", choices=("train", "forward"), default="train")
    d.add_argument("--causal-discount", action="store_true", help="halve attention-score FLOPs (Megatron)")
    d.add_argument("--optimizer", default="adamw", help="optimizer traced in the step (default adamw)")
    d.add_argument("--autocast", choices=("bf16", "fp16"), default=None, help="forward under torch.autocast")
    d.add_argument("--params-dtype", choices=("bf16", "fp16"), default=None, help="parameters in this dtype")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub.add_parser("list", help="list the built-in models")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            from symacct.models.presets import PRESETS

            print("\n".join(PRESETS))
            return 0
        if args.batch is not None and args.batch <= 0 or args.seq is not None and args.seq <= 0:
            raise _UsageError("--batch and --seq must be positive integers")
        report = _derive_report(args)
    except (SymacctError, _UsageError) as e:
        print(f"symacct: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        from symacct.report import render_text

        print(render_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
