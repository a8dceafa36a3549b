"""The hooks registered on a model object, and the methods replaced on its modules: what the step runs
besides its modules' own code.

A forward hook can keep a module's output alive to the end of the step (a feature extractor); a parameter's
post-accumulate-grad hook can step the optimizer and free the gradient inside backward (PyTorch's "optimizer
in backward" recipe); a gradient hook adds ops to backward; a module's ``forward`` replaced on the instance
(``module.forward = types.MethodType(f, module)``, as patching libraries do) runs instead of the class's.
``derive`` traces the model rebuilt from its config, which has only the hooks its constructor registers, so
``symacct.sameness.compare_settings`` compares what :func:`hooks_of` finds on both models and refuses a
difference.

A hook (or a replaced method) is named by where it is registered, its kind and the function's qualified name
(``functools.partial`` unwrapped, a callable object by its class): a hook the constructor registers has the
same name in both models. Global hooks (``torch.nn.modules.module.register_module_forward_hook``) run for
every model alike and are traced as they are.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

from torch import nn

# the attribute a kind of hook is kept in -> its name in a place's key (a tensor's ``_backward_hooks`` are its
# gradient hooks, Tensor.register_hook)
MODULE_KINDS = {
    "_forward_pre_hooks": "_forward_pre_hooks",
    "_forward_hooks": "_forward_hooks",
    "_backward_pre_hooks": "_backward_pre_hooks",
    "_backward_hooks": "_backward_hooks",
}
TENSOR_KINDS = {"_backward_hooks": "_grad_hooks", "_post_accumulate_grad_hooks": "_post_accumulate_grad_hooks"}
KIND_NAMES = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
    "_grad_hooks": "gradient hook",
    "_post_accumulate_grad_hooks": "post-accumulate-grad hook",
    "_replaced": "replaced method",
}

Hooks = dict[str, tuple[str, ...]]  # "<module or parameter path>.<kind>" -> the hooks' names, sorted


def hook_name(fn: Any) -> str:
    """A hook function's qualified name: a partial by its function, a callable object by its class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None)
    if not isinstance(name, str):
        name = type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def _key(path: str, kind: str) -> str:
    return f"{path}.{kind}" if path else kind


def keys(model: nn.Module) -> list[str]:
    """Every place a hook can be registered on ``model``: each module's four kinds, each parameter's two (shared
    modules and parameters under each of their names)."""
    modules = [path for path, _ in model.named_modules(remove_duplicate=False)]
    params = [path for path, _ in model.named_parameters(remove_duplicate=False)]
    return [_key(path, k) for path in modules for k in (*MODULE_KINDS.values(), "_replaced")] + [
        _key(path, k) for path in params for k in TENSOR_KINDS.values()
    ]


def hooks_of(model: nn.Module) -> Hooks:
    """The hooks registered on ``model``'s modules and parameters, by place; places with none are left out."""
    found: Hooks = {}
    places: list[tuple[str, Any, dict[str, str]]]
    places = [(path, m, MODULE_KINDS) for path, m in model.named_modules(remove_duplicate=False)]
    places += [(path, p, TENSOR_KINDS) for path, p in model.named_parameters(remove_duplicate=False)]
    for path, owner, kinds in places:
        for attribute, kind in kinds.items():
            registered = getattr(owner, attribute, None)
            if registered:
                found[_key(path, kind)] = tuple(sorted(hook_name(fn) for fn in registered.values()))
        if kinds is MODULE_KINDS:
            replaced = _replaced(owner)
            if replaced:
                found[_key(path, "_replaced")] = replaced
    return found


def _replaced(module: nn.Module) -> tuple[str, ...]:
    """``name -> function`` for each of the module's methods set on the instance (shadowing the class's)."""
    own = vars(module)
    return tuple(
        sorted(
            f"{name} -> {hook_name(fn)}"
            for name, fn in own.items()
            if callable(fn) and isinstance(inspect.getattr_static(type(module), name, None), types.FunctionType)
        )
    )


def describe(key: str) -> tuple[str, str, str]:
    """(where, the kind in words, the module it belongs to) of a place: ``blocks.0._forward_hooks`` ->
    ("blocks.0", "forward hook", "blocks.0"); ``blocks.0.ln.weight._grad_hooks`` -> ("blocks.0.ln.weight",
    "gradient hook", "blocks.0.ln")."""
    path, _, kind = key.rpartition(".")
    module = path if kind in (*MODULE_KINDS.values(), "_replaced") else path.rpartition(".")[0]
    return path or "<root>", KIND_NAMES[kind], module or "<root>"
