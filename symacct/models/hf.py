"""Hugging Face transformers models: the step a user would run, chosen from the model's task.

A ``PreTrainedModel`` has no ``example_inputs``; its task (the head class)
says what one training step is. The convention, per task:

- causal LM (``*ForCausalLM``, ``*LMHeadModel``): ``input_ids`` (B, S) and
  ``labels`` (a copy of the ids); the loss is ``output.loss``, transformers'
  own shifted cross-entropy (the last position predicts nothing).
- sequence-to-sequence (``*ForConditionalGeneration`` of an encoder-decoder,
  T5): ``input_ids`` (B, S) and ``labels`` (B, S_dec): the decoder's length
  is a size of its own, S_dec (``acct.at`` takes it, and uses S when it is
  not given); the forward step feeds the labels as ``decoder_input_ids``;
- masked LM (``*ForMaskedLM``): ``input_ids`` and ``labels`` (B, S) with
  every position a target (the cost of the loss does not depend on which
  positions are masked: ignored positions still go through log-softmax).
- sequence classification: ``input_ids`` and one label per sequence.
- token classification (``*ForTokenClassification``): ``input_ids`` and a
  class index per position, ``labels`` (B, S).
- extractive question answering (``*ForQuestionAnswering``): ``input_ids``
  and the answer's ``start_positions`` and ``end_positions`` (B,), positions
  inside the sequence (the cost does not depend on which).
  An encoder-decoder's classification and question-answering heads (BART's,
  T5's) make the decoder's inputs from ``input_ids``: the same steps.
- image classification: ``pixel_values`` (B, C, image_size, image_size) and
  one label per image; S reaches no tensor (the image size is a config field).
- a base model (no head): ``input_ids``; the loss is the sum of the last
  hidden state (a stand-in objective, said so in the notes).

``use_cache=False`` wherever the forward takes it: a training step keeps no
KV cache.

Mixtures of experts: transformers' default experts path (``grouped_mm``)
sorts the B*S*k (token, expert) pairs by expert and multiplies them with one
grouped matmul: every shape is fixed by B, S, k, E and the widths, and only
the offsets (values) depend on the routing. That path is derived; the
``eager`` path (a Python loop over the experts the tokens reached, with
``nonzero``) and ``batched_mm`` (a weight matrix gathered per routed token,
a decoding kernel) are refused by :func:`check_experts_path`.
transformers is imported only when the model comes from it.

Eager paths on fake tensors: transformers treats a fake tensor as a graph
being traced (``is_tracing``) and then skips the checks an eager run makes
on values. One of them changes the step: with positions 0..S-1 (the model's
own, when no ``position_ids`` are given) an eager run finds no packed
sequences and calls SDPA with ``is_causal=True`` and no mask; on fake tensors
the packed-sequence mask is kept and a (B, 1, S, S) mask built and saved.
:func:`eager_paths` gives the eager answer while symacct traces.
Another: a padding mask the model makes itself with ``torch.ones`` (BART's
decoder) is read for padding before SDPA is called; an eager run finds none
and passes ``is_causal=True``, no mask. Such a mask's values are known from
how it was made (``symacct.trace.known``), and :func:`eager_paths` lets
transformers read them. A mask whose values are not known (one the inputs
compute from the token ids) is still treated as a traced graph treats it:
as one that may hold padding (the mask is built).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import nn

from symacct.errors import SymacctError
from symacct.trace.known import known


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return False
    base = getattr(tf, "PreTrainedModel", None)
    return base is not None and isinstance(model, base)


@dataclass(frozen=True)
class Task:
    """One step of a transformers model: keyword inputs at (B, S) and the loss from the output."""

    name: str
    inputs: Callable[..., dict[str, Any]]  # (model, B, S, **dims)
    loss: Callable[[Any], torch.Tensor]
    note: str
    dims: tuple[str, ...] = ()  # input sizes besides B and S, passed by keyword (S_dec)


def _vocab(model: nn.Module) -> int:
    v = getattr(model.config, "vocab_size", None)
    if not isinstance(v, int) or v < 1:
        raise SymacctError(
            f"{type(model).__name__}: the config has no vocab_size to draw token ids from",
            hint="pass inputs=lambda m, B, S: {...} with the model's keyword inputs, and loss=",
        )
    return v


def _ids(model: nn.Module, B: int, S: int) -> torch.Tensor:
    return torch.randint(0, _vocab(model), (B, S))


def _labels(model: nn.Module) -> int:
    n = getattr(model.config, "num_labels", None)
    return n if isinstance(n, int) and n > 0 else 2


def _output_loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None:
        raise SymacctError(
            "the model returned no loss for the labels it was given",
            hint="pass loss=lambda out: ... turning the output into the scalar loss",
        )
    return loss


def _hidden_sum(out: Any) -> torch.Tensor:
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out[0]
    return hidden.sum()


def _causal(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    ids = _ids(m, B, S)
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _seq2seq(m: nn.Module, B: int, S: int, S_dec: int | None = None) -> dict[str, Any]:
    return {"input_ids": _ids(m, B, S), "labels": _ids(m, B, S if S_dec is None else S_dec), "use_cache": False}


def _whisper_frames(m: nn.Module) -> int:
    """The mel frames a Whisper-style encoder requires: its position table's rows times its two
    convolutions' strides (3,000 at Whisper's sizes: 30 s of audio; the encoder refuses any other length)."""
    enc = m.get_encoder()
    convs = [getattr(enc, n, None) for n in ("conv1", "conv2")]
    if not all(isinstance(c, nn.Conv1d) for c in convs):
        raise SymacctError(
            f"{type(m).__name__}: an encoder of mel frames without Whisper's two convolutions (conv1, conv2)",
            hint="pass inputs=lambda m, B, S: {'input_features': ..., 'labels': ...} and loss=lambda out: out.loss",
        )
    return m.config.max_source_positions * convs[0].stride[0] * convs[1].stride[0]


def _mel(m: nn.Module, B: int) -> torch.Tensor:
    """A batch of mel spectrograms of the length a Whisper-style encoder requires: (B, num_mel_bins, frames)."""
    return torch.randn(B, m.config.num_mel_bins, _whisper_frames(m))


def _speech_whisper(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    return {"input_features": _mel(m, B), "labels": _ids(m, B, S), "use_cache": False}


def _classify_mel(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    return {"input_features": _mel(m, B), "labels": _class_labels(m, B)}


def _no_token_task(model: nn.Module) -> Task:
    """The default step of a model whose forward takes no ``input_ids``: Whisper's (a mel spectrogram of the
    fixed length its encoder requires) as a sequence-to-sequence LM or an audio classifier; no other. Other
    speech models' convolutions shorten their input with rounding (Speech2Text halves its frames rounding
    up), a length that is no product of symbols."""
    name, c = type(model).__name__, model.config
    whisper = _takes(model, "input_features") and all(
        isinstance(getattr(c, f, None), int) for f in ("num_mel_bins", "max_source_positions")
    )
    if whisper and name.endswith("ForConditionalGeneration"):
        return Task(
            "speech-seq2seq",
            _speech_whisper,
            _output_loss,
            "speech sequence-to-sequence step (Whisper): input_features (B, num_mel_bins, frames), the frames "
            "fixed by the encoder (max_source_positions times its convolutions' strides: 30 s of audio at "
            "Whisper's sizes, whatever the audio's length), and labels (B, S), output.loss; S is the decoder's "
            "length",
        )
    if whisper and name.endswith("ForAudioClassification"):
        return Task(
            "audio-classification",
            _classify_mel,
            _output_loss,
            "audio classification step (Whisper's encoder): input_features (B, num_mel_bins, frames), the "
            "frames fixed by the encoder (max_source_positions times its convolutions' strides), one label a "
            "clip, output.loss; S reaches no tensor",
        )
    first = [k for k in inspect.signature(model.forward).parameters if k != "self"][:3]
    raise SymacctError(
        f"{name}: no default step for a model whose forward takes no input_ids (it takes {', '.join(first)})",
        hint="pass inputs=lambda m, B, S: {...} (the model's keyword inputs) and loss=lambda out: ...",
    )


def _takes(model: nn.Module, key: str) -> bool:
    """Whether the model's forward names ``key`` (transformers' heads name their inputs; ``**kwargs`` carries
    other options)."""
    return key in inspect.signature(model.forward).parameters


def _masked(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    return {"input_ids": _ids(m, B, S), "labels": _ids(m, B, S)}


def _class_labels(m: nn.Module, B: int) -> torch.Tensor:
    """One label a sample, as the config's ``problem_type`` reads them (unset: regression for one label, else
    single label, as transformers decides): a class index (single label), a float (regression, mean squared
    error), or a 0/1 float per class (multi-label, binary cross entropy with logits)."""
    kind = getattr(m.config, "problem_type", None)
    if kind is None and _labels(m) == 1:  # transformers' own reading (it sets problem_type on the first forward)
        kind = "regression"
    if kind == "multi_label_classification":
        return torch.randint(0, 2, (B, _labels(m))).float()
    if kind == "regression":
        return torch.randn(B) if _labels(m) == 1 else torch.randn(B, _labels(m))
    return torch.randint(0, _labels(m), (B,))


def _classify_text(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    return _with_no_cache(m, {"input_ids": _ids(m, B, S), "labels": _class_labels(m, B)})


def _with_no_cache(m: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with ``use_cache=False`` where the forward takes it, or hands its keyword arguments on to a
    base model that does (a decoder's question-answering head): a training step keeps no KV cache, as for a
    causal LM (Mistral's classifier builds one otherwise, a layer at a time, outside the layer stack)."""
    params = inspect.signature(m.forward).parameters
    passed_on = any(p.kind is p.VAR_KEYWORD for p in params.values())  # a head that hands **kwargs to its base
    base = getattr(m, "base_model", None)
    takes = base is not None and base is not m and "use_cache" in inspect.signature(base.forward).parameters
    if "use_cache" in params or (passed_on and takes):
        inputs["use_cache"] = False
    return inputs


def _classify_tokens(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    return _with_no_cache(m, {"input_ids": _ids(m, B, S), "labels": torch.randint(0, _labels(m), (B, S))})


def _answer_span(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    start = torch.randint(0, S, (B,))
    end = torch.minimum(start + torch.randint(0, S, (B,)), torch.tensor(S - 1))
    return _with_no_cache(m, {"input_ids": _ids(m, B, S), "start_positions": start, "end_positions": end})


def _classify_image(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    c = m.config
    size = getattr(c, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(c, "num_channels", 3)
    if not isinstance(size, int):
        raise SymacctError(
            f"{type(m).__name__}: the config has no image_size",
            hint="pass inputs=lambda m, B, S: {'pixel_values': ..., 'labels': ...}",
        )
    return {"pixel_values": torch.randn(B, channels, size, size), "labels": _class_labels(m, B)}


def _base(m: nn.Module, B: int, S: int) -> dict[str, Any]:
    return {"input_ids": _ids(m, B, S)}


def _serving_check(model: nn.Module, step: str) -> None:
    name = type(model).__name__
    if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        raise SymacctError(
            f"{name}: step={step!r} runs a causal language model with its KV cache",
            hint="derive a ...ForCausalLM model, or pass inputs=lambda m, B, S[, C]: {...} with the cache "
            "under the key 'cache'",
        )


def _cache(m: nn.Module, B: int, C: int) -> Any:
    """The model's own DynamicCache (sliding-window layers where the config has them), with C positions in each
    layer that the model writes, as a decode step finds it in generation's steady state: filled by C - 1
    positions, then by one more, as a decode step before it fills it. What each layer holds a position of,
    how wide and in which dtype (keys and values of H_kv heads; a latent attention's latent and rotary key;
    a sparse attention's indexer keys), and which layers hold nothing (a layer that reads another's cache),
    is read from a one-token call of the model (``_layout``). Each update concatenates into a new tensor; a
    sliding-window layer then keeps a view of its last window - 1 positions, so what it holds is the last
    concatenation's storage, of window positions once C reaches the window (the prompt's storage, C
    positions, right after a prefill: ``docs/serving.md``)."""
    import transformers

    cache = transformers.DynamicCache(config=m.config)
    if C == 0:
        return cache
    for i, held in _layout(m).items():
        (k, dtype), (v, _) = held["keys"], held["values"]
        index = held.get("indexer_keys")
        for n in (C - 1, 1) if C > 1 else (C,):
            cache.update(torch.randn(B, k[0], n, k[1], dtype=dtype), torch.randn(B, v[0], n, v[1], dtype=dtype), i)
            if index is not None:
                cache.update_indexer(torch.randn(B, n, *index[0], dtype=index[1]), i)
    return cache


Layout = dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]
# what to do when symacct cannot build a decode step's cache for the model
_OWN_CACHE = (
    "derive step='prefill' or step='forward', or pass inputs=lambda m, B, S, C: {...} with a cache of C positions "
    "under the key 'cache'"
)


def _layout(m: nn.Module) -> Layout:
    """Per cache layer that a one-token prefill of the model (B = 1, outside any trace) writes: what it holds a
    position of, ``keys`` and ``values`` as (heads, width) and a sparse attention's ``indexer_keys`` (DeepSeek-V3.2,
    GLM-MoE-DSA, HY-V4: ``DynamicIndexedLayer``) as (width,), each with its dtype. The model's own code
    decides this (Falcon's one key head, a latent attention's latent and rotary key, a layer that reuses
    another's cache or top-k writes none), so it is read from a call, not from the config. A layer that holds
    state other than positions (a linear attention's convolution or recurrent state), or its indexer's
    positions, is refused: symacct does not build it for a decode step."""
    import transformers

    from symacct.trace.record import CACHED, untraced

    cache = transformers.DynamicCache(config=m.config)
    try:
        with torch.no_grad(), untraced():
            m(input_ids=_ids(m, 1, 1), cache=cache, use_cache=True, logits_to_keep=1)
    except Exception as e:
        raise SymacctError(
            f"a prompt of one token, run to read what each layer of the model's cache holds, failed: "
            f"{type(e).__name__}: {e}",
            hint="the model must run a prompt of one token at these sizes (its decode step runs one)",
        ) from e
    out: Layout = {}
    for i, layer in enumerate(cache.layers):
        other = [n for n in ("conv_states", "recurrent_states", "indexer_position_ids") if _holds(layer, n)]
        if other:
            raise SymacctError(
                f"{type(m).__name__}: layer {i}'s cache ({type(layer).__name__}) holds {other[0]}, which symacct "
                "does not build for a decode step",
                hint=_OWN_CACHE,
            )
        held = {
            n: (tuple(t.shape[2:]) if n == "indexer_keys" else (t.shape[1], t.shape[3]), t.dtype)
            for n in CACHED
            if isinstance(t := getattr(layer, n, None), torch.Tensor) and t.numel()
        }
        if held and not {"keys", "values"} <= set(held):
            raise SymacctError(
                f"{type(m).__name__}: layer {i}'s cache ({type(layer).__name__}) holds {', '.join(sorted(held))} "
                "only, not keys and values, which symacct does not build for a decode step",
                hint=_OWN_CACHE,
            )
        if held:
            out[i] = held
    return out


def _holds(layer: Any, name: str) -> bool:
    """Whether a cache layer holds a tensor (or a dict of them, a linear attention's states) under ``name``."""
    v = getattr(layer, name, None)
    return isinstance(v, torch.Tensor) or (isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values()))


def serving_inputs(model: nn.Module, step: str) -> Callable[..., dict[str, Any]]:
    """A causal LM's prefill (``input_ids`` of S tokens, an empty cache) or decode step (one token, a cache of
    C positions): the cache under ``cache`` (transformers 5's name), ``logits_to_keep=1`` as generation
    asks for (the head on the last position only)."""
    _serving_check(model, step)
    if step == "decode":
        return lambda m, B, S, C: {
            "input_ids": _ids(m, B, S),
            "cache": _cache(m, B, C),
            "use_cache": True,
            "logits_to_keep": 1,
        }
    return lambda m, B, S: {
        "input_ids": _ids(m, B, S),
        "cache": _cache(m, B, 0),
        "use_cache": True,
        "logits_to_keep": 1,
    }


def task(model: nn.Module, *, inputs: bool = True) -> Task:
    """The default step of a transformers model, from the name of its class (its head). ``inputs=False``: the
    caller gives the inputs and takes only the loss, which a forward without ``input_ids`` has too."""
    name = type(model).__name__
    config = model.config
    heads = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
    if inputs and not _takes(model, "input_ids") and not name.endswith("ForImageClassification"):
        return _no_token_task(model)
    if getattr(config, "is_encoder_decoder", False) and not name.endswith(heads):
        if name.endswith(("ForConditionalGeneration", "MTModel")):  # MarianMTModel: a translation LM head
            return Task(
                "seq2seq-lm",
                _seq2seq,
                _output_loss,
                "sequence-to-sequence step: input_ids (B, S) and labels (B, S_dec), output.loss; S_dec, the "
                "decoder's length, is a size of its own (at() uses S when S_dec is not given)",
                dims=("S_dec",),
            )
        raise SymacctError(
            f"{name}: no default step for this encoder-decoder head",
            hint="pass inputs=lambda m, B, S: {'input_ids': ..., 'labels': ...} and loss=lambda out: out.loss",
        )
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return Task(
            "causal-lm", _causal, _output_loss, "causal LM step: input_ids (B, S), labels = input_ids, output.loss"
        )
    if name.endswith("ForMaskedLM"):
        return Task(
            "masked-lm",
            _masked,
            _output_loss,
            "masked LM step: input_ids (B, S), labels (B, S) (every position a target), output.loss",
        )
    if name.endswith("ForSequenceClassification"):
        return Task(
            "sequence-classification",
            _classify_text,
            _output_loss,
            "sequence classification step: input_ids (B, S), one label a sequence (as the config's problem_type "
            "reads it), output.loss",
        )
    if name.endswith("ForTokenClassification"):
        return Task(
            "token-classification",
            _classify_tokens,
            _output_loss,
            "token classification step: input_ids (B, S), a class index a position, labels (B, S), output.loss",
        )
    if name.endswith("ForQuestionAnswering"):
        return Task(
            "question-answering",
            _answer_span,
            _output_loss,
            "extractive question answering step: input_ids (B, S), the answer's start_positions and "
            "end_positions (B,), output.loss",
        )
    if name.endswith("ForImageClassification"):
        return Task(
            "image-classification",
            _classify_image,
            _output_loss,
            "image classification step: pixel_values (B, C, image_size, image_size), one label an image, "
            "output.loss; S reaches no tensor",
        )
    if name.endswith("Model") and getattr(model, "base_model", None) is model:
        return Task(
            "base",
            _base,
            _hidden_sum,
            "base model (no head): input_ids (B, S); the loss is a stand-in, the sum of the last hidden state "
            "(pass loss= for another)",
        )
    if name.endswith("ForConditionalGeneration") and getattr(config, "text_config", None) is not None:
        raise SymacctError(
            f"{name}: no default step for a multimodal model (its images or audio need inputs of their own)",
            hint="derive its language model alone, transformers.AutoModelForCausalLM.from_config(config.text_config), "
            "for its sizes as symbols; or pass inputs=lambda m, B, S: {...} (the model's keyword inputs) and "
            "loss=lambda out: out.loss",
        )
    raise SymacctError(
        f"{name}: no default step for this head",
        hint="pass inputs=lambda m, B, S: {...} (the model's keyword inputs) and loss=lambda out: ...",
    )


@contextlib.contextmanager
def eager_paths(own_positions: Callable[[], bool]) -> Iterator[None]:
    """While tracing a transformers model on fake tensors, take the path an eager run takes (see the module doc).

    ``own_positions()``: whether the step passes no ``position_ids`` (the
    model numbers the positions 0..S-1 itself, so no sequence is packed);
    only then is the eager answer known. The check's own ops still run.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    tracing = getattr(masking, "is_tracing", None)
    if original is None or tracing is None:
        yield
        return

    def eager_tracing(tensor: Any = None) -> bool:
        """transformers' question "is this a graph being traced?": for a fake tensor whose values the step
        made known (an all-ones padding mask: symacct.trace.known), the eager run's answer, so that it reads
        them as an eager run does; for any other fake tensor, yes."""
        return tracing(None if known(tensor) is not None else tensor)

    def unpacked(position_ids: torch.Tensor) -> torch.Tensor | None:
        mask = original(position_ids)
        if not own_positions():
            return mask
        if mask is not None:  # on fake tensors: the eager check, whose answer here is "not packed"
            (mask[:, -1] == 0).all()
        return None

    masking.find_packed_sequence_indices = unpacked
    masking.is_tracing = eager_tracing
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
        masking.is_tracing = tracing


def carried_settings(user: nn.Module) -> frozenset[tuple[Any, ...]]:
    """What ``carry_checkpointing`` carries from the user's model: (module type, on, function) of each module
    that can checkpoint."""
    return frozenset(
        (type(m), bool(getattr(m, "gradient_checkpointing", False)), getattr(m, "_gradient_checkpointing_func", None))
        for m in user.modules()
        if hasattr(m, "gradient_checkpointing")
    )


def carry_checkpointing(user: nn.Module, probe: nn.Module) -> None:
    """Gradient checkpointing enabled on the user's model (``gradient_checkpointing_enable()``) lives on its
    modules, not in the config: set it the same way on the model rebuilt at probe sizes.

    Only when every module that can checkpoint has the same setting (the usual all-layers case); otherwise the
    rebuilt model differs, and derive's comparison of the two refuses it. The forward hook transformers then
    registers on the input embeddings (``enable_input_require_grads``) is registered on the rebuilt model too.
    """
    settings = carried_settings(user)
    by_type = {t: (on, fn) for t, on, fn in settings}
    if len(by_type) != len(settings):
        return
    if getattr(user, "_require_grads_hooks", None):  # the input embeddings' forward hook checkpointing registers
        probe.enable_input_require_grads()  # (reentrant: the embeddings' output requires grad); compared as a hook
    for m in probe.modules():
        if type(m) in by_type:
            on, fn = by_type[type(m)]
            m.gradient_checkpointing = on
            if fn is not None:
                m._gradient_checkpointing_func = fn


_DERIVED_EXPERTS = ("grouped_mm",)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' experts modules (classes wrapped by ``use_experts_implementation``), with their paths."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "config")]


def check_experts_path(model: nn.Module) -> None:
    """Refuse an experts path whose shapes depend on the routing, or that no CPU kernel runs (module doc)."""
    for name, m in experts_modules(model):
        impl = getattr(m.config, "_experts_implementation", None) or "eager"
        if impl in _DERIVED_EXPERTS:
            continue
        why = {
            "eager": "loops over the experts the tokens were routed to (nonzero on the routing): its ops and "
            "shapes depend on tensor values",
            "batched_mm": "gathers one weight matrix per routed token (B*S*k copies of an expert's weights), "
            "a decoding kernel",
        }.get(impl, "is a GPU kernel")
        raise SymacctError(
            f"the experts path {impl!r} {why}",
            module=name,
            hint="build the model with experts_implementation='grouped_mm' (transformers' default; or call "
            "model.set_experts_implementation('grouped_mm')): the same routed work with fixed shapes, which "
            "symacct derives",
        )


def check_routing(model: nn.Module, routing: Any) -> None:
    """``routing=`` against the model's experts before anything is traced: one share per expert, and a model
    with experts at all (symacct.cost.experts checks the traced layers again, for any model)."""
    from symacct.cost.experts import no_expert_layers, normalised, wrong_share_count

    shares = normalised(routing)
    found = experts_modules(model)
    if not found:
        raise no_expert_layers()
    for name, m in found:
        n = getattr(m, "num_experts", None)
        if isinstance(n, int) and n != len(shares):
            raise wrong_share_count(len(shares), name, n)


def _sum_gradient(param: torch.Tensor, group: str) -> None:
    """Sum a whole parameter's gradient over the tensor-parallel group, in place (PyTorch's functional
    collective, as DTensor issues its own)."""
    c10d = torch.ops._c10d_functional
    c10d.wait_tensor(c10d.all_reduce_(param.grad, "sum", group))


def _replicated_with_grad_allreduce() -> Any:
    """transformers' ``replicated_with_grad_allreduce`` as a PyTorch ``ParallelStyle``: the module's
    parameters stay whole and plain on every rank, and each gradient is summed over the group once
    accumulated (``register_post_accumulate_grad_hook``, as transformers does): a norm over the heads this
    rank holds (Qwen3's ``q_norm``, ``k_norm``) sees only their part of its gradient."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedWithGradAllReduce(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            group = device_mesh.get_group().group_name
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(functools.partial(_sum_gradient, group=group))
            return module

    return ReplicatedWithGradAllReduce()


def _tp_style(style: str, where: str) -> Any:
    """A transformers tensor-parallel style name as PyTorch's ``parallelize_module`` style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # a whole input split by the layer itself (after a gathered projection: Phi3, Olmo2, GLM)
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": _replicated_with_grad_allreduce,
    }
    if style not in styles:
        raise SymacctError(
            f"the model's tensor-parallel plan uses the style {style!r} ({where}), which symacct does not translate",
            hint=f"pass tensor_parallel= a parallelize_module plan of your own; translated: {', '.join(styles)}",
        )
    return styles[style]()


def tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's own tensor-parallel plan (``model.tp_plan``: module path -> style name, from its
    config's ``base_model_tp_plan`` and the head's) with each style name as PyTorch's ``parallelize_module``
    style: ``colwise`` ColwiseParallel, ``rowwise`` RowwiseParallel, ``colwise_gather_output`` a
    ColwiseParallel gathering its output, ``embedding_rowwise`` the vocabulary-parallel RowwiseParallel,
    ``rowwise_split_input`` a RowwiseParallel taking a whole input and splitting it itself,
    ``replicated_with_grad_allreduce`` whole parameters whose gradients are summed over the group.
    transformers' own runtime is not what runs: PyTorch's styles of the same names do. None when the model
    carries no plan."""
    if not is_transformers_model(model):
        return None
    names = getattr(model, "tp_plan", None)
    if not isinstance(names, dict) or not names:
        return None
    return {path: _tp_style(style, path) for path, style in names.items()}


def is_config_file(name: str) -> bool:
    """Whether a CLI model name is a transformers config: a ``config.json`` file or a folder holding one."""
    from pathlib import Path

    p = Path(name)
    return (p.suffix == ".json" and p.is_file()) or (p.is_dir() and (p / "config.json").is_file())


def model_from_config_file(path: str, overrides: dict[str, Any]) -> nn.Module:
    """The model a published ``config.json`` describes, built on the meta device (no weights, nothing allocated).

    The class is the config's first ``architectures`` entry (``LlamaForCausalLM``); without one, the head of
    its ``model_type`` that trains the whole model: for an encoder-decoder the sequence-to-sequence head
    (speech-to-text for Whisper's kin: their causal-LM head is the decoder alone), else the causal-LM head,
    else the base model. ``overrides`` (already parsed) replace config fields. The notes name the class.
    """
    file, data = _read_config(path)
    if not isinstance(data, dict) or "model_type" not in data:
        raise SymacctError(
            f"{file} has no model_type: not a transformers config.json",
            hint="pass the config.json published with a model (it names its model_type)",
        )
    try:
        import transformers
    except ImportError as e:
        raise SymacctError(
            f"{file} is a transformers config, and transformers is not installed",
            hint='pip install "symacct[hf]"',
        ) from e
    data = {**data, **overrides}
    try:
        config = transformers.AutoConfig.for_model(**data)
    except Exception as e:
        raise SymacctError(
            f"transformers cannot build the config of {file}: {type(e).__name__}: {' '.join(str(e).split())}",
            hint="check the model_type and the --config values",
        ) from e
    archs = data.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    try:
        with torch.device("meta"):
            if cls is not None:
                return cls(config)
            heads = ["AutoModelForCausalLM"]
            if getattr(config, "is_encoder_decoder", False):
                heads = ["AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"]
            for head in heads:
                try:
                    return getattr(transformers, head).from_config(config)
                except ValueError:  # no such head for this model_type
                    continue
            return transformers.AutoModel.from_config(config)
    except SymacctError:
        raise
    except Exception as e:
        raise SymacctError(
            f"transformers cannot build the model of {file}: {type(e).__name__}: {' '.join(str(e).split())}",
            hint="check the config's architectures and the --config values",
        ) from e


def config_field_types(path: str) -> dict[str, type]:
    """The JSON type of each field of a config file (to parse --config values by)."""
    _, data = _read_config(path)
    if not isinstance(data, dict):
        return {}
    return {k: type(v) for k, v in data.items() if isinstance(v, (bool, int, float, str))}


def _read_config(path: str) -> tuple[Any, Any]:
    """The config file of ``path`` (the file, or ``config.json`` in the folder) and its parsed JSON."""
    import json
    from pathlib import Path

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        return file, json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise SymacctError(f"cannot read {file}: {e}", hint="pass a transformers config.json") from e


# config fields of a window kept at its value, past which a model takes another path (derived on one side)
WINDOWS = ("sliding_window", "keep_window_size", "attention_chunk_size")


def last_within(name: str, w: int) -> int:
    """The most positions a step attends to on the near side of the window ``name`` of ``w`` positions.
    transformers skips the mask (SDPA's ``is_causal``) only below a sliding or chunked window and builds it from
    a length of exactly the window on (``masking_utils``: ``kv_length < local_attention_size``), so ``w - 1``;
    Doge masks all but the top keys only past ``keep_window_size`` (``attn_mask.shape[-1] > keep_window_size``),
    so ``w``."""
    return w if name == "keep_window_size" else w - 1


def window_constraints(model: nn.Module, probe_S: int, probe_C: int | None = None) -> list[Any]:
    """A sliding-window attention (``config.sliding_window``, Mistral, Qwen2) takes another path on each side of
    its window: within it the mask is the causal one (SDPA's ``is_causal``), beyond it a window mask is built;
    a decode step's cache stops growing at the window. The figures are derived on the side the probe's
    sizes fall on (S, and C + S after a cache of C positions), and hold on that side only. So for the other
    windows of ``WINDOWS`` (Doge's ``keep_window_size``, past which it masks all but the top keys; Llama 4's
    ``attention_chunk_size``, whose chunked layers cache as a sliding window of the chunk)."""
    from symacct.symbols import sym
    from symacct.trace.constraints import Constraint

    out = []
    for name in WINDOWS:
        w = getattr(model.config, name, None)
        if not isinstance(w, int) or isinstance(w, bool) or w <= 0 or probe_S is None:
            continue
        why = (
            "transformers builds another mask beyond the window"
            if name == "sliding_window"
            else "a window kept at its value: the model may take another path beyond it"
        )
        where = f"the config's {name} = {w} ({why})"
        if probe_C is not None:  # decode: the probe's C + S positions
            total, probe_total = sym("C") + probe_S, probe_C + probe_S
        else:
            total, probe_total = sym("S"), probe_S
        last = last_within(name, w)
        if probe_total > last:  # past it: a length of exactly the window is not taken for the far side's
            out.append(Constraint("le", sympy.Integer(w + 1), total, where, path=True))
        else:
            out.append(Constraint("le", total, sympy.Integer(last), where, path=True))
    return out
