"""Models by name: a built-in reference model (``symacct.models.presets``), a ``package.module:factory``, or a
transformers ``config.json``; ``--config KEY=VALUE`` overrides parsed to each field's type.

Built on the meta device: nothing real is allocated. Used by the command line and by the generated
documents (``symacct.report.reference``); a bad name or value is a ``UsageError`` (the CLI prints it on one line
and exits 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import traceback
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symacct.errors import SymacctError


class UsageError(Exception):
    """A command-line argument symacct cannot use (a usage error, not a model's)."""

    pass


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _parse_value(text: str) -> Any:
    """A --config value of a field whose type is not known: bool, int, float, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _parse_typed(key: str, text: str, kind: Any) -> Any:
    """A --config value parsed by its field's declared type; what does not parse is refused, never guessed."""
    if kind is bool:
        low = text.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise UsageError(f"--config {key}={text!r}: {key} is a bool; use true/false (yes/no, on/off, 1/0)")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"--config {key}={text!r}: {key} is an integer (no fraction or exponent)") from None
    if kind is float:
        try:
            v = float(text)
        except ValueError:
            raise UsageError(f"--config {key}={text!r}: {key} is a number") from None
        if not math.isfinite(v):
            raise UsageError(f"--config {key}={text!r}: {key} must be finite")
        return v
    if kind is str:
        return text
    return _parse_value(text)


def overrides_of(items: Sequence[str]) -> dict[str, str]:
    """--config KEY=VALUE items as raw strings; each is parsed by its field's type when the config is known."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise UsageError(f"--config expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _build(what: str, make: Any) -> Any:
    """Call a model constructor or factory; any failure becomes one line naming it (an assert shows its source)."""
    try:
        return make()
    except SymacctError:
        raise
    except Exception as e:
        text = str(e).strip()
        if not text:  # a bare assert: show its line
            frames = traceback.extract_tb(e.__traceback__)
            text = (frames[-1].line or "") if frames else ""
            text = f"{text} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else text
        raise UsageError(f"building {what} failed: {type(e).__name__}: {' '.join(text.split())}") from e


def load_model(name: str, overrides: dict[str, Any]) -> Any:
    """Build a built-in model (on the meta device: nothing real is allocated), import a factory, or build a
    transformers model from a ``config.json`` (or a folder holding one)."""
    import torch

    from symacct.models.hf import config_field_types, is_config_file, model_from_config_file
    from symacct.models.presets import PRESETS

    if is_config_file(name):  # a transformers config.json (or its folder): built on the meta device
        kinds = config_field_types(name)
        return model_from_config_file(name, {k: _parse_typed(k, v, kinds.get(k)) for k, v in overrides.items()})
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except Exception as e:
            raise UsageError(f"cannot import {name!r}: {type(e).__name__}: {e}") from e
        if not callable(factory):
            raise UsageError(f"{name!r} is not callable: pass a factory that returns an nn.Module")
        with torch.device("meta"):
            model = _build(f"{name}()", factory)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{name}() returned {type(model).__name__}, not an nn.Module")
        if overrides:
            cfg = getattr(model, "config", None)
            if cfg is None or not dataclasses.is_dataclass(cfg):
                raise UsageError(f"--config needs a model with a dataclass config; {name}() has none")
            new = _replace_config(cfg, overrides, name)
            with torch.device("meta"):
                model = _build(f"{type(model).__name__} with {_shown(overrides)}", lambda: type(model)(new))
        return model
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; built-in models: {', '.join(PRESETS)}"
        raise UsageError(f"unknown model {name!r}{hint}")
    cls, make_config = PRESETS[name]
    config = _replace_config(make_config(), overrides, name)
    with torch.device("meta"):
        return _build(name + (f" with {_shown(overrides)}" if overrides else ""), lambda: cls(config))


def _shown(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in overrides.items())


def _replace_config(config: Any, overrides: dict[str, Any], name: str) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    for key in overrides:
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=3)
            raise UsageError(
                f"{name} has no config field {key!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
            )
    try:
        hints = typing.get_type_hints(type(config))
    except Exception:  # unresolvable annotations: fall back to the value's own look
        hints = {}
    values = {k: _parse_typed(k, v, hints.get(k)) if isinstance(v, str) else v for k, v in overrides.items()}
    return dataclasses.replace(config, **values)
