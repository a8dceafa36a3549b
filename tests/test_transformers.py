"""Hugging Face transformers models, derived with ``symacct.derive(model)`` and nothing else, are exact.

Each family is built from a hypothesis-drawn small config, in eager and SDPA
attention; ``derive(model, optimizer="adamw")`` is then compared, at two
(B, S) each, with a real CPU step of the same model with the default task
step (``symacct.models.hf.task``):

- FLOPs: FlopCounterMode, plus the CPU flash-attention kernel (which it counts
  as 0) by flop_counter's own SDPA formulas (``measure.CpuFlashCounter``) and a
  mixture of experts' grouped matmuls (also 0 there) group by group from their
  real offsets (``measure.GroupedMmCounter``);
  the kernel's recomputed scores (one of its five backward products) are
  ``flops.recompute``;
- saved bytes: saved_tensors_hooks, the loss included;
- parameters: the model's own count;
- B >= 2 where bytes are compared, as in the other exactness tests: at B = 1 an
  ``expand`` of the position ids to (B, S) is a view instead of a copy;
- peak: exact against symacct's storage tracker, and (one config) against
  PyTorch's own MemTracker, with the output and the loss held through the
  optimizer step as derive assumes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch
from cli_run import cli
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct import SymacctError
from symacct.measure.run import CpuFlashCounter, measure_memory, measure_step
from symacct.models.hf import task
from symacct.symbols import sym

transformers = pytest.importorskip("transformers")  # in the test extra; the skip shows when it is missing
T = transformers

EXAMPLES = min(settings.default.max_examples, 1)  # a derive is seconds: 1 drawn config per family and attention in CI


@st.composite
def decoder_sizes(draw: st.DrawFn, gqa: bool = True) -> dict[str, int]:
    """Sizes of a small decoder: H = H_kv * rep, a head width that is a multiple of 8, 1-3 layers."""
    hkv = draw(st.integers(1, 3))
    rep = draw(st.integers(1, 3)) if gqa else 1
    dh = 8 * draw(st.integers(1, 3))  # 8..24: even rotary halves, and GPT-NeoX's quarter rotary width
    H = hkv * rep
    return {
        "H": H,
        "H_kv": hkv if gqa else H,
        "D": H * dh,
        "L": draw(st.integers(1, 3)),
        "V": draw(st.integers(16, 80)),
        "F": draw(st.integers(4, 48)),
        "S_max": draw(st.integers(16, 40)),
        "E": draw(st.integers(2, 6)),  # experts of a mixture (the other families ignore E and k)
        "k": draw(st.integers(1, 2)),
    }


def gpt2(s: dict[str, int], attn: str) -> Any:
    c = T.GPT2Config(
        n_embd=s["D"],
        n_layer=s["L"],
        n_head=s["H"],
        vocab_size=s["V"],
        n_positions=s["S_max"],
        n_inner=s["F"],
        attn_implementation=attn,
    )
    return T.GPT2LMHeadModel(c)


def _llama_like(
    config_cls: type, model_cls: type, kv: bool = True, moe: bool = False, **extra: Any
) -> Callable[[dict[str, int], str], Any]:
    """A builder from the drawn sizes, with transformers' common field names (grouped heads when ``kv``; E
    experts, k a token when ``moe``, whose grouped-matmul CPU kernel wants 16-byte rows: F a multiple of 4)."""

    def build(s: dict[str, int], attn: str) -> Any:
        heads = {"num_key_value_heads": s["H_kv"]} if kv else {}
        experts = {"num_local_experts": s["E"], "num_experts_per_tok": s["k"]} if moe else {}
        c = config_cls(
            hidden_size=s["D"],
            intermediate_size=4 * max(1, s["F"] // 4) if moe else s["F"],
            num_hidden_layers=s["L"],
            num_attention_heads=s["H"],
            vocab_size=s["V"],
            max_position_embeddings=s["S_max"],
            attn_implementation=attn,
            **heads,
            **experts,
            **extra,
        )
        return model_cls(c)

    return build


neox = _llama_like(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, kv=False)
bert = _llama_like(T.BertConfig, T.BertForMaskedLM, kv=False)


FAMILIES: dict[str, tuple[Callable[[dict[str, int], str], Any], bool]] = {
    "gpt2": (gpt2, False),
    "llama": (_llama_like(T.LlamaConfig, T.LlamaForCausalLM), True),
    "mistral": (_llama_like(T.MistralConfig, T.MistralForCausalLM, sliding_window=None), True),
    "mistral-sliding-window": (_llama_like(T.MistralConfig, T.MistralForCausalLM, sliding_window=4), True),
    "qwen2": (_llama_like(T.Qwen2Config, T.Qwen2ForCausalLM), True),
    "phi3": (_llama_like(T.Phi3Config, T.Phi3ForCausalLM, pad_token_id=0), True),
    "gpt-neox": (neox, False),
    "bert": (bert, False),
    "mixtral": (_llama_like(T.MixtralConfig, T.MixtralForCausalLM, moe=True), True),
}


def check_exact(model: Any, acct: Any, points: list[tuple[int, ...]], checkpointing: bool = False) -> None:
    """derive's figures against a real step of ``model`` at each (B, S) or (B, S, S_dec) (see the module doc)."""
    step = task(model)
    for B, S, *dec in points:
        more = {"S_dec": dec[0]} if dec else {}
        at = acct.at(B=B, S=S, **more)
        torch.manual_seed(0)
        args = step.inputs(model, B, S, **more)
        counted = measure_step(model, args, loss=step.loss)
        model.zero_grad(set_to_none=True)
        uncounted = counted.flash_forward + counted.flash_backward + counted.grouped_forward + counted.grouped_backward
        assert at.flops.hardware == counted.flops_total + uncounted
        assert at.flops.forward == counted.flops_forward + counted.flash_forward + counted.grouped_forward
        assert at.flops.backward + at.flops.recompute == (
            counted.flops_backward + counted.flash_backward + counted.grouped_backward
        )
        if not checkpointing:  # the kernel's recomputed scores only: 1 of its 5 equal backward products
            assert 5 * at.flops.recompute == counted.flash_backward
        assert at.memory.activations == counted.saved_bytes
        assert at.params == sum(p.numel() for p in model.parameters())
        real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), loss=step.loss)
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)
        model.zero_grad(set_to_none=True)


# transformers' default attention (sdpa) for every family in the default run but two Llama-like ones (Qwen2,
# Phi-3: Llama's and Mistral's stay); eager for three (the rest in CI's slow pass: the default run's 20 minutes)
EAGER_BY_DEFAULT = ("gpt2", "llama", "mistral-sliding-window")
SDPA_SLOW = (("sdpa", "qwen2"), ("sdpa", "phi3"))
FAMILY_CASES = [
    pytest.param(
        f,
        attn,
        marks=[pytest.mark.slow] if (attn == "eager" and f not in EAGER_BY_DEFAULT) or (attn, f) in SDPA_SLOW else [],
    )
    for f in sorted(FAMILIES)
    for attn in ("eager", "sdpa")
]


@pytest.mark.parametrize(("family", "attn"), FAMILY_CASES, ids=[f"{p.values[0]}-{p.values[1]}" for p in FAMILY_CASES])
def test_a_transformers_model_is_exact_from_derive_alone(family: str, attn: str) -> None:
    build, gqa = FAMILIES[family]

    @settings(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.generate])  # no shrinking: a derive is seconds
    @given(
        sizes=decoder_sizes(gqa=gqa), batch=st.integers(2, 3), seqs=st.tuples(st.integers(5, 9), st.integers(10, 15))
    )
    def run(sizes: dict[str, int], batch: int, seqs: tuple[int, int]) -> None:
        torch.manual_seed(0)
        model = build(sizes, attn)
        acct = symacct.derive(model, optimizer="adamw")
        check_exact(model, acct, [(batch, seqs[0]), (batch + 1, seqs[1])])

    run()


def test_memtracker_agrees_on_the_peak() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = FAMILIES["llama"][0]({"H": 4, "H_kv": 2, "D": 64, "L": 2, "V": 100, "F": 96, "S_max": 64}, "sdpa")
    acct = symacct.derive(model, optimizer="adamw")
    step = task(model)
    B, S = 2, 24
    args = step.inputs(model, B, S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(model, opt, args["input_ids"], args["labels"])  # the inputs count, as in derive
    with tracker:
        out = model(**args)  # held through the step by the caller, as derive assumes
        loss = step.loss(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del out, loss
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert acct.at(B=B, S=S).memory.peak == peak  # the issue asks for 1%; on CPU it is exact


@pytest.mark.parametrize("reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradient_checkpointing_is_carried_over_and_exact(reentrant: bool) -> None:
    """transformers' default (non-reentrant) and ``use_reentrant=True``, whose nested backward's ops were
    counted outside the layers and refused as "not the model given" (tests/test_loops.py)."""
    model = FAMILIES["llama"][0]({"H": 4, "H_kv": 2, "D": 32, "L": 2, "V": 50, "F": 40, "S_max": 32}, "sdpa")
    plain = symacct.derive(model).at(B=2, S=9)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    acct = symacct.derive(model, optimizer="adamw")
    check_exact(model, acct, [(2, 9), (3, 13)], checkpointing=True)
    assert acct.at(B=2, S=9).memory.activations < plain.memory.activations
    assert acct.at(B=2, S=9).flops.recompute > plain.flops.recompute


def test_a_model_built_on_the_meta_device_from_config() -> None:
    config = T.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
    )  # fmt: skip
    with torch.device("meta"):
        meta = T.AutoModelForCausalLM.from_config(config)
    acct = symacct.derive(meta, optimizer="adamw")
    torch.manual_seed(0)
    real = T.AutoModelForCausalLM.from_config(config)
    check_exact(real, acct, [(2, 11)])


def test_a_config_that_refuses_another_layer_count_keeps_its_own() -> None:
    """GPT-Neo's config rebuilds its per-layer attention kinds (global, local) from ``attention_types`` and
    refuses any other ``num_layers``: the layer count is not found, and probing it as a size of its own fails
    to build. derive keeps it at the model's value (a note says why), exact, where it used to stop with an
    internal error raised while it keyed its memo."""
    config = T.GPTNeoConfig(
        hidden_size=32, num_layers=2, num_heads=4, vocab_size=64, max_position_embeddings=32, window_size=4,
        attention_types=[[["global", "local"], 1]], intermediate_size=48, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.GPTNeoForCausalLM(config)
    acct = symacct.derive(model, optimizer="adamw")
    assert "num_layers kept at 2" in acct.notes and "L" not in acct.symbols
    check_exact(model, acct, [(2, 7), (3, 11)])  # S beyond the local window (4) too


def test_a_model_that_differs_from_its_rebuild_is_refused() -> None:
    """One layer's attention switched to eager after construction: type(model)(config) would build SDPA in
    every layer. The rebuilt model is not the user's, and derive says so instead of deriving it."""
    model = FAMILIES["llama"][0]({"H": 4, "H_kv": 2, "D": 32, "L": 2, "V": 50, "F": 40, "S_max": 32}, "sdpa")
    eager = copy.deepcopy(model.config)
    eager._attn_implementation = "eager"
    model.model.layers[1].self_attn.config = eager
    with pytest.raises(SymacctError, match="not the model given") as e:
        symacct.derive(model)
    assert "model.layers.1.self_attn" in str(e.value)


def test_a_module_swapped_after_construction_is_refused() -> None:
    model = FAMILIES["qwen2"][0]({"H": 2, "H_kv": 1, "D": 16, "L": 2, "V": 30, "F": 20, "S_max": 32}, "eager")
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(SymacctError, match="gelu.*model.layers.0.mlp.act_fn"):
        symacct.derive(model)


@pytest.mark.slow  # a mixture's derivations: in CI's slow pass (the default run's 20 minutes)
def test_a_top_k_raised_after_construction_is_refused() -> None:
    """Each token sent to 3 experts where the config sends it to 2: the same ops on the same parameters,
    with longer grouped matmuls. Derived as the config's model, the FLOPs were silently the top-2 figure
    (short of the real step's); now refused, naming the grouped matmul whose shapes differ."""
    sizes = {"H": 2, "H_kv": 2, "D": 16, "L": 1, "V": 30, "F": 20, "S_max": 32, "E": 4, "k": 2}
    model = FAMILIES["mixtral"][0](sizes, "eager")
    derived = symacct.derive(model).at(B=2, S=8).flops.hardware
    for m in model.modules():
        if hasattr(m, "top_k"):
            m.top_k = 3
    step = task(model)
    counted = measure_step(model, step.inputs(model, 2, 8), loss=step.loss)
    assert counted.flops_total + counted.grouped_forward + counted.grouped_backward > derived
    with pytest.raises(SymacctError, match=r"aten\._grouped_mm\.default returns .* in the given model and .* in the "
                       r"rebuilt one"):  # fmt: skip
        symacct.derive(model)


def test_forward_step_takes_no_labels() -> None:
    model = FAMILIES["gpt2"][0]({"H": 2, "H_kv": 2, "D": 16, "L": 2, "V": 30, "F": 20, "S_max": 32}, "eager")
    acct = symacct.derive(model, step="forward")
    step = task(model)
    args = {k: v for k, v in step.inputs(model, 2, 7).items() if k != "labels"}
    real = measure_memory(model, args, step="forward")
    at = acct.at(B=2, S=7)
    assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)
    assert "labels" not in str(acct.notes) or "causal LM" in str(acct.notes)


def test_the_notes_name_the_task_and_the_head_width() -> None:
    model = FAMILIES["llama"][0]({"H": 4, "H_kv": 2, "D": 32, "L": 2, "V": 50, "F": 40, "S_max": 32}, "sdpa")
    acct = symacct.derive(model)
    notes = " ".join(acct.notes)
    assert "causal LM step" in notes and "head_dim = 8 is the model width over the heads" in notes


def test_sliding_window_figures_hold_on_their_side_only() -> None:
    """Within the window the eager step calls SDPA with is_causal; from the window's length on a window mask
    is built (at exactly 4,096 positions too: ``kv_length >= sliding_window``; the real step's extra bytes there
    are measured in test_serving's window test): the figures are derived on the probe's side and refused on
    the other, not extrapolated."""
    sizes = {"H": 4, "H_kv": 2, "D": 32, "L": 1, "V": 50, "F": 40, "S_max": 9000}
    wide = _llama_like(T.MistralConfig, T.MistralForCausalLM, sliding_window=4096)(sizes, "sdpa")
    acct = symacct.derive(wide)
    acct.at(B=2, S=4095)
    with pytest.raises(SymacctError, match="S <= 4095"):
        acct.at(B=2, S=4096)
    narrow = _llama_like(T.MistralConfig, T.MistralForCausalLM, sliding_window=4)({**sizes, "S_max": 32}, "sdpa")
    acct = symacct.derive(narrow, optimizer="adamw")
    with pytest.raises(SymacctError, match="5 <= S"):
        acct.at(B=2, S=4)
    check_exact(narrow, acct, [(2, 5), (2, 12)])


TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def _cli(*args: str) -> tuple[int, str, str]:
    """The command line in this process (``cli_run``; test_readme runs the installed command itself)."""
    done = cli(*args)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
def test_cli_derives_and_verifies_a_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    rc, out, err = _cli("derive", str(tmp_path / "config.json"), "--batch", "2", "--seq", "16", "--json")
    assert rc == 0, err
    report = json.loads(out)
    real = T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(**TINY))
    params = next(r["value"] for r in report["formulas"] if r["name"] == "params")
    assert params == sum(p.numel() for p in real.parameters())  # the tied embedding once
    fields = {s["symbol"]: s["field"] for s in report["symbols"]}
    assert (
        fields["D"] == "hidden_size" and fields["H_kv"] == "num_key_value_heads" and fields["L"] == "num_hidden_layers"
    )
    rc, out, err = _cli("verify", str(tmp_path), "--batch", "2", "--seq", "16", "--steps", "2")  # a folder
    assert rc == 0, out + err
    assert "MISMATCH" not in out and "CPU flash-attention FLOPs" in out
    for cmd in (
        ["fit", str(tmp_path / "config.json"), "--hardware", "H100-SXM", "--seq", "64", "--solve", "batch"],
        ["estimate", str(tmp_path / "config.json"), "--tokens", "1e9", "--hardware", "A100", "--gpus", "8"],
        ["sheet", str(tmp_path / "config.json"), "--batch", "2", "--seq", "16", "--format", "md"],
    ):
        rc, out, err = _cli(*cmd)
        assert rc == 0 and out.strip(), err


def test_cli_config_json_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    rc, _, err = _cli("derive", str(tmp_path / "config.json"), "--config", "num_hidden_layers=2.5")
    assert rc == 2 and "is an integer" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    rc, _, err = _cli("derive", str(tmp_path / "bad.json"))
    assert rc == 2 and "no model_type" in err
    (tmp_path / "odd.json").write_text(json.dumps({**TINY, "model_type": "no-such-model"}))
    rc, _, err = _cli("derive", str(tmp_path / "odd.json"))
    assert rc == 2 and "no-such-model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("attn", [pytest.param("eager", marks=pytest.mark.slow), "sdpa"])  # eager: slow pass
def test_vit_image_classification_is_exact(attn: str) -> None:
    """pixel_values (B, C, image_size, image_size): the patches are (image_size/patch_size)**2 plus the class
    token, a shifted size read as such; S reaches no tensor."""

    @settings(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.generate])
    @given(
        heads=st.integers(1, 3),
        dh=st.integers(2, 6),
        layers=st.integers(1, 2),
        patch=st.integers(2, 5),
        per_side=st.integers(2, 4),
        channels=st.integers(1, 3),
        batch=st.integers(2, 3),
    )
    def run(heads: int, dh: int, layers: int, patch: int, per_side: int, channels: int, batch: int) -> None:
        torch.manual_seed(0)
        config = T.ViTConfig(
            hidden_size=heads * dh,
            intermediate_size=3 * heads * dh,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            image_size=patch * per_side,
            patch_size=patch,
            num_channels=channels,
            num_labels=3,
            attn_implementation=attn,
        )
        model = T.ViTForImageClassification(config)
        acct = symacct.derive(model, optimizer="adamw")
        assert "S" not in acct.free_symbols()
        check_exact(model, acct, [(batch, 1), (batch + 1, 1)])

    run()


@pytest.mark.slow
def test_bart_decoder_takes_the_eager_mask_path() -> None:
    """BART's decoder makes its padding mask with torch.ones and asks transformers whether it holds padding
    before choosing SDPA's is_causal over a (B, 1, S_dec, S_dec) mask. An eager run finds none and builds no
    mask; on fake tensors transformers cannot read the values and builds (and saves) one, which used to add
    8*B*S_dec**2 bytes of saved activations that no real step holds. The values are known from how the mask
    was made (symacct.trace.known), so the trace asks as an eager run does: exact against the real step."""
    torch.manual_seed(0)
    config = T.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    model = T.BartForConditionalGeneration(config)
    acct = symacct.derive(model, optimizer="adamw")
    S_dec = sym("S_dec")
    assert sympy.degree(sympy.expand(acct.memory.activations), S_dec) == 1  # no (S_dec, S_dec) mask saved
    check_exact(model, acct, [(2, 7, 5), (3, 11, 6)])


def _bart(heads: int, ffn: int) -> Any:
    torch.manual_seed(0)
    return T.BartForConditionalGeneration(
        T.BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=heads,
            decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, vocab_size=64,
            max_position_embeddings=32,
        )
    )  # fmt: skip


def test_bart_heads_and_ffn_widths_are_symbols_and_hold_at_other_sizes() -> None:
    """BART's encoder_/decoder_attention_heads and encoder_/decoder_ffn_dim had no letter: kept at their values,
    so the sheet had no H and no F (and the heads, probed as sizes of their own, stopped the step at the first
    probe). They read as H and F now, one symbol each where encoder and decoder agree. The formulas, derived
    at 4 heads and width 48, against a real step of a model built at 2 heads and width 40."""
    acct = symacct.derive(_bart(4, 48))
    assert acct.fields["H"] == "encoder_attention_heads" and acct.fields["F"] == "encoder_ffn_dim"
    assert any("decoder_attention_heads = 4, encoder_attention_heads = 4 read as one size, H" in n for n in acct.notes)
    other = _bart(2, 40)
    args = task(other).inputs(other, 2, 7, S_dec=5)
    counted = measure_step(other, args, loss=task(other).loss)
    at = acct.at(B=2, S=7, S_dec=5, H=2, F=40)
    uncounted = counted.flash_forward + counted.flash_backward
    assert at.flops.hardware == counted.flops_total + uncounted
    assert at.memory.activations == counted.saved_bytes
    assert at.params == sum(p.numel() for p in other.parameters())


def test_a_sequence_to_sequence_forward_step_feeds_the_labels_as_decoder_inputs() -> None:
    """step='forward' of an encoder-decoder runs the task's inputs without labels: the labels' tensor goes in
    as decoder_input_ids (the decoder still runs S_dec positions) and no loss is computed. The notes say so
    (they named labels and output.loss, which the step does not use); exact against a real forward with
    those inputs, where one with labels would hold the loss and the shifted labels too."""
    torch.manual_seed(0)
    config = T.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    model = T.BartForConditionalGeneration(config)
    acct = symacct.derive(model, step="forward")
    assert any("without the labels (given as decoder_input_ids" in n for n in acct.notes)
    for B, S, S_dec in [(2, 7, 5), (3, 11, 6)]:
        args = task(model).inputs(model, B, S, S_dec=S_dec)
        args["decoder_input_ids"] = args.pop("labels")
        real = measure_memory(model, args, step="forward")
        at = acct.at(B=B, S=S, S_dec=S_dec)
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)


def test_albert_shares_its_layers_and_is_exact() -> None:
    """ALBERT runs one shared layer group num_hidden_layers times, and inner_group_num counts the layers of a
    group: no list of L blocks. derive keeps the layer count at the model's value (a note says so) and stays
    exact; it used to probe the group counts as sizes (hundreds of nested groups: minutes and gigabytes)."""
    torch.manual_seed(0)
    config = T.AlbertConfig(
        hidden_size=32, embedding_size=16, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    model = T.AlbertForMaskedLM(config)
    acct = symacct.derive(model, optimizer="adamw")
    assert any(n.startswith("the ops change with L but no nn.ModuleList") for n in acct.notes)
    check_exact(model, acct, [(2, 7), (3, 11)])


@pytest.mark.slow  # sequence-to-sequence is exact in the default run by BART: in CI's slow pass (20 minutes)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_t5_sequence_to_sequence_is_exact(attn: str) -> None:
    """An encoder-decoder (two stacks side by side, kept at their depths) with the decoder's length S_dec a
    size of its own (at() uses S when it is not given); d_kv follows D/H; relative position buckets are a size
    of their own; the forward step runs the decoder on S_dec positions too."""
    torch.manual_seed(0)
    config = T.T5Config(
        d_model=32, d_ff=48, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=50,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    model = T.T5ForConditionalGeneration(config)
    acct = symacct.derive(model, optimizer="adamw")
    notes = " ".join(acct.notes)
    assert "sequence-to-sequence step" in notes and "num_decoder_layers, num_layers each count the blocks" in notes
    assert {"D", "H", "F", "V", "S_dec"} <= set(acct.free_symbols())
    assert acct.at(B=2, S=5).flops.total == acct.at(B=2, S=5, S_dec=5).flops.total
    check_exact(model, acct, [(2, 5, 11), (3, 9, 4), (2, 7)])
    forward = symacct.derive(model, step="forward")
    args = task(model).inputs(model, 2, 6, S_dec=3)
    args["decoder_input_ids"] = args.pop("labels")
    real = measure_memory(model, args, step="forward")
    at = forward.at(B=2, S=6, S_dec=3)
    assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)


@pytest.mark.slow
def test_a_deep_model_is_checked_on_four_blocks_and_its_structure() -> None:
    """Six layers built alike: the user's model is traced on blocks 0, 1, 2 and 5 (the middle ones compared by
    structure) and derived exactly; a module swapped in a middle block is seen by structure, the whole model is
    traced, and the difference refused."""
    sizes = {"H": 4, "H_kv": 2, "D": 32, "L": 6, "V": 50, "F": 40, "S_max": 32}
    model = FAMILIES["llama"][0](sizes, "sdpa")
    acct = symacct.derive(model, optimizer="adamw")
    check_exact(model, acct, [(2, 7)])
    assert len(model.model.layers) == 6  # restored after the check
    model.model.layers[3].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(SymacctError, match="gelu.*model.layers.3.mlp.act_fn"):
        symacct.derive(model)


def test_a_sequence_to_sequence_model_that_fails_at_its_own_sizes_is_told_so() -> None:
    """T5 without ``decoder_start_token_id`` cannot shift its labels right at any size. The refusal blamed the
    probe's sizes ("the model's forward failed at probe sizes ... a size relation the model needs"): the check at
    the model's own sizes skipped a step with a decoder length of its own (S_dec)."""
    from symacct.pipeline import OWN_SIZES_FAIL

    config = T.T5Config(d_model=32, d_ff=48, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=50,
                        decoder_start_token_id=None, pad_token_id=0)  # fmt: skip
    model = T.T5ForConditionalGeneration(config)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(SymacctError, match=f"{OWN_SIZES_FAIL}.*decoder_start_token_id") as e:
        symacct.derive(model)
    assert "probe sizes" not in e.value.what


@pytest.mark.slow  # a derivation more of a path the default run also covers: in CI's slow pass (20 minutes)
def test_cli_sheet_of_a_sequence_to_sequence_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A T5 config.json: S_dec is in the notation (set by --seq on the command line), and a model with no
    position table plots from a short --seq."""
    config = T.T5Config(
        d_model=32, d_ff=48, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=50,
        decoder_start_token_id=0, pad_token_id=0, architectures=["T5ForConditionalGeneration"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    rc, out, err = _cli("sheet", str(tmp_path), "--batch", "2", "--seq", "16", "--out", str(tmp_path / "s"))
    assert rc == 0, err
    written = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert sum(n.endswith("-memory-seq.png") for n in written) == 1 and sum(n.endswith(".md") for n in written) == 1
    md = next((tmp_path / "s").glob("*.md")).read_text()
    assert "| $S_{dec}$ | decoder sequence length (sequence-to-sequence) | `--seq` | 16 |" in md


@pytest.mark.slow  # a derivation more of a path the default run also covers: in CI's slow pass (20 minutes)
def test_fields_of_a_models_own_follow_an_equal_width_or_keep_their_values() -> None:
    """Sizes with no known name get symbols of their own; where the step cannot run with them at probe sizes,
    derive tries again with each following the known width it equals (OPT builds ``project_in`` only when
    ``word_embed_proj_dim`` differs from ``hidden_size``) or kept at its value (GPT-J's ``rotary_dim``, which
    must stay within a head; Falcon's count of layer norms). Falcon's ``num_kv_heads`` and ``ffn_hidden_size``
    are H_kv and F. Each exact against a real step."""
    opt = T.OPTForCausalLM(
        T.OPTConfig(hidden_size=24, word_embed_proj_dim=24, ffn_dim=40, num_hidden_layers=2, num_attention_heads=3,
                    vocab_size=50, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    gptj = T.GPTJForCausalLM(
        T.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=64, n_positions=32,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    falcon = T.FalconForCausalLM(
        T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                       new_decoder_architecture=True, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    for model, note in [
        (opt, "word_embed_proj_dim = hidden_size (24): it follows D"),
        (gptj, "rotary_dim kept at 4"),
        (falcon, "num_ln_in_parallel_attn kept at 2"),  # a count of layer norms: a switch, not a size
    ]:
        torch.manual_seed(0)
        acct = symacct.derive(model, optimizer="adamw")
        assert note in acct.notes and "did not let the step run at probe sizes" in acct.notes[0]
        check_exact(model, acct, [(2, 7), (3, 11)])
    assert {"H_kv", "F"} <= set(acct.symbols)  # Falcon's num_kv_heads and ffn_hidden_size


def test_gptj_at_its_real_proportions_reads_the_head_less_its_rotary_part() -> None:
    """GPT-J 6B's heads are 256 wide, 64 of them rotary (``rotary_dim``, kept at its value by derive's retry):
    the pass-through part, ``x[..., 64:]``, is D/H - 64 wide, a width less a kept one (``Probe.cuts``). The
    head prime is chosen so that the first probe's 8 * p - 64 is no plain constant (8 * 29 - 64 = 168 would
    be). Its vocabulary and positions are 64 too, equal to the rotary width by chance: the retry that ties
    rotary_dim to V fails at probe sizes, the one after keeps it. Exact against a real step at two sizes."""
    model = T.GPTJForCausalLM(
        T.GPTJConfig(n_embd=512, n_layer=2, n_head=2, rotary_dim=64, vocab_size=64, n_positions=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    torch.manual_seed(0)
    acct = symacct.derive(model, optimizer="adamw")
    assert "rotary_dim kept at 64" in acct.notes
    check_exact(model, acct, [(2, 7), (3, 11)])


def test_gpt_bigcode_multi_query_width_is_read_in_the_fewest_symbols() -> None:
    """StarCoder's GPT-BigCode fuses Q with one shared key and value head: its projection is D + 2*D/H wide.
    At the first probe that value is also 3*D/(8*H) * (S + V); the reading in fewer symbols, (D/H)*(H + 2),
    is taken (the second trace refused the other). Exact against a real step, and the weight's count."""
    model = T.GPTBigCodeForCausalLM(
        T.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, multi_query=True,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    torch.manual_seed(0)
    acct = symacct.derive(model, optimizer="adamw")
    check_exact(model, acct, [(2, 7), (3, 11)])
    width = model.transformer.h[0].attn.c_attn.weight.shape[0]
    assert width == 32 + 2 * 32 // 4  # D + 2 * D/H: one key and one value head


@pytest.mark.slow  # a mixture exact at two sizes: in CI's slow pass (the default run's 20 minutes)
def test_phimoe_router_with_its_random_draws_is_exact() -> None:
    """Phi-MoE's sparsemixer router draws exponential noise (``exponential_``, a random fill) and scatters its
    top-k weights with ``scatter_add``: both costed; exact against a real step."""
    model = T.PhimoeForCausalLM(
        T.PhimoeConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, num_local_experts=4,
                       num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    torch.manual_seed(0)
    acct = symacct.derive(model, optimizer="adamw")
    assert {"E", "k"} <= set(acct.symbols)
    check_exact(model, acct, [(2, 7), (3, 11)])


@pytest.mark.parametrize("family", ["bloom", pytest.param("mpt", marks=pytest.mark.slow)])  # mpt: slow pass
def test_alibi_heads_split_at_a_power_of_two_are_kept(family: str) -> None:
    """BLOOM and MPT build ALiBi's slopes over the closest power of two to the head count (an arange of that
    length, slices beyond it): no product of symbols at a probe's prime H. derive's last try keeps the head
    count at the model's value, says so in the first note, and is exact against a real step."""
    if family == "bloom":
        model = T.BloomForCausalLM(T.BloomConfig(hidden_size=48, n_head=6, n_layer=2, vocab_size=64))
        heads = "n_head = 6"
    else:
        model = T.MptForCausalLM(
            T.MptConfig(d_model=48, n_layers=2, n_heads=6, vocab_size=64, max_seq_len=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
        )  # fmt: skip
        heads = "n_heads = 6"
    torch.manual_seed(0)
    acct = symacct.derive(model, optimizer="adamw")
    assert "H" not in acct.symbols and f"with {heads} kept at the model's values" in acct.notes[0]
    check_exact(model, acct, [(2, 7), (3, 11)])


@pytest.mark.parametrize(
    ("num_labels", "problem_type"), [(1, None), (1, "regression"), (3, "multi_label_classification")]
)
def test_sequence_classification_takes_the_labels_its_problem_type_reads(num_labels: int, problem_type: Any) -> None:
    """Regression (mean squared error, transformers' reading of one label) and multi-label classification
    (binary cross entropy with logits) had no cost rule for their losses, and a multi-label model got class
    indices where it reads a 0/1 float per class (refused as a failed forward)."""
    config = T.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        problem_type=problem_type,
    )
    torch.manual_seed(0)
    model = T.BertForSequenceClassification(config)
    labels = task(model).inputs(model, 2, 5)["labels"]
    assert labels.is_floating_point()
    assert labels.shape == ((2,) if num_labels == 1 else (2, num_labels))
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 7), (3, 11)])


def test_a_decoder_classifier_trains_without_a_kv_cache_and_is_exact() -> None:
    """Mistral's sequence classifier builds a KV cache when ``use_cache`` is left to its config, and its
    sliding-window cache makes a tensor a layer outside the layer stack: derive refused it as "not the model
    given" (6 ``lift_fresh`` in the given model, 4 in the rebuilt one). The step passes ``use_cache=False``
    where the forward takes it, as the causal LM's does; an encoder's classifier (BERT above) takes none."""
    config = T.MistralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, pad_token_id=0, num_labels=3, sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.MistralForSequenceClassification(config)
    assert task(model).inputs(model, 2, 5)["use_cache"] is False
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 7), (3, 11)])


@pytest.mark.parametrize(
    "head",
    [
        "BertForTokenClassification",
        pytest.param("MistralForQuestionAnswering", marks=pytest.mark.slow),  # the slow pass: 20 minutes
        pytest.param("BartForQuestionAnswering", marks=pytest.mark.slow),
    ],
)
def test_token_classification_and_question_answering_have_a_default_step(head: str) -> None:
    """Two more heads with a default step: a class index a position (``labels`` (B, S)), and an answer's start
    and end positions (B,). Mistral's question-answering head takes no ``use_cache`` but hands its keyword
    arguments to its base model, which builds a sliding-window cache a layer at a time when not told otherwise
    (refused as not the model given): the step passes ``use_cache=False`` through. An encoder-decoder's head
    (BART's) makes its decoder's inputs from ``input_ids`` (S_dec = S): the same step."""
    if head.startswith("Bart"):
        config: Any = T.BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64, max_position_embeddings=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        )  # fmt: skip
    elif head.startswith("Bert"):
        config = T.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, num_labels=5,
        )  # fmt: skip
    else:
        config = T.MistralConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=64, pad_token_id=0, sliding_window=4,
        )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(T, head)(config)
    inputs = task(model).inputs(model, 2, 5)
    if head.startswith("Bert"):
        assert inputs["labels"].shape == (2, 5)
    else:
        assert inputs["start_positions"].shape == (2,) and inputs["use_cache"] is False
        assert bool((inputs["start_positions"] <= inputs["end_positions"]).all())
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 7), (3, 11)])


@pytest.mark.slow  # a vision family, exact at two sizes: in CI's slow pass (the default run's 20 minutes)
def test_swin_pools_a_transposed_sequence_and_is_exact() -> None:
    """Swin's pooler averages the transposed sequence, so the gradient reaches its last layer norm transposed:
    PyTorch's meta kernel returned the input's gradient in those strides, the CPU kernel returns it contiguous,
    and the trace copied it before a reshape the real step views (the peak 1,024 bytes a sample too high)."""
    config = T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=5
    )
    torch.manual_seed(0)
    model = T.SwinForImageClassification(config)
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 7), (3, 11)])


def test_mamba_on_the_cpu_is_refused_as_a_loop_over_the_sequence() -> None:
    """Without the mamba_ssm kernels transformers' Mamba scans the sequence in a Python loop, one position at a
    time: its op count grows with S. It is refused in the first probe trace, as soon as the loop has read every
    position (before ``symacct.trace.loops`` it ran over five minutes on this machine without an answer)."""
    model = T.MambaForCausalLM(T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=8))
    with pytest.raises(SymacctError) as e:
        symacct.derive(model)
    assert "reads a dimension of S index by index" in e.value.what
    assert e.value.module == "backbone.layers.0.mixer" and e.value.sizes == ("S",)


@pytest.mark.slow  # eight unlike layers traced whole, the default run's longest: in CI's slow pass (20 minutes)
def test_gemma4_with_per_layer_head_widths_is_exact() -> None:
    """Gemma 4's config gives its full-attention layers a head width of their own (``global_head_dim``) through
    per-layer overrides, and refuses a read of the global ``head_dim`` (AmbiguousGlobalPerLayerAttributeError).
    derive read every field and failed inside symacct, reported as a defect of symacct. It reads the global
    values now; the layers' own values stay constants of the rebuilt model. With per-layer embeddings, key/value
    sharing across layers and the mixture-of-experts block, exact."""
    config = T.Gemma4TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, global_head_dim=16, vocab_size=64, max_position_embeddings=64, sliding_window=4,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, num_kv_shared_layers=2,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.Gemma4ForCausalLM(config)
    check_exact(model, symacct.derive(model, optimizer="adamw"), [(2, 7), (3, 11)])


@pytest.mark.slow  # a family exact at two sizes: in CI's slow pass (the default run's 20 minutes)
def test_bigbird_masked_lm_with_its_unread_pooler_is_exact() -> None:
    """BigBird's masked LM builds a pooler whose output no loss reads (a saved ``tanh`` output freed when forward
    returns: ``symacct.trace.versions.alias``), and its config has a ``block_size`` (a sparse-attention block)
    beside ``max_position_embeddings``, both S_max by name (``tests/test_shared_letters.py``). Before, the probe
    built a position table of block_size rows and the model was refused as not the one given."""
    config = T.BigBirdConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
        max_position_embeddings=64, block_size=4, attention_type="original_full",
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.BigBirdForMaskedLM(config)
    acct = symacct.derive(model, optimizer="adamw")
    assert any("block_size = 4, max_position_embeddings = 64 read as one size" in n for n in acct.notes)
    check_exact(model, acct, [(2, 7), (3, 11)])


def test_weights_are_not_initialised_in_the_models_derive_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The models derive builds at probe sizes hold fake tensors, whose values nothing reads: transformers'
    weight initialisation is skipped there (Marian's sinusoidal tables took two minutes of a first derive, a
    Python loop over the probe's positions and widths), as transformers skips it on the meta device. Tying runs
    after it and still ties: the parameter count is the tied model's."""
    calls: list[str] = []
    original = T.PreTrainedModel.initialize_weights

    def counted(self: Any) -> None:
        calls.append(type(self).__name__)
        original(self)

    monkeypatch.setattr(T.PreTrainedModel, "initialize_weights", counted)
    config = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    model = T.GPT2LMHeadModel(config)
    built = list(calls)
    assert "GPT2LMHeadModel" in built  # the user's model: initialised
    acct = symacct.derive(model)
    assert calls == built
    assert acct.at(B=2, S=8).params == sum(p.numel() for p in model.parameters())  # lm_head tied to wte
    assert T.PreTrainedModel.initialize_weights is counted


def _whisper(head: str = "ForConditionalGeneration", **sizes: int) -> Any:
    torch.manual_seed(0)
    config = T.WhisperConfig(**{
        "vocab_size": 64, "num_mel_bins": 8, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48,
        "max_source_positions": 32, "max_target_positions": 32, "decoder_start_token_id": 1, "pad_token_id": 0,
        "num_labels": 3, **sizes,
    })  # fmt: skip
    return getattr(T, f"Whisper{head}")(config)


@pytest.mark.slow  # an encoder-decoder of its own, exact at two sizes: in CI's slow pass (the default run's 20 minutes)
def test_whisper_speech_to_text_is_exact() -> None:
    """Whisper's forward takes input_features, not input_ids: it got the text sequence-to-sequence step and
    was refused with a hint about size relations ("'NoneType' object has no attribute 'shape'"). Its step
    is a mel spectrogram of the length its encoder requires (max_source_positions times its convolutions'
    strides) and labels of S tokens; max_target_positions, the decoder's position table, is S_max. The
    formulas hold at another encoder length too."""
    model = _whisper()
    acct = symacct.derive(model, optimizer="adamw")
    assert acct.fields["S_max"] == "max_target_positions" and "max_source_positions" in acct.symbols
    assert acct.notes[0].startswith("WhisperForConditionalGeneration: speech sequence-to-sequence step")
    check_exact(model, acct, [(2, 9), (3, 12)])
    with pytest.raises(SymacctError, match="S <= S_max"):
        acct.at(B=2, S=33)
    other = _whisper(max_source_positions=24)
    counted = measure_step(other, task(other).inputs(other, 2, 7), loss=task(other).loss)
    at = acct.at(B=2, S=7, max_source_positions=24)
    assert at.flops.hardware == counted.flops_total + counted.flash_forward + counted.flash_backward


def test_whisper_audio_classification_is_exact_with_its_layers_a_symbol() -> None:
    """Whisper's encoder with a classifier: one label a clip. Its config's begin_suppress_tokens (two token
    ids) was read as a per-layer list of this two-layer model, which kept L at its value."""
    model = _whisper("ForAudioClassification")
    acct = symacct.derive(model, optimizer="adamw")
    assert acct.fields["L"] == "encoder_layers"
    check_exact(model, acct, [(2, 9), (3, 12)])


def test_a_model_that_takes_no_token_ids_is_refused_by_its_inputs() -> None:
    """Wav2Vec2's classifier takes input_values (raw audio): given input_ids, its forward failed and the
    refusal blamed the probe's sizes."""
    config = T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
    )  # fmt: skip
    model = T.Wav2Vec2ForSequenceClassification(config)
    with pytest.raises(SymacctError, match=r"takes no input_ids \(it takes input_values, attention_mask, labels\)"):
        symacct.derive(model)


def test_a_multimodal_model_points_to_its_language_model() -> None:
    """Gemma 3's multimodal class keeps its sizes in text_config and vision_config. It has no default step
    (the refusal names the language model to derive instead); with text inputs given it derives, exact,
    every width kept at its value, and a note says why the formula has no D or L."""
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=8)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4)  # fmt: skip
    torch.manual_seed(0)
    model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(text_config=text, vision_config=vision))
    with pytest.raises(SymacctError, match=r"derive its language model alone.*from_config\(config.text_config\)"):
        symacct.derive(model)

    def inputs(m: Any, B: int, S: int) -> dict[str, Any]:
        ids = torch.randint(0, 100, (B, S))
        return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

    acct = symacct.derive(model, inputs=inputs, loss=lambda out: out.loss)
    assert sorted(acct.free_symbols()) == ["B", "S"]
    assert any(n.startswith("text_config, vision_config: configs inside the model's config") for n in acct.notes)
    args = inputs(model, 2, 9)
    counted = measure_step(model, args, loss=lambda out: out.loss)
    at = acct.at(B=2, S=9)
    assert at.flops.hardware == counted.flops_total + counted.flash_forward + counted.flash_backward
    assert at.memory.activations == counted.saved_bytes


@pytest.mark.parametrize(
    ("config", "built"),
    [
        (lambda: T.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1), "BartForConditionalGeneration"),
        (lambda: _whisper().config, "WhisperForConditionalGeneration"),
        (lambda: T.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2), "LlamaForCausalLM"),
    ],
)  # fmt: skip
def test_a_config_json_without_architectures_builds_the_whole_model(tmp_path: Path, config: Any, built: str) -> None:
    """An encoder-decoder's config.json without an ``architectures`` entry was built as its causal-LM head,
    the decoder alone (BartForCausalLM, WhisperForCausalLM), and its sheet was the decoder's with nothing to
    say so. It is built with its sequence-to-sequence head, and the task's note names the class."""
    from symacct.models.loading import load_model

    data = config().to_dict()
    data.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(data))
    model = load_model(str(tmp_path / "config.json"), {})
    assert type(model).__name__ == built


def test_a_list_of_token_ids_is_not_read_as_one_entry_a_layer() -> None:
    """Llama 3.1's config gives three end-of-sequence ids; in a three-layer model the list was read as
    per-layer and differing, so the stack was left unfactored and L kept at its value."""
    config = T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=[1, 2, 3],
    )  # fmt: skip
    acct = symacct.derive(T.LlamaForCausalLM(config))
    assert sym("L") in acct.flops.total.free_symbols and not any("per-layer list" in n for n in acct.notes)


def test_inputs_given_take_only_the_heads_loss() -> None:
    """With inputs given and no loss, the task is asked for its loss only: a base model whose forward takes
    no input_ids (ViT's pixel_values) keeps the stand-in loss, where the check for input_ids refused it,
    and the note no longer describes default inputs that were not used."""
    torch.manual_seed(0)
    config = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                         image_size=16, patch_size=4)  # fmt: skip
    model = T.ViTModel(config)

    def inputs(m: Any, B: int, S: int) -> dict[str, Any]:
        c = m.config
        return {"pixel_values": torch.randn(B, c.num_channels, c.image_size, c.image_size)}

    acct = symacct.derive(model, inputs=inputs)
    assert acct.notes[0] == "ViTModel: the inputs given, the loss of its base step"
    counted = measure_step(model, inputs(model, 2, 8), loss=lambda out: out.last_hidden_state.sum())
    at = acct.at(B=2, S=8)
    assert at.flops.hardware == counted.flops_total + counted.flash_forward + counted.flash_backward
    assert at.memory.activations == counted.saved_bytes


@pytest.mark.slow
def test_the_causal_discount_leaves_bidirectional_and_decode_attention_whole() -> None:
    """``causal_discount=True`` halved the score matmuls of BERT's attention (bidirectional) and of a decode
    step's (one query over the whole cache: 2*B*C*D*L where the step computes 4*B*C*D*L); a causal LM's
    training step keeps its discount (Megatron's 6*B*D*L*S**2 less)."""
    import sympy

    from symacct.symbols import sym

    B, S, C, D, L = (sym(n) for n in ("B", "S", "C", "D", "L"))
    sizes = {"D": 32, "F": 48, "L": 2, "H": 4, "H_kv": 2, "V": 64, "S_max": 64}
    llama = _llama_like(T.LlamaConfig, T.LlamaForCausalLM)(sizes, "sdpa")
    for model, step, less in ((llama, "train", 6 * B * D * L * S**2), (llama, "decode", 0),
                              (bert(sizes, "sdpa"), "train", 0), (bert(sizes, "eager"), "train", 0)):  # fmt: skip
        plain = symacct.derive(model, step=step).flops.total
        half = symacct.derive(model, step=step, causal_discount=True)
        assert sympy.expand(plain - half.flops.total - less) == 0, (type(model).__name__, step)
        assert any(n.startswith("causal_discount:") for n in half.notes) is (less == 0)
        assert (C in plain.free_symbols) is (step == "decode")  # decode: attention over the cache


@pytest.mark.slow  # DeepSeek-V3 derivations: in CI's slow pass (the default run's 20 minutes)
@pytest.mark.parametrize("groups", [2, 4])
def test_deepseek_v3_grouped_routing_is_exact(groups: int) -> None:
    """DeepSeek-V3 routes each token to its top groups of experts first (``n_group`` groups of E / n_group
    experts, ``topk_group`` of them kept), viewing the scores as (tokens, n_group, E / n_group). The probe gave
    E a prime of its own, which no group count divides, so every DeepSeek-V3 with n_group > 1 (the released
    one has 8) was refused; E is now probed as a multiple of n_group, which keeps its value."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=64, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_group=groups, topk_group=groups // 2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    acct = symacct.derive(model, optimizer="adamw")
    assert acct.symbols["E"] == 8 and any("n_group" in n for n in acct.notes)
    check_exact(model, acct, [(2, 7), (3, 11)])


@pytest.mark.slow  # DeepSeek-V3 derivations: in CI's slow pass (the default run's 20 minutes)
def test_deepseek_v3_with_its_first_blocks_dense_is_exact_at_its_depth() -> None:
    """DeepSeek-V3 as released makes its first three blocks dense and the rest experts
    (``first_k_dense_replace = 3``). The probe's four blocks factored as first + (L - 2) * middle + last by
    accident (blocks 1, 2 dense, the last the experts'), which the model's own blocks contradict: derive
    refused it as a model changed after construction. Its middle blocks built unlike each other, derive now
    keeps L at its value and says so; the figures are exact at that depth."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=64, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_group=2, topk_group=1, first_k_dense_replace=3, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    acct = symacct.derive(model, optimizer="adamw")
    assert "L" not in acct.symbols and any("block 3 of model.layers is built unlike block 1" in n for n in acct.notes)
    check_exact(model, acct, [(2, 7), (3, 11)])


def test_doge_at_one_position_folds_a_matmul_and_keeps_its_flops() -> None:
    """Doge's attention runs SDPA's math path (its mask needs a gradient), whose bmm returns other shapes at
    S = 1 for the same FLOPs (the query heads of a group folded into one product's rows). Pass 4's trace at
    S = 1 compares the ops the probe's FLOPs count by those FLOPs (``torch.utils.flop_counter``'s), not by
    shape, which bounded S from 2 although the matmul FLOPs there are exact, as this checks."""
    config = T.DogeConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.DogeForCausalLM(config)
    acct = symacct.derive(model)
    assert not any("takes another path" in n for n in acct.notes)
    step = task(model)
    for B in (2, 1):
        at = acct.at(B=B, S=1)
        counted = measure_step(model, step.inputs(model, B, 1), loss=step.loss)
        model.zero_grad(set_to_none=True)
        assert (counted.flash_forward, counted.grouped_forward) == (0, 0)  # bmm only, as FlopCounterMode counts
        assert (at.flops.forward, at.flops.backward) == (counted.flops_forward, counted.flops_backward)
        assert any("S = 1: byte figures" in n for n in at.notes)  # the bytes: the convention at a size of 1
    # its prefill runs the CPU flash kernel, which returns the folded shapes at S = 1: counted by its FLOPs too
    model.eval()
    prefill = symacct.derive(model, step="prefill")
    assert not any("takes another path" in n for n in prefill.notes)
    with torch.no_grad(), FlopCounterMode(display=False) as fc, CpuFlashCounter() as flash:
        model(input_ids=torch.randint(0, 64, (2, 1)), use_cache=True, logits_to_keep=1)
    assert flash.total > 0 and prefill.at(B=2, S=1).flops.forward == fc.get_total_flops() + flash.total
