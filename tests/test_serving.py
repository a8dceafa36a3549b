"""Serving steps (derive(step="prefill" / "decode")) against real CPU runs with a real KV cache.

A real model (hypothesis-drawn sizes, every code-path switch) prefills a prompt of P tokens and then
generates T tokens one at a time with its cache. Each call's matmul FLOPs are counted by FlopCounterMode
(and the CPU flash-attention kernel, which it leaves out, by flop_counter's formulas) and its peak by a
storage tracker (live storages after every op); the cache tensors' bytes are measured after the prompt and
after every generated token. Each must equal the
derived formula at those sizes: the prefill's at S = P, the decode step's at C = P + t (t tokens already
generated), exactly.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import pytest
import sympy
import torch
from cases import sizes, switches
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct.measure.run import CpuFlashCounter, GroupedMmCounter, StorageTracker
from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
from symacct.symbols import sym

SMALL = {
    GPT2Config: GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=8),
    LlamaConfig: LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16, hidden_dim=12, max_seq_len=8),
}
MODELS = {GPT2Config: GPT2, LlamaConfig: Llama}


@cache
def _derived(
    kind: type, switches: tuple[tuple[str, Any], ...], step: str, cache_dtype: str | None = None
) -> symacct.Accounting:
    model = MODELS[kind](dataclasses.replace(SMALL[kind], **dict(switches)))
    return symacct.derive(model, step=step, cache_dtype=cache_dtype)


def derived(cfg: Any, step: str, cache_dtype: str | None = None) -> symacct.Accounting:
    """The serving accounting of ``cfg``'s code path (its switches), derived from a small model."""
    return _derived(type(cfg), switches(cfg), step, cache_dtype)


@st.composite
def serving_cases(draw: st.DrawFn) -> tuple[Any, int, int, int]:
    """(config, B, P prompt tokens, T generated tokens); the position table holds P + T. Sizes from 2: at
    size 1 PyTorch may take a view where it copies otherwise (docs/memory.md), and bytes are compared."""
    B, P, T = draw(st.integers(2, 3)), draw(st.integers(2, 9)), draw(st.integers(1, 3))
    table = P + T + draw(st.integers(0, 3))
    if draw(st.booleans()):
        H, dh = draw(st.integers(2, 4)), draw(st.integers(2, 6))
        cfg: Any = GPT2Config(
            n_layer=draw(st.integers(1, 3)),
            n_head=H,
            n_embd=H * dh,
            vocab_size=draw(st.integers(2, 40)),
            block_size=table,
            tie_weights=draw(st.booleans()),
            sdpa=draw(st.booleans()),
            bias=draw(st.booleans()),
        )
    else:
        Hkv, rep = draw(st.integers(2, 3)), draw(st.integers(2, 3))
        H, dh = Hkv * rep, 2 * draw(st.integers(1, 4))
        cfg = LlamaConfig(
            dim=H * dh,
            n_layers=draw(st.integers(1, 3)),
            n_heads=H,
            n_kv_heads=Hkv,
            vocab_size=draw(st.integers(2, 40)),
            hidden_dim=draw(st.integers(2, 30)),
            max_seq_len=table,
            sdpa=draw(st.booleans()),
        )
    return cfg, B, P, T


def _counted(model: torch.nn.Module, idx: torch.Tensor, kv: list, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """One real call: (FLOPs counted, the peak of live storages, by StorageTracker)."""
    tracker = StorageTracker([*model.parameters(), *model.buffers(), idx, *(t for pair in kv for t in pair)])
    # (the tracker holds weak references only: a cache entry the model replaces dies, as in a generate loop)
    with torch.no_grad(), tracker, FlopCounterMode(display=False) as fc, CpuFlashCounter() as flash:
        model(idx, cache=kv, cache_dtype=dtype)
    return fc.get_total_flops() + flash.total, tracker.peak


def _cache_bytes(kv: list) -> int:
    return sum(t.untyped_storage().nbytes() for pair in kv for t in pair)


def _at(acct: symacct.Accounting, cfg: Any, **values: int) -> symacct.Accounting:
    return acct.at(**sizes(cfg), **values)


CACHE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@given(serving_cases(), st.sampled_from(sorted(CACHE_DTYPES, key=str)))
def test_prefill_then_decode_equal_a_real_run(case, cache_dtype):
    """... with the cache in the model's dtype (fp32), in bf16 or in fp8 (cast up for attention)."""
    cfg, B, P, T = case
    torch.manual_seed(0)
    model = MODELS[type(cfg)](cfg).eval()
    prefill, decode = derived(cfg, "prefill", cache_dtype), derived(cfg, "decode", cache_dtype)
    idx = torch.randint(0, sizes(cfg)["V"], (B, P + T))
    kv: list = []
    at = _at(prefill, cfg, B=B, S=P)
    # each call's tokens in a tensor of their own (a slice would keep all P + T ids alive)
    assert _counted(model, idx[:, :P].clone(), kv, CACHE_DTYPES[cache_dtype]) == (at.flops.forward, at.memory.peak)
    assert _cache_bytes(kv) == at.memory.kv_cache
    for t in range(T):
        at = _at(decode, cfg, B=B, C=P + t)
        assert _counted(model, idx[:, P + t : P + t + 1].clone(), kv) == (at.flops.forward, at.memory.peak)
        assert _cache_bytes(kv) == at.memory.kv_cache  # the cache after P prompt tokens and t + 1 generated


def test_cache_formula_is_the_textbook_one_for_the_reference_models():
    """The cache after a step holds 2 (keys, values) x L x H_kv x d_head x itemsize bytes a position: for
    GPT-2 (H_kv = H, d_head = D/H) 2*L*D*4 under fp32; for Llama 2*L*H_kv*(D/H)*4."""
    B, C, L, D, H, H_kv = (sym(n) for n in ("B", "C", "L", "D", "H", "H_kv"))
    gpt2 = derived(GPT2Config(), "decode").memory.kv_cache
    assert sympy.simplify(gpt2 - 2 * L * D * 4 * B * (C + 1)) == 0
    llama = derived(LlamaConfig(), "decode").memory.kv_cache
    assert sympy.simplify(llama - 2 * L * H_kv * (D / H) * 4 * B * (C + 1)) == 0
    assert (
        sympy.simplify(derived(LlamaConfig(), "prefill").memory.kv_cache - 2 * L * H_kv * (D / H) * 4 * B * sym("S"))
        == 0
    )


def test_decode_computes_the_logits_of_the_last_position_only():
    """Generation samples from the last position: the head's product is 2*B*D*V FLOPs a decode step, and at
    prefill too (not 2*B*S*D*V). (The bytes a decode step reads are split and checked in
    test_decode_traffic_splits_the_bytes.)"""
    B, D, V = sym("B"), sym("D"), sym("V")
    for step in ("prefill", "decode"):
        acct = derived(GPT2Config(), step)
        head = [r for _, r in symacct.cost.graph.records(acct.graph) if r.module == "lm_head" and r.cost.flops != 0]
        assert [r.cost.flops for r in head] == [2 * B * D * V]


def test_serving_steps_refuse_what_they_cannot_do():
    model = GPT2(SMALL[GPT2Config])
    with pytest.raises(symacct.SymacctError, match="optimizer"):
        symacct.derive(model, step="decode", optimizer="adamw")
    with pytest.raises(symacct.SymacctError, match="unknown step"):
        symacct.derive(model, step="generate")

    class NoCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(symacct.SymacctError, match="decode_inputs"):
        symacct.derive(NoCache(), step="decode")


def test_serve_figures_hold_on_the_derived_steps():
    """serve()'s answers checked on the accountings themselves: the cache of context positions is the
    textbook size (multi-head fp32: 2*L*D*4 a position), the largest batch fits and one more does not, and
    the batch where decode turns compute-bound is the first whose FLOP time reaches its byte time."""
    from symacct.time.hardware import get
    from symacct.time.serving import serve

    cfg = GPT2Config(n_layer=2, n_head=8, n_embd=1024, vocab_size=1000, block_size=64)
    prefill, decode = _derived(GPT2Config, (), "prefill"), _derived(GPT2Config, (), "decode")
    model_sizes = sizes(cfg)
    hw = get("H100-SXM")
    s = serve(_with_sizes(prefill, model_sizes), _with_sizes(decode, model_sizes), hardware=hw, context=16, batch=3)
    assert s.cache_bytes == 2 * cfg.n_layer * cfg.n_embd * 4 * 3 * 16 == s.textbook_bytes_per_token * 3 * 16
    budget = int(hw.memory_bytes * 0.85)
    dec = _with_sizes(decode, model_sizes)
    assert dec.peak(B=s.max_batch, C=15) <= budget < dec.peak(B=s.max_batch + 1, C=15)

    def compute_bound(b: int) -> bool:
        at = dec.at(B=b, C=15)
        flops = at.flops.total / (hw.peak["fp32"] * 1e12) + at.flops.other / (hw.peak["fp32"] * 1e12)
        return flops >= (at.bytes.read + at.bytes.written) / hw.bandwidth

    b = s.compute_bound_batch
    assert b is not None and compute_bound(b) and (b == 1 or not compute_bound(b - 1))
    assert s.tokens_per_second == pytest.approx(3 / s.decode_seconds)


class _LargeBatchLlama(Llama):
    """Llama whose step takes another path past 1,000 sequences (its output doubled there: one more op)."""

    def forward(self, tokens: torch.Tensor, targets: Any = None, cache: Any = None, cache_dtype: Any = None) -> Any:
        out = super().forward(tokens, targets, cache, cache_dtype)  # (B, S, V) logits, or the loss
        return out * 2 if tokens.shape[0] > 1000 else out


@pytest.mark.slow
def test_serve_stops_its_batch_searches_at_the_largest_batch_the_formulas_hold_at():
    """A decode step that takes another path past B = 1,000 is derived with B <= 1,000 (pass 4 traces the
    user's model at a batch of 8,191). serve's largest batch was the fit's 3,766,057 on the small path's
    figures, far past that; it now stops at the bound, and says so, as does its search for the batch where
    decode turns compute-bound (memory-bound up to 1,000 here)."""
    from symacct.time.serving import serve

    model = _LargeBatchLlama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, hidden_dim=48))
    prefill, decode = symacct.derive(model, step="prefill"), symacct.derive(model, step="decode")
    assert any("the figures hold for B <= 1000" in n for n in decode.notes)
    s = serve(prefill, decode, hardware="H100-SXM", context=32)
    assert s.max_batch == 1000 and s.compute_bound_batch is None
    assert any("B=1000 is the largest value the formulas hold at" in n for n in s.notes)
    assert any(
        "memory-bound up to a batch of 1000 at this context, the largest the formulas hold at" in n for n in s.notes
    )


def test_serve_says_when_the_batchs_prefill_or_decode_does_not_fit():
    """The time to first token is the prefill of the whole batch's prompts at once, whose peak (the S x S
    scores of matmul attention, the activations of every prompt token) can exceed the device where the decode
    step fits many more sequences: serve gives that peak and says how many prompts fit at once."""
    from symacct.time.hardware import Accelerator
    from symacct.time.serving import serve

    prefill, decode = _derived(GPT2Config, (), "prefill"), _derived(GPT2Config, (), "decode")
    decode_4 = decode.peak(B=4, C=7)
    small = Accelerator("tiny", {"fp32": 1.0}, decode_4 / 0.85e9, 1.0, 1.0, "a device the decode of 4 just fits")
    s = serve(prefill, decode, hardware=small, context=8, batch=4)
    budget = int(small.memory_bytes * 0.85)
    assert s.peak_bytes <= budget and s.max_batch >= 4
    assert s.prefill_peak_bytes == prefill.peak(B=4, S=7) > budget
    n = next(b for b in range(4) if prefill.peak(B=b + 1, S=7) > budget)
    assert any(
        "the 4 prompts of 7 tokens at once peak at" in x and f"at most {n} of them fit at once" in x for x in s.notes
    )
    assert not any(x.startswith("prefill:") for x in serve(prefill, decode, hardware="H100-SXM", context=8).notes)
    assert not any(x.startswith("decode:") for x in s.notes)  # batch 4 decodes within the budget
    s = serve(prefill, decode, hardware=small, context=8, batch=s.max_batch + 1)  # one sequence more does not
    assert s.peak_bytes > budget and any(
        x.startswith(f"decode: batch {s.batch} at context 8 peaks at") and f"fits: {s.batch - 1})" in x for x in s.notes
    )


def test_serve_gives_the_longest_prompt_prefilled_whole():
    """The longest context counts the decode step alone. A prompt that long may not prefill whole: matmul
    attention's S x S scores grow faster than the cache. serve gives the longest prompt whose prefill, one
    prompt at once, fits (checked on the prefill's exact peak: it fits and one token more does not), and says
    when it is shorter than the longest context's prompt."""
    from symacct.time.hardware import Accelerator
    from symacct.time.serving import serve

    cfg = GPT2Config(n_layer=2, n_head=8, n_embd=256, vocab_size=1000, block_size=4096)
    prefill, decode = (_with_sizes(_derived(GPT2Config, (), s), sizes(cfg)) for s in ("prefill", "decode"))
    top = decode.peak(B=1, C=4095)
    assert prefill.peak(B=1, S=4096) > 2 * top  # the scores: the whole prefill needs far more than the decode
    small = Accelerator("tiny", {"fp32": 1.0}, 2 * top / 0.85e9, 1.0, 1.0, "twice the longest decode step")
    budget = int(small.memory_bytes * 0.85)
    s = serve(prefill, decode, hardware=small, context=64)
    assert s.max_context == 4096 and s.max_prompt is not None and s.max_prompt < 4095
    assert prefill.peak(B=1, S=s.max_prompt) <= budget < prefill.peak(B=1, S=s.max_prompt + 1)
    assert any(f"a prompt of more than {s.max_prompt} tokens does not fit prefilled whole" in x for x in s.notes)
    s = serve(prefill, decode, hardware="H100-SXM", context=64)  # there the whole table prefills at once
    assert s.max_prompt == 4096 and not any("prefilled whole" in x for x in s.notes)
    s = serve(prefill, decode, hardware=small, context=4096)  # the asked prompt itself: one prompt, no groups
    assert any(x.startswith("prefill: the prompt of 4095 tokens peaks at") and "chunks" in x for x in s.notes)


def test_serve_refuses_steps_of_two_models():
    """Every serve() figure mixes the two steps (time to first token from the prefill, the rest from the
    decode): a prefill and a decode of different sizes, parameters or cache dtypes are refused, where they
    used to give figures of neither model."""
    from symacct.time.serving import serve

    prefill, decode = _derived(GPT2Config, (), "prefill"), _derived(GPT2Config, (), "decode")
    assert serve(prefill, decode, hardware="H100-SXM", context=8).cache_bytes_per_token > 0  # the same model
    wider = _with_sizes(decode, {"D": 2 * decode.symbols["D"]})
    with pytest.raises(symacct.SymacctError, match="not of the same model .sizes differ: D=8 and 16"):
        serve(prefill, wider, hardware="H100-SXM", context=8)
    bf16 = _derived(GPT2Config, (), "decode", cache_dtype="bf16")
    with pytest.raises(symacct.SymacctError, match="options differ: cache_dtype"):
        serve(prefill, bf16, hardware="H100-SXM", context=8)
    untied = _derived(GPT2Config, (("tie_weights", False),), "decode")  # one more (V, D) weight
    with pytest.raises(symacct.SymacctError, match="their parameters differ"):
        serve(prefill, untied, hardware="H100-SXM", context=8)


@pytest.mark.parametrize("sdpa", [False, True])
def test_multi_head_llama_serves_with_its_heads_as_symbols(sdpa):
    """Llama 2's own layout, one key/value head a head (the preset ``symacct serve llama``): its cache entry is
    a view of the rotated keys, so the matmuls after it reshape other shapes than at grouped heads. The
    prefill used to give up its head counts (fixed at their values) where the decode tied H_kv to H, and
    serve() then refused the pair as two models. Both steps now tie H_kv to H, serve() takes them, and each
    equals a real run of the model with a real cache (FLOPs, peak, cache bytes)."""
    from symacct.time.serving import serve

    cfg = LlamaConfig(dim=24, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=16, hidden_dim=12, max_seq_len=12)
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(cfg, sdpa=sdpa)).eval()
    prefill, decode = symacct.derive(model, step="prefill"), symacct.derive(model, step="decode")
    for acct in (prefill, decode):
        assert acct.symbols["H"] == 4 and "H_kv" not in acct.symbols
        assert any("n_kv_heads = n_heads (no grouped heads): it follows H" in n for n in acct.notes)
    assert serve(prefill, decode, hardware="H100-SXM", context=10).cache_bytes_per_token == 2 * 2 * 24 * 4
    B, P = 3, 5
    idx, kv = torch.randint(0, 16, (B, P + 2)), []
    assert _counted(model, idx[:, :P].clone(), kv) == (prefill.at(B=B, S=P).flops.forward, prefill.peak(B=B, S=P))
    assert _cache_bytes(kv) == prefill.at(B=B, S=P).memory.kv_cache
    for t in range(2):
        at = decode.at(B=B, C=P + t)
        assert _counted(model, idx[:, P + t : P + t + 1].clone(), kv) == (at.flops.forward, at.memory.peak)
        assert _cache_bytes(kv) == at.memory.kv_cache


def _with_sizes(acct: symacct.Accounting, values: dict[str, int]) -> symacct.Accounting:
    """The accounting with the model's own sizes set to ``values`` (the small model derived stands for the
    configs of its code path)."""
    return dataclasses.replace(acct, symbols={**acct.symbols, **values})


@pytest.mark.slow
def test_serve_on_the_command_line(tmp_path):
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "symacct.cli", "serve", "gpt2", "--config", "n_layer=2", "--hardware", "H100-SXM"]
    done = subprocess.run([*cli, "--context", "512", "--batch", "4", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["cache_bytes_per_token"] == got["textbook_bytes_per_token"] == 2 * 2 * 768 * 4
    assert got["batch"] == 4 and got["context"] == 512 and got["max_context"] == 1024
    text = subprocess.run([*cli, "--context", "512"], capture_output=True, text=True).stdout
    assert "GiB, fp32 (the model's own; --params-dtype bf16 for bf16)" in text  # which dtype the weights are in
    text = subprocess.run([*cli, "--context", "512", "--params-dtype", "bf16"], capture_output=True, text=True).stdout
    assert f"weights                   {got['weights_bytes'] / 2 / 2**30:.2f} GiB, bf16\n" in text
    for out in (tmp_path / "a", tmp_path / "b"):  # the plot, written twice: byte-identical SVG
        done = subprocess.run([*cli, "--context", "512", "--out", str(out)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    svg = [(tmp_path / d / "gpt2-serving-memory.svg").read_bytes() for d in ("a", "b")]
    assert svg[0] == svg[1] and (tmp_path / "a" / "gpt2-serving-memory.png").stat().st_size > 0
    for bad in (["--context", "1"], ["--context", "4096"], ["--context", "64", "--prompt", "64"]):
        done = subprocess.run([*cli, *bad], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.startswith("symacct: error:") and done.stderr.count("\n") == 1


@cache
def _hf(kind: str) -> tuple[Any, symacct.Accounting, symacct.Accounting]:
    """A tiny transformers causal LM (Llama with grouped-query attention; Mistral with a sliding window),
    its derived prefill and decode."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, max_position_embeddings=64))
    else:
        cfg = transformers.MistralConfig(**common, max_position_embeddings=2048, sliding_window=1024)
        model = transformers.MistralForCausalLM(cfg)
    model.eval()
    return model, symacct.derive(model, step="prefill"), symacct.derive(model, step="decode")


@given(st.sampled_from(["llama", "mistral"]), st.integers(1, 3), st.integers(2, 12), st.integers(1, 3))
def test_transformers_prefill_then_decode_with_its_own_cache(kind, B, P, T):
    """The model's own DynamicCache (sliding-window layers for Mistral), as generate() drives it: each call's
    FLOPs and peak, and the cache's bytes after the prompt and every token, equal the derived formulas."""
    transformers = pytest.importorskip("transformers")
    model, prefill, decode = _hf(kind)
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(0, 128, (B, P + T))

    def run(x: torch.Tensor) -> tuple[int, int]:
        cached = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        tracker = StorageTracker([*model.parameters(), *model.buffers(), x, *(t for t in cached if t is not None)])
        del cached  # weak references only: the cache's old entries die as it replaces them
        with torch.no_grad(), tracker, FlopCounterMode(display=False) as fc, CpuFlashCounter() as flash:
            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return fc.get_total_flops() + flash.total, tracker.peak

    def held() -> int:
        return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))

    at = prefill.at(B=B, S=P)
    assert run(ids[:, :P].clone()) == (at.flops.forward, at.memory.peak) and held() == at.memory.kv_cache
    for t in range(T):
        at = decode.at(B=B, C=P + t)
        assert run(ids[:, P + t : P + t + 1].clone()) == (at.flops.forward, at.memory.peak)
        assert held() == at.memory.kv_cache


def test_a_sliding_window_bounds_the_decode_formulas():
    """Beyond Mistral's window its cache stops growing and another mask is built: the decode formulas,
    derived within the window, refuse a context past it (never a silent figure). transformers builds the
    window's mask from exactly the window's length on (``kv_length >= sliding_window``), so a token decoded
    after 1,023 cached positions (1,024 in all) already takes the far side's path: the bound accepted it, and
    its peak was derived 1,024 bytes below what the real step holds. The near side ends one position
    earlier now."""
    transformers = pytest.importorskip("transformers")
    model, _, decode = _hf("mistral")
    with pytest.raises(symacct.SymacctError, match="sliding_window") as e:
        decode.at(B=1, C=1023)
    assert "the side derived" in str(e.value)  # the model runs there: another path, not an impossible size
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(0, 128, (1, 1024))
    _generation_call(model, cache, ids[:, :1022].clone())  # a prompt of 1,022 positions
    at = decode.at(B=1, C=1022)
    assert _generation_call(model, cache, ids[:, 1022:1023].clone()) == (
        at.flops.forward,
        at.memory.peak,
        at.memory.kv_cache,
    )
    unbounded = dataclasses.replace(decode, constraints=[c for c in decode.constraints if not c.path])
    at = unbounded.at(B=1, C=1023)  # the near side's formulas, read past the bound
    flops, peak, _ = _generation_call(model, cache, ids[:, 1023:1024].clone())
    assert flops == at.flops.forward and peak > at.memory.peak  # the window's mask, materialised


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_quantization_reprices_the_linear_weights(bits):
    """int8 / int4 weight-only, one bf16 scale a group of 128: every nn.Linear weight held and read at
    bits/8 + 2/128 bytes; checked against the real model's own modules (an independent count): the weights'
    bytes, the peak and the bytes the decode step reads all drop by the same amount, the FLOPs do not."""
    from symacct.time.serving import quantize

    cfg = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=160, max_seq_len=64)
    model = Llama(cfg)
    decode = symacct.derive(model, step="decode")
    q = quantize(decode, bits)
    bpw = sympy.Rational(bits, 8) + sympy.Rational(2, 128)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    other = sum(p.numel() for p in model.parameters()) - linear
    cut = linear * (4 - bpw)  # fp32 weights
    before, after = decode.at(B=2, C=10), q.acct.at(B=2, C=10)
    assert after.memory.params == linear * bpw + other * 4
    assert after.memory.peak == before.memory.peak - cut == q.acct.peak(B=2, C=10)
    assert after.bytes.read == before.bytes.read - cut and after.bytes.read_forward == before.bytes.read_forward - cut
    assert after.flops.forward == before.flops.forward and after.memory.kv_cache == before.memory.kv_cache
    assert sum(v["bytes_read"] for v in after.modules.values()) == after.bytes.read
    assert len(q.weights) == 1 + 7 * 4  # the head, and 7 linear layers in each of the probe's 4 blocks
    with pytest.raises(symacct.SymacctError, match="8 or 4"):
        quantize(decode, 3)
    # serve(weight_bits=) searches the quantized steps' peaks (an inference step's every step is its first)
    from symacct.time.hardware import Accelerator
    from symacct.time.serving import serve

    small = Accelerator("tiny", {"fp32": 1.0}, 0.001, 1.0, 1.0, "a made-up 1 MB device")
    s = serve(symacct.derive(model, step="prefill"), decode, hardware=small, context=11, batch=2, weight_bits=bits)
    budget = int(small.memory_bytes * 0.85)
    assert q.acct.peak(B=s.max_batch, C=10) <= budget < q.acct.peak(B=s.max_batch + 1, C=10)


def test_decode_traffic_splits_the_bytes():
    """A decode step reads every weight whole except the embedding table (a lookup reads its rows), the
    incoming cache once (the concatenation), and writes the whole cache again (C + 1 positions): checked
    against the real model's own parameters and the cache's size; the parts add up to the totals."""
    from symacct.time.serving import traffic

    cfg = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=160, max_seq_len=64)
    model = Llama(cfg)
    decode = symacct.derive(model, step="decode")
    t = {
        k: int(v.xreplace({sym(n): x for n, x in decode.with_defaults(B=2, C=10).items()}))
        for k, v in vars(traffic(decode)).items()
    }
    table = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert t["weights_read"] == 4 * (sum(p.numel() for p in model.parameters()) - table)
    per_position = 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.dim // cfg.n_heads) * 4 * 2  # keys, values; B = 2
    assert t["cache_read"] == per_position * 10 and t["cache_written"] == per_position * 11
    at = decode.at(B=2, C=10)
    assert t["weights_read"] + t["cache_read"] + t["other_read"] == at.bytes.read
    assert t["cache_written"] + t["other_written"] == at.bytes.written


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
def test_sheet_of_a_decode_step(tmp_path):
    """symacct sheet --step decode: the KV cache after the step and a position of it, derived, beside the
    textbook 2*L*H_kv*d_head*bytes; --context sets C + 1; --seq is refused; --out plots memory against
    the context."""
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "symacct.cli", "sheet", "gpt2", "--config", "n_layer=2", "--batch", "2"]
    done = subprocess.run(
        [*cli, "--step", "decode", "--context", "512", "--format", "json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)["totals"]}
    per_position = 2 * 2 * 768 * 4  # keys and values, 2 layers of width 768, fp32
    assert rows["memory.kv_cache"]["value"] == per_position * 2 * 512
    assert rows["memory.kv_cache_per_token"]["value"] == per_position
    assert f"{per_position:,}" in rows["memory.kv_cache_per_token"]["label"]
    assert "flops.backward" not in rows and "memory.grads" not in rows
    done = subprocess.run([*cli, "--step", "decode", "--seq", "8"], capture_output=True, text=True)
    assert done.returncode == 2 and "--context" in done.stderr
    done = subprocess.run(
        [*cli, "--step", "decode", "--out", str(tmp_path), "--format", "md"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gpt2-serving-memory.svg").exists() and (tmp_path / "gpt2.md").exists()


def _served(model: Any, B: int, N: int) -> tuple[Any, Any, Any]:
    """A transformers causal LM in eval mode: its derived prefill and decode, and ``run(a, b)``, which runs
    positions a..b-1 of B random sequences of N tokens with the model's own cache (``_generation_call``)."""
    import transformers

    model.eval()
    prefill, decode = symacct.derive(model, step="prefill"), symacct.derive(model, step="decode")
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(0, model.config.vocab_size, (B, N))
    return prefill, decode, lambda a, b: _generation_call(model, cache, ids[:, a:b].clone())


TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _tiny(name: str, **fields: Any) -> Any:
    """A tiny transformers ``{name}ForCausalLM`` (``{name}Config`` of TINY's widths and ``fields``), seeded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**{**TINY, **fields})
    return getattr(transformers, f"{name}ForCausalLM")(config)


def _held(cache: Any) -> list[torch.Tensor]:
    """What a transformers cache holds: each layer's keys and values, and a sparse attention's indexer keys (not
    a shared layer's, which holds none)."""
    names = ("keys", "values", "indexer_keys")
    return [t for layer in cache.layers for n in names if isinstance(t := getattr(layer, n, None), torch.Tensor)]


def _generation_call(model: Any, cache: Any, x: torch.Tensor) -> tuple[int, int, int]:
    """One call of a transformers causal LM with its cache, as generate() makes it: its FLOPs (FlopCounterMode,
    the CPU flash kernel and a mixture's grouped matmuls), its peak, and the cache's bytes after it."""
    cached = _held(cache)
    tracker = StorageTracker([*model.parameters(), *model.buffers(), x, *cached])
    del cached  # weak references only: the cache's old entries die as it replaces them
    counters = (FlopCounterMode(display=False), CpuFlashCounter(), GroupedMmCounter())
    with torch.no_grad(), tracker, counters[0] as fc, counters[1] as flash, counters[2] as grouped:
        model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
    cached = _held(cache)
    return (
        fc.get_total_flops() + flash.total + grouped.total,
        tracker.peak,
        sum(t.untyped_storage().nbytes() for t in cached),
    )


def _exact_through_generation(model: Any, B: int, P: int, T: int) -> Any:
    """A prompt of P tokens, then T tokens one at a time, as generation runs them: each call's FLOPs, peak and
    cache bytes equal the derived prefill's and decode's. The prefill's figures at (B, P)."""
    prefill, decode, run = _served(model, B, P + T)
    first = prefill.at(B=B, S=P)
    assert run(0, P) == (first.flops.forward, first.memory.peak, first.memory.kv_cache)
    for t in range(T):
        at = decode.at(B=B, C=P + t)
        assert run(P + t, P + t + 1) == (at.flops.forward, at.memory.peak, at.memory.kv_cache)
    return first


def test_decode_beyond_a_small_window_holds_the_steady_states_cache():
    """A window of 4 that the probe's context passes: the decode formulas are those beyond the window, where
    each sliding layer keeps a view of its last concatenation (window positions) as generation leaves it
    after a decode step. Every decode step after the first equals a real generation's (FLOPs, peak, cache
    bytes); the first one after a longer prompt still holds the prompt's storage for part of the step, so its
    real peak is above the derived one by at most (prompt - window) positions of every layer."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    B, P, T = 2, 7, 4
    prefill, decode, run = _served(transformers.MistralForCausalLM(cfg), B, P + T)
    at = prefill.at(B=B, S=P)
    assert run(0, P) == (at.flops.forward, at.memory.peak, at.memory.kv_cache)
    position = 2 * B * 2 * 8 * 4  # keys and values of one position of one layer: B, H_kv, head_dim, fp32
    for t in range(T):
        at = decode.at(B=B, C=P + t)
        flops, peak, held = run(P + t, P + t + 1)
        assert (flops, held) == (at.flops.forward, at.memory.kv_cache)
        if t == 0:
            assert 0 < peak - at.memory.peak <= (P - 4) * position * 2
        else:
            assert peak == at.memory.peak


def test_transformers_gpt2_decodes_up_to_its_position_table():
    """GPT-2's learned positions: a decode step embeds position C, so C + 1 <= n_positions. The position ids
    are arange(1) shifted by the cache's length, an int read from a shape: read back as C (it was taken as the
    probe's constant 368, which refused every decode step). Exact against a real generation, and refused
    one position past the table."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    decode = symacct.derive(model, step="decode")
    assert any(str(c.lhs) == "C + 1" and str(c.rhs) == "S_max" for c in decode.constraints)
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        model(input_ids=ids[:, :5], cache=cache, use_cache=True)
    for C in range(5, 16):
        at = decode.at(B=2, C=C)
        with torch.no_grad(), FlopCounterMode(display=False) as fc, CpuFlashCounter() as flash:
            model(input_ids=ids[:, C : C + 1], cache=cache, use_cache=True, logits_to_keep=1)
        assert fc.get_total_flops() + flash.total == at.flops.forward
    with pytest.raises(symacct.SymacctError, match="C \\+ 1 <= S_max"):
        decode.at(B=2, C=16)


@pytest.mark.slow  # DeepSeek-V3 derivations and a generation: in CI's slow pass (the default run's 20 minutes)
def test_deepseek_v3_caches_its_latent_and_decodes_exactly():
    """DeepSeek-V3's multi-head latent attention caches the compressed latent (kv_lora_rank wide) and the
    rotary key (qk_rope_head_dim wide), one head each, not keys and values a head: the decode probe fills
    the cache in those shapes (it was refused, the probe's keys not fitting the latent). A prompt, then
    tokens one at a time, as generation runs them: FLOPs (with the routed experts' grouped matmuls), the
    peak and the cache's bytes equal the derived formulas."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=64, max_position_embeddings=64, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    B, P = 2, 5
    at = _exact_through_generation(transformers.DeepseekV3ForCausalLM(cfg), B, P, 3)
    assert at.memory.kv_cache == 2 * B * P * (16 + 8) * 4  # two layers: latent and rotary key, fp32


@pytest.mark.slow
def test_a_model_that_changes_itself_on_its_first_call_is_served_as_after_it():
    """BigBird switches from block-sparse to full attention on its first call of a short sequence: each layer
    builds a new attention module (three new D x D projections, dropped at once, the old ones kept). The
    prompt's call makes that switch, the decode steps after it do not: a serving step is traced as a second
    call runs it, and a note says so. The decode steps are exact through generation (the derived peak was
    12 D^2 + 12 D bytes high, and the stack left unfactored: the switch made the traced blocks differ); the
    prefill, a first call here, has the same figures (the switch sets no peak of it)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BigBirdConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
        max_position_embeddings=64, is_decoder=True,
    )  # fmt: skip
    assert cfg.attention_type == "block_sparse"
    torch.manual_seed(0)
    model = transformers.BigBirdForCausalLM(cfg)
    prefill, decode, run = _served(model, 2, 8)
    first = prefill.at(B=2, S=5)
    assert run(0, 5) == (first.flops.forward, first.memory.peak, first.memory.kv_cache)
    assert model.bert.attention_type == "original_full"  # the real model switched on its first call
    for C in range(5, 8):
        at = decode.at(B=2, C=C)
        assert run(C, C + 1) == (at.flops.forward, at.memory.peak, at.memory.kv_cache)
    for acct in (prefill, decode, symacct.derive(model, step="forward")):
        assert any("changes itself on its first call (module bert.encoder.layer.0.attention.self replaced" in n
                   for n in acct.notes)  # fmt: skip
        assert "L" in {str(s) for s in acct.memory.peak.free_symbols}


def test_a_mixture_of_experts_decodes_within_its_window():
    """A mixture of experts probes its widths as multiples of 16 (grouped matmuls want 16-byte strides); the
    cached positions C were scaled so too, as if a width: the decode probe's cache (16 * prime) passed
    Mixtral's window of 4,096 positions, and the second probe's did not, so derive refused the model. C is a
    length, probed as S is: within the window, exact through generation, bounded by it."""
    model = _tiny(
        "Mixtral", vocab_size=64, max_position_embeddings=8192, sliding_window=4096, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    _exact_through_generation(model, 2, 5, 3)
    decode = symacct.derive(model, step="decode")  # the family memoised: the formulas above
    decode.at(B=1, C=4094)
    with pytest.raises(symacct.SymacctError, match="sliding_window"):
        decode.at(B=1, C=4095)  # 4,096 positions in all: the window's mask is built


def test_a_part_the_step_never_runs_counts_its_parameters_as_numbers():
    """GIT's image encoder (a nested vision config the probes keep) sits idle in a text-only prompt: no op
    reads its sizes, and its position table (197 rows: 14 x 14 patches and a class token) reads in no symbol.
    Its parameters' bytes were None there, and derive failed with "a defect of symacct". A parameter or
    buffer whose size reads in no symbol counts as the number it is, checked against the second probe with
    the others (a size that did vary would be refused there). Exact through generation, and the parameter
    count equals the real model's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GitConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GitForCausalLM(cfg)
    first = _exact_through_generation(model, 2, 5, 3)
    assert first.params == sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.git.image_encoder.parameters())
    assert vision > 0 and first.memory.params >= 4 * vision


@pytest.mark.slow
def test_gpt_oss_serves_past_its_window_of_128_positions():
    """GPT-OSS's sliding layers keep 128 positions. The first probe's prompt and cache pass the window (the
    layer then caches window - 1 = 127 positions, a prime no symbol carries) and the second probe's did not,
    so the two traced two paths: derive refused the prefill ("not a product of the model's symbols") and
    the decode. The window's neighbours now read as constants, and the second probe's lengths are taken past
    every window the first passes (S, C and S_max doubled). Exact through generation past the window;
    a prompt within it is refused, as the other side of the window. Training, at sizes past the window, is
    exact against a real step too."""
    from test_transformers import check_exact

    model = _tiny(
        "GptOss", vocab_size=96, max_position_embeddings=4096, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=128,
    )  # fmt: skip
    _exact_through_generation(model, 2, 200, 3)
    prefill = symacct.derive(model, step="prefill")
    with pytest.raises(symacct.SymacctError, match="129 <= S"):
        prefill.at(B=2, S=100)
    model.train()
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 131)])


@pytest.mark.slow
def test_llama4s_attention_chunk_bounds_the_formulas_as_a_window():
    """Llama 4's chunked layers (``attention_chunk_size``) attend within chunks and cache as a sliding window of
    the chunk (transformers' ``DynamicSlidingWindowLayer``): another mask and a cache that stops growing past
    it. The chunk was no bound: a chunk of 16, which the probe's lengths pass, gave a prompt of 10 (within
    it) the figures from beyond, silently (the cache after a decode step 15,104 bytes for 11,264; a training
    step's saved activations 10,080 bytes high). Now it bounds the formulas as a window does: a prompt of 10
    is refused, one of 40 is exact in prefill and in every decode step after the first (whose peak holds the
    prompt's storage a while, as past a sliding window)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        **{**TINY, "num_hidden_layers": 4}, intermediate_size_mlp=48, vocab_size=96, max_position_embeddings=256,
        head_dim=8, attention_chunk_size=16,
    )  # fmt: skip
    model = transformers.Llama4ForCausalLM(config)
    assert model.config.layer_types.count("chunked_attention") == 3
    B, P = 2, 40
    prefill, decode, run = _served(model, B, P + 3)
    with pytest.raises(symacct.SymacctError, match="attention_chunk_size = 16"):
        prefill.at(B=B, S=10)
    with pytest.raises(symacct.SymacctError, match="attention_chunk_size = 16"):
        decode.at(B=B, C=10)
    at = prefill.at(B=B, S=P)
    assert run(0, P) == (at.flops.forward, at.memory.peak, at.memory.kv_cache)
    for t in range(3):
        at = decode.at(B=B, C=P + t)
        flops, peak, held = run(P + t, P + t + 1)
        assert (flops, held) == (at.flops.forward, at.memory.kv_cache)
        assert peak > at.memory.peak if t == 0 else peak == at.memory.peak


@pytest.mark.slow  # a sparse attention's derivations and a generation: in CI's slow pass (the default run's 20 minutes)
def test_a_sparse_attentions_indexer_keys_are_part_of_the_cache():
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4): each layer's indexer scores every cached
    position with keys of its own, which transformers caches beside the latent (``DynamicIndexedLayer``). The
    decode probe's cache held no indexer keys, so its indexers scored one position: the FLOPs missed the
    indexers' share of the context, the peak and the cache their keys, silently (at B = 2, C = 5: 136,163,840
    FLOPs for 136,494,080, a cache of 55,296 bytes for 67,584). Which layers cache indexer keys, and how wide,
    is read from a one-token call of the model. Exact through generation; the prefill's cache holds, a layer
    and a position, the latent, the rotary key and the indexer's key, in float32."""
    model = _tiny(
        "DeepseekV32", num_key_value_heads=4, vocab_size=96, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    c = model.config
    first = _exact_through_generation(model, 2, 5, 3)
    assert (
        first.memory.kv_cache
        == c.num_hidden_layers * 2 * 5 * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * 4
    )


def test_a_multi_query_caches_single_head_is_read_from_the_model():
    """GPT-BigCode (StarCoder) caches one key and value head (``multi_query``) whatever else its config says. The
    decode probe's cache took its heads from the config's ``num_key_value_heads``: with that field set to 2 (a
    config converted from another family's carries it), the cache had 2 heads and the step was refused as "a
    size typed in". What a layer caches is now read from a one-token call of the model: exact through
    generation, and the prefill's cache holds one head of keys and of values a layer and a position."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64)
    config.num_key_value_heads = 2  # ignored by the model: multi_query
    assert config.multi_query
    first = _exact_through_generation(transformers.GPTBigCodeForCausalLM(config), 2, 5, 3)
    assert first.memory.kv_cache == 2 * 2 * 2 * 5 * 1 * (32 // 4) * 4  # layers, keys and values, B, S, 1 head


@pytest.mark.slow
def test_a_linear_attentions_state_is_refused_by_name_in_a_decode_step():
    """LFM2's convolution layers cache a state of the last positions (``LinearAttentionLayer``), not keys and
    values; symacct does not build it for a decode step, so the step is refused naming the layer and what it
    holds (it failed inside the cache's construction: "could not build the inputs"). The prefill, which
    starts from an empty cache, is derived."""
    model = _tiny("Lfm2", vocab_size=96, max_position_embeddings=64, layer_types=["conv", "full_attention"])
    with pytest.raises(symacct.SymacctError, match=r"layer 0's cache \(LinearAttentionLayer\) holds conv_states"):
        symacct.derive(model, step="decode")
    assert symacct.derive(model, step="prefill").flops.forward


@pytest.mark.slow
def test_doge_is_derived_within_its_keep_window():
    """Doge masks all but its top keys once the keys pass keep_window_size (2,048): another path, which the
    probe's cache (within the window) does not trace. Exact through generation within it; a context past
    it is refused as the other side of the window, as a sliding window's is (it was given, silently, the
    figures of the path within). Its experts scaled the probe's cache 16-fold as an expert width, past the
    window: the model as given (within, its table of 2,048 positions) was refused as "not the model given"."""
    model = _tiny("Doge", vocab_size=96, max_position_embeddings=8192, keep_window_size=2048)
    _exact_through_generation(model, 2, 5, 3)
    decode = symacct.derive(model, step="decode")
    decode.at(B=1, C=2047)
    with pytest.raises(symacct.SymacctError, match="keep_window_size = 2048"):
        decode.at(B=1, C=2048)


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_a_model_that_keeps_no_cache_is_refused_its_serving_steps(step):
    """OpenAI GPT takes the cache keyword and ignores it: it keeps no KV cache, so a real generation runs the
    whole sequence again for each token. Its decode step was derived as one token after C cached positions,
    holding the cache the probe gave it (a peak B * C * 2 * L * D * 4 bytes too high; FLOPs that ignore C),
    and its prefill as filling a cache it leaves empty. Both are refused, naming the step's cost instead."""
    transformers = pytest.importorskip("transformers")
    model = transformers.OpenAIGPTLMHeadModel(
        transformers.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64)
    ).eval()
    with pytest.raises(symacct.SymacctError, match="neither filled nor extended the KV cache") as e:
        symacct.derive(model, step=step)
    assert "step='forward'" in e.value.hint


@pytest.mark.slow  # derivations at a table and a window of their own: in CI's slow pass (the default run's 20 minutes)
def test_a_table_shorter_than_the_window_is_refused_naming_the_window():
    """A Kolibri whose position table (64) ends within its sliding window (513): its own sizes never pass the
    window, the probe's do, and the two traces take two paths (its ops differ there). derive said "the model
    rebuilt from its config is not the model given" (a setting lost); it names the window and the table
    now. With a table longer than the window it derives (past the window)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Kolibri1ForCausalLM"):
        pytest.skip("this transformers has no Kolibri")
    small = dict(vocab_size=96, head_dim=8, sliding_window=513)
    with pytest.raises(symacct.SymacctError, match="within its sliding_window = 513") as e:
        symacct.derive(_tiny("Kolibri1", max_position_embeddings=64, **small))
    assert "its position table: 64 positions" in str(e.value) and "sliding_window = None" in e.value.hint
    acct = symacct.derive(_tiny("Kolibri1", max_position_embeddings=1024, **small))
    assert any(c.path and c.lhs == 514 and str(c.rhs) == "S" for c in acct.constraints)  # 514 <= S


def test_serve_bounds_the_longest_context_by_the_window_derived():
    """A Mistral derived within its window of 1,024 positions: the longest context that fits in memory is
    searched only where the derivation holds (C + 1 <= 1023: at 1,024 positions transformers builds the
    window's mask), and a note says the derivation bounds it. The search used to step past the window and
    raise from inside serve()."""
    from symacct.time.serving import serve

    prefill, decode = _hf("mistral")[1:]
    s = serve(prefill, decode, hardware="H100-SXM", context=512)
    assert s.max_context == 1023
    assert any("the derivation bounds it" in n and "sliding_window" in n for n in s.notes)


def test_serve_searches_beyond_a_window_from_its_far_side():
    """A Mistral derived beyond its window of 4 positions (C + 1 >= 5, S >= 5): the longest context and the
    longest prompt are searched where the derivation holds, from the window's far side. The search started
    at one cached position, which the derivation does not cover, and serve said "not even one cached position
    fits" on an H100."""
    transformers = pytest.importorskip("transformers")
    from symacct.time.serving import serve

    cfg = transformers.MistralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, sliding_window=4,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(cfg)
    prefill, decode = symacct.derive(model, step="prefill"), symacct.derive(model, step="decode")
    with pytest.raises(symacct.SymacctError):
        decode.values_at(B=1, C=1)  # the near side of the window: not derived
    s = serve(prefill, decode, hardware="H100-SXM", context=32)
    assert (s.max_context, s.max_prompt) == (64, 64)
    assert not any("not even" in n for n in s.notes), s.notes


def test_serve_names_what_bounds_the_longest_context():
    """The reference GPT-2 reads its positions from a table of S_max rows: the table bounds the context. A
    transformers Llama has no table (its rotary angles come from the positions), so its max_position_embeddings
    bounds the context only as the length it was made for; the note used to call it a position table."""
    from symacct.time.serving import serve

    prefill, decode = _hf("llama")[1:]
    s = serve(prefill, decode, hardware="H100-SXM", context=32)
    assert s.max_context == 64
    assert any(n.startswith("context: max_position_embeddings (S_max = 64) bounds it") for n in s.notes), s.notes
    prefill, decode = _derived(GPT2Config, (), "prefill"), _derived(GPT2Config, (), "decode")
    s = serve(prefill, decode, hardware="H100-SXM", context=4)
    assert "context: the position table bounds it (S_max = 8), not the memory" in s.notes


@pytest.mark.slow  # Gemma 4's derivations and a generation: in CI's slow pass (the default run's 20 minutes)
def test_gemma4_caches_each_layers_own_head_width_and_shares_across_layers():
    """Gemma 4's full-attention layers have a head width of their own (16 here, 8 in the sliding layers), and
    its last layers read the cache of earlier ones (``num_kv_shared_layers``: transformers gives them a cache
    layer that holds nothing). The decode probe read the global head width, which Gemma 4's config refuses
    to give (refused, "could not build the inputs"); it now fills each layer with its own widths and skips
    the shared ones. A prompt, then tokens one at a time: FLOPs, peak and the cache's bytes are exact."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma4TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, global_head_dim=16, vocab_size=64, max_position_embeddings=64, sliding_window=4,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, num_kv_shared_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    _exact_through_generation(transformers.Gemma4ForCausalLM(cfg), 2, 5, 3)


def test_a_bert_decoder_prefills_one_sequence_and_one_position_exactly():
    """A BERT decoder's prefill keeps one position for its LM head, (B, 1, D): a tensor contiguous at B = 1 or
    S = 1 only, where the head's Linear runs ``addmm`` instead of ``mm`` and ``add``, the same FLOPs. The check at
    a size of 1 compared those ops by name and refused B = 1 (and, with the trace at S = 1, S = 1): a single
    prompt, the commonest prefill. It compares them by the FLOPs PyTorch counts now: each size exact."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
        max_position_embeddings=64, is_decoder=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(config).eval()
    prefill = symacct.derive(model, step="prefill")
    assert not prefill.constraints or not any(c.path for c in prefill.constraints)
    for B, S in ((1, 3), (2, 1), (1, 1)):
        cache = transformers.DynamicCache(config=model.config)
        at = prefill.at(B=B, S=S)
        got = _generation_call(model, cache, torch.randint(3, 64, (B, S)))
        assert got == (at.flops.forward, at.memory.peak, at.memory.kv_cache)


class StaticCacheLM(torch.nn.Module):
    """A decoder whose KV cache is allocated ahead for every position (``StaticCache``'s way): each layer's keys
    and values are (B, H, S_max, D/H) buffers the step is given and writes in place at ``pos``."""

    def __init__(self, V: int, D: int, H: int, L: int, S_max: int) -> None:
        super().__init__()
        self.heads, self.positions = H, S_max
        self.emb, self.pos = torch.nn.Embedding(V, D), torch.nn.Embedding(S_max, D)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(D, 3 * D) for _ in range(L))
        self.out = torch.nn.Linear(D, V, bias=False)

    def forward(self, idx: torch.Tensor, cache: list, pos: int) -> torch.Tensor:
        B, S = idx.shape
        h = self.emb(idx) + self.pos(torch.arange(pos, pos + S))  # (B, S, D)
        for qkv, (kc, vc) in zip(self.qkv, cache):
            q, k, v = qkv(h).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # each (B, H, S, D/H)
            kc[:, :, pos : pos + S], vc[:, :, pos : pos + S] = k, v
            y = torch.nn.functional.scaled_dot_product_attention(q, kc[:, :, : pos + S], vc[:, :, : pos + S])
            h = h + y.transpose(1, 2).reshape(B, S, -1)
        return self.out(h[:, -1])  # (B, V)

    def buffers_ahead(self, B: int) -> list:
        D = self.emb.embedding_dim
        shape = (B, self.heads, self.positions, D // self.heads)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.qkv]


def test_a_cache_allocated_ahead_is_counted_a_layer_each():
    """The cache the step is given, written in place, was counted as the probe's four layers' buffers: 32 * B *
    D * S_max bytes at every L (twice a real two-layer model's). Each buffer is now counted as the one block
    that uses it: 8 * B * D * L * S_max, in the step's inputs too; the FLOPs and the peak were right, and stay
    so."""
    dims = {"V": 16, "D": 16, "H": 2, "L": 2, "S_max": 24}
    acct = symacct.derive(
        lambda V, D, H, L, S_max: StaticCacheLM(V, D, H, L, S_max),
        dims=dims,
        inputs=lambda m, B, S, C: {"idx": torch.randint(0, 16, (B, 1)), "cache": m.buffers_ahead(B), "pos": C},
        step="decode",
    )
    B, D, L, S_max = sym("B"), sym("D"), sym("L"), sym("S_max")
    assert sympy.expand(acct.memory.kv_cache - 8 * B * D * L * S_max) == 0
    assert sympy.expand(acct.memory.inputs - 8 * B * D * L * S_max - 8 * B) == 0  # and the token ids
    for batch, C, depth in [(2, 5, 2), (3, 11, 3)]:
        torch.manual_seed(0)
        model = StaticCacheLM(**{**dims, "L": depth}).eval()
        kv = model.buffers_ahead(batch)
        at = acct.at(B=batch, C=C, L=depth)
        tracker = StorageTracker([*model.parameters(), *(t for pair in kv for t in pair)])
        with torch.no_grad(), tracker, FlopCounterMode(display=False) as fc, CpuFlashCounter() as flash:
            model(torch.randint(0, 16, (batch, 1)), kv, C)
        assert (at.flops.forward, at.memory.peak) == (fc.get_total_flops() + flash.total, tracker.peak)
        assert at.memory.kv_cache == _cache_bytes(kv)
