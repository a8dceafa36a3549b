"""No silently wrong number: each input here gave a plausible wrong figure or a traceback before; now it
gives the right figure or one clear SymacctError (the CLI: one line, exit code 2).

Where a refusal claims the model cannot run a size, a real step at that size is shown to fail too, so the
constraint is the model's, not symacct's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch
from cli_run import cli
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import symacct
from symacct import SymacctError, memo
from symacct.models import GPT2, Cruncher, CruncherConfig, GPT2Config, Llama, LlamaConfig
from symacct.recipes import MixedPrecisionAdamW

SMALL = dict(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)


def one_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def gpt2() -> symacct.Accounting:
    return symacct.derive(GPT2(GPT2Config(**SMALL)))


# ---- sweep validates as at() does ----------------------------------------------------------------


def test_sweep_refuses_what_at_refuses(gpt2):
    with pytest.raises(SymacctError, match="n_layer is the config field of L"):
        gpt2.sweep("flops.total", n_layer=np.array([24, 48]), B=2, S=8)
    with pytest.raises(SymacctError, match="B=-1 is not a positive integer"):
        gpt2.sweep("flops.total", B=np.array([-1, 2]), S=8)
    with pytest.raises(SymacctError, match="B=1.5 is not a positive integer"):
        gpt2.sweep("flops.total", B=np.array([1.5]), S=8)
    with pytest.raises(SymacctError, match="do not broadcast"):
        gpt2.sweep("flops.total", B=np.array([1, 2]), S=np.array([2, 4, 8]))
    with pytest.raises(SymacctError, match="S <= S_max"):
        gpt2.sweep("flops.total", B=2, S=np.array([8, 32]))
    got = gpt2.sweep("flops.total", B=np.array([1, 2]), S=np.array([8, 16]))
    assert list(got) == [gpt2.at(B=1, S=8).flops.total, gpt2.at(B=2, S=16).flops.total]
    assert list(gpt2.sweep("flops.total", B=np.array([2.0]), S=8)) == [gpt2.at(B=2, S=8).flops.total]


def test_at_takes_a_python_integer_of_any_size(gpt2):
    """B = 10**30 was refused as "not a positive integer": it went through a numpy array on its way in,
    where it is an object. The formulas are evaluated in Python integers, so it is exact: gpt2's FLOPs
    are linear in B and its saved activations affine (the loss's few saved bytes do not grow with B)."""
    one, two, big = gpt2.at(B=1, S=8), gpt2.at(B=2, S=8), gpt2.at(B=10**30, S=8)
    assert big.flops.total == 10**30 * one.flops.total
    slope = two.memory.activations - one.memory.activations
    assert big.memory.activations == one.memory.activations + (10**30 - 1) * slope


# ---- the model derived must be the model given --------------------------------------------------


def test_a_module_resized_after_construction_is_refused(gpt2):
    """MLPs swapped for narrower ones after construction run the ops the config's model runs, so comparing ops
    passes; the config's formula would be silently wrong (the real step counts other FLOPs). The parameters'
    shapes at the model's own sizes tell them apart."""
    model = GPT2(GPT2Config(**SMALL))
    for block in model.blocks:  # 4D = 64 wide in the config's model; 24 here
        block.mlp.c_fc, block.mlp.c_proj = nn.Linear(16, 24), nn.Linear(24, 16)
    with FlopCounterMode(display=False) as fc:
        model(*model.example_inputs(2, 8)).backward()
    assert fc.get_total_flops() != gpt2.at(B=2, S=8).flops.total
    with pytest.raises(SymacctError, match=r"parameter blocks\.0\.mlp\.c_fc\.weight is \(24, 16\) in the given model "
                       r"and \(64, 16\) in the rebuilt one"):  # fmt: skip
        symacct.derive(model)
    with torch.device("meta"):  # on the meta device too, and whatever the depth (the stack shortened)
        deep = GPT2(GPT2Config(**{**SMALL, "n_layer": 7}))
    deep.blocks[3].mlp.c_fc, deep.blocks[3].mlp.c_proj = nn.Linear(16, 24), nn.Linear(24, 16)
    with pytest.raises(SymacctError, match=r"parameter blocks\.3\.mlp\.c_fc\.weight"):
        symacct.derive(deep)


def test_a_model_cast_to_bf16_is_refused_and_derived_with_params_dtype():
    """model.to(bfloat16) runs the fp32 model's ops: derived as its config's (fp32) model it would get fp32
    bytes, twice the real step's. Refused, naming params_dtype; with it, the real CPU step's bytes exactly."""
    from symacct.measure.run import measure_step

    model = GPT2(GPT2Config(**SMALL)).to(torch.bfloat16)
    with pytest.raises(SymacctError, match=r"wte\.weight is torch\.bfloat16 where .* builds it in torch\.float32.*"
                       r"params_dtype='bf16'"):  # fmt: skip
        symacct.derive(model)
    acct = symacct.derive(model, params_dtype="bf16")
    for B, S in ((2, 8), (3, 5)):
        torch.manual_seed(0)
        assert acct.at(B=B, S=S).saved_bytes == measure_step(model, model.example_inputs(B, S)).saved_bytes
    mixed = GPT2(GPT2Config(**SMALL))
    mixed.blocks[1].to(torch.bfloat16)
    with pytest.raises(SymacctError, match=r"parameters mix torch\.bfloat16, torch\.float32"):
        symacct.derive(mixed)


def test_a_frozen_parameter_is_refused_and_a_factory_that_freezes_it_is_derived():
    """A frozen embedding takes no weight gradient: the probe model, built from the config, trains every
    parameter. Refused by name before any op is compared; a factory that freezes it is derived, and its
    FLOPs equal FlopCounterMode's on the real step (4 B S D V for the head and no embedding gradient)."""
    model = GPT2(GPT2Config(**SMALL))
    model.wte.weight.requires_grad_(False)
    with pytest.raises(SymacctError, match=r"parameter wte\.weight requires no gradient \(frozen\); the model "
                       r"rebuilt from its config trains it.*dims="):  # fmt: skip
        symacct.derive(model)
    assert symacct.derive(model, step="forward").flops.total  # a forward step trains nothing: not compared

    def frozen(D: int, L: int, V: int, S_max: int) -> GPT2:
        m = GPT2(GPT2Config(**{**SMALL, "n_embd": D, "n_layer": L, "vocab_size": V, "block_size": S_max}))
        m.wte.weight.requires_grad_(False)
        return m

    acct = symacct.derive(
        frozen, dims={"D": 16, "L": 2, "V": 32, "S_max": 16}, inputs=lambda m, B, S: m.example_inputs(B, S)
    )
    with FlopCounterMode(display=False) as fc:
        model(*model.example_inputs(2, 8)).backward()
    assert acct.at(B=2, S=8).flops.total == fc.get_total_flops()


def test_weights_untied_after_construction_are_refused_by_name():
    model = GPT2(GPT2Config(**SMALL))  # tie_weights: the head is the embedding
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # one more V x D matrix
    with pytest.raises(SymacctError, match=r"wte\.weight is a parameter of its own; in the model rebuilt from its "
                       r"config it is shared by lm_head\.weight, wte\.weight"):  # fmt: skip
        symacct.derive(model, step="forward")


def test_a_head_count_changed_after_construction_is_refused():
    """Attention heads set to 8 after construction (the config builds 4 over the same width): the same ops on
    the same parameters, at other shapes, saving an 8-head score matrix. Derived as the config's model, the
    saved bytes were silently short of the real step's; now refused, naming the op whose shapes differ."""
    from symacct.measure.run import measure_step

    derived = symacct.derive(GPT2(GPT2Config(**SMALL))).at(B=2, S=8).saved_bytes
    for depth, block in ((2, 0), (8, 5)):  # the probe's block in position too (a deep stack, shortened)
        model = GPT2(GPT2Config(**{**SMALL, "n_layer": depth}))
        model.blocks[block].attn.n_head = 8
        if depth == 2:
            assert measure_step(model, model.example_inputs(2, 8)).saved_bytes > derived
        shapes = r"aten\._softmax\.default returns \(\d+, 8, \d+, \d+\) in the given model and \(\d+, 4, \d+, \d+\)"
        with pytest.raises(SymacctError, match=rf"{shapes} in the rebuilt one .*in block {block} of the layer stack"):
            symacct.derive(model)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_buffers_resized_or_added_after_construction_are_refused(gpt2):
    """Buffers take memory the op comparison does not see: a longer causal mask slices to the same ops, an
    unused buffer or parameter runs none. Derived as the config's model, the held bytes were silently short
    (512 B of masks where the model holds 2,048). The untouched model's bytes equal what it holds."""
    model = GPT2(GPT2Config(**SMALL))
    at = gpt2.at(B=2, S=8)
    assert (at.memory.params, at.memory.buffers) == (_nbytes(model.parameters()), _nbytes(model.buffers()))
    for block in model.blocks:  # (S_max, S_max) = (16, 16) in the config's model; (32, 32) here
        block.attn.mask = torch.ones(32, 32, dtype=torch.bool).tril()
    assert _nbytes(model.buffers()) == 2048 != at.memory.buffers
    with pytest.raises(SymacctError, match=r"buffer blocks\.0\.attn\.mask is \(32, 32\) in the given model and "
                       r"\(16, 16\) in the rebuilt one"):  # fmt: skip
        symacct.derive(model)
    for where, add in (
        ("blocks.1.extra", lambda m: m.blocks[1].register_buffer("extra", torch.zeros(100))),
        ("extra", lambda m: m.register_parameter("extra", nn.Parameter(torch.zeros(100)))),
    ):
        model = GPT2(GPT2Config(**SMALL))
        add(model)
        kind = "buffer" if "1" in where else "parameter"
        with pytest.raises(SymacctError, match=rf"the given model has a {kind} {where}; the other has none"):
            symacct.derive(model)
    model = GPT2(GPT2Config(**SMALL))
    w = model.blocks[1].ln_1.weight
    del model.blocks[1].ln_1.weight  # a plain tensor now: no longer a parameter the model holds or trains
    model.blocks[1].ln_1.weight = w.detach()
    with pytest.raises(SymacctError, match=r"the model rebuilt from its config has a parameter "
                       r"blocks\.1\.ln_1\.weight; the other has none: it was removed"):  # fmt: skip
        symacct.derive(model)


def test_a_buffer_cast_after_construction_is_refused():
    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=64, hidden_dim=48,
                              max_seq_len=16))  # fmt: skip
    model.cos, model.sin = model.cos.double(), model.sin.double()
    with pytest.raises(SymacctError, match=r"buffer cos is torch\.float64 where the model rebuilt from its config "
                       r"builds it in torch\.float32"):  # fmt: skip
        symacct.derive(model)


@pytest.mark.slow
def test_a_deep_stacks_middle_block_is_compared_by_name():
    """Blocks beyond the probe's four are compared with the probe block in their position: a frozen or bf16
    sixth block of eight, or its longer mask, is named (before: an op count, or nothing for the mask)."""
    cfg = GPT2Config(**{**SMALL, "n_layer": 8})
    cases = (
        (lambda m: [p.requires_grad_(False) for p in m.blocks[5].parameters()],
         r"parameter blocks\.5\.ln_1\.weight requires no gradient \(frozen\)"),
        (lambda m: m.blocks[5].to(torch.bfloat16),
         r"parameters mix torch\.bfloat16, torch\.float32; .* builds blocks\.5\.ln_1\.weight in torch\.float32"),
        (lambda m: setattr(m.blocks[5].attn, "mask", torch.ones(32, 32, dtype=torch.bool).tril()),
         r"buffer blocks\.5\.attn\.mask is \(32, 32\)"),
    )  # fmt: skip
    for change, message in cases:
        model = GPT2(cfg)
        change(model)
        with pytest.raises(SymacctError, match=message):
            symacct.derive(model)


# ---- sizes the model cannot run ----------------------------------------------------------------


class StridedThenPooled(nn.Module):
    """A stride-2 convolution and a 2 x 2 max pooling: image sides PyTorch rounds down where they do not halve."""

    def __init__(self, C: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, stride=2, padding=1)  # (B, 3, S, S) -> (B, C, ceil(S/2), ceil(S/2))
        self.head = nn.Linear(C, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.max_pool2d(self.stem(img), 2)  # (B, C, S/4, S/4) where 4 divides S
        return self.head(h.mean((2, 3))).sum()


def test_a_size_an_op_rounds_down_is_refused_as_beyond_the_formulas_not_the_model():
    """At S = 6 the pooling's output side is 1 (3 // 2), which the formula's S/4 does not follow. The refusal
    said "the model cannot run these sizes", but a real step runs there; it now says the formulas hold where 4
    divides S, and which op rounds."""
    acct = symacct.derive(
        lambda C: StridedThenPooled(C), dims={"C": 8}, inputs=lambda m, B, S: (torch.randn(B, 3, S, S),)
    )
    assert StridedThenPooled(8)(torch.randn(2, 3, 6, 6)).isfinite()  # the model runs at S = 6
    with pytest.raises(SymacctError, match="the formulas hold where 4 divides S: at S=6 aten.max_pool2d") as e:
        acct.at(B=2, S=6)
    assert "cannot run" not in e.value.what
    assert acct.at(B=2, S=8).flops.total > 0


def test_sequence_beyond_the_position_table_is_refused(gpt2):
    model = GPT2(GPT2Config(**SMALL))
    with pytest.raises(IndexError):  # the real step cannot run it either
        model(*model.example_inputs(1, 17))
    with pytest.raises(SymacctError, match=r"S=17, S_max=16 breaks S <= S_max.*block_size"):
        gpt2.at(B=1, S=17)
    with pytest.raises(SymacctError, match="S <= S_max"):
        gpt2.peak(B=1, S=4096)
    assert gpt2.at(B=1, S=17, S_max=17).flops.total > 0  # with a longer table it runs


def test_heads_that_do_not_divide_the_width_are_refused(gpt2):
    with pytest.raises(AssertionError):
        GPT2(GPT2Config(**{**SMALL, "n_head": 5}))  # the model's own constructor refuses it
    with pytest.raises(SymacctError, match=r"H divides D.*n_embd \(D\), n_head \(H\)"):
        gpt2.at(B=1, S=8, H=5)
    llama = symacct.derive(Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)))
    with pytest.raises(SymacctError, match="H_kv divides H"):
        llama.at(B=1, S=8, H_kv=3, H=4, D=48)
    with pytest.raises(SymacctError, match="S <= S_max"):  # the rotary tables are sliced to S
        llama.at(B=1, S=32)
    kinds = {(c.kind, str(c.lhs), str(c.rhs)) for c in llama.constraints}
    assert ("le", "S", "S_max") in kinds and ("integer", "H/H_kv", "None") in kinds


def test_cli_derive_beyond_s_max_is_one_line():
    one_line(cli("derive", "gpt2", "--config", "n_layer=2", "--seq", "2048"), "S <= S_max")


def test_fit_seq_says_it_raised_s_max():
    with torch.device("meta"):
        acct = symacct.derive(GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=4, block_size=64)), optimizer="adamw")
    res = symacct.fit(acct, "S", hardware="H100-SXM", B=1)
    assert res.value > 64 and res.notes and "S_max raised from 64" in res.notes[0] and "block_size" in res.notes[0]
    assert res.peak_bytes == acct.steady(B=1, S=res.value, S_max=res.value)["peak"]  # a later step: AdamW's states


def test_fit_seq_keeps_s_max_where_no_table_bounds_s():
    """A rotary model's max_position_embeddings bounds nothing its step runs (transformers' Llama computes
    its cos and sin from the positions): fit solves S beyond it with S_max kept, and no note says the model
    cannot run S > S_max, as it used to."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    acct = symacct.derive(transformers.LlamaForCausalLM(cfg), optimizer="adamw")
    res = symacct.fit(acct, "S", hardware="RTX-4090", B=1)
    assert res.value > 16 and res.notes == []
    assert res.peak_bytes == acct.steady(B=1, S=res.value)["peak"] and acct.symbols["S_max"] == 16


# ---- --config parsed by the field's type ---------------------------------------------------------


def test_config_bools_parse_by_type():
    from symacct.models.loading import load_model

    for text, tied in (("no", False), ("off", False), ("0", False), ("false", False), ("yes", True), ("1", True)):
        model = load_model("gpt2", {"tie_weights": text, "n_layer": "1"})
        assert (model.lm_head.weight is model.wte.weight) is tied, text
    one_line(cli("derive", "gpt2", "--config", "tie_weights=maybe"), "tie_weights is a bool")


@pytest.mark.parametrize(
    "item, needle",
    [
        ("n_layer=abc", "n_layer is an integer"),
        ("n_layer=2.5", "n_layer is an integer"),
        ("n_embd=1e3", "n_embd is an integer"),
        ("dropout=abc", "dropout is a number"),
        ("dropout=nan", "dropout must be finite"),
        ("n_head=5", "building gpt2 with n_head=5 failed: AssertionError: assert config.n_embd % config.n_head"),
    ],
)
def test_cli_bad_config_values_are_one_line(item, needle):
    one_line(cli("derive", "gpt2", "--config", item), needle)


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
def test_cli_factories_that_fail_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "facts.py").write_text(
        "def needs_args(width):\n    raise AssertionError\n"
        "def raises():\n    raise RuntimeError('no GPU here')\n"
        "def not_a_module():\n    return 3\n"
    )
    env_path = str(tmp_path)
    for name, needle in (
        ("facts:needs_args", "TypeError"),
        ("facts:raises", "RuntimeError: no GPU here"),
        ("facts:not_a_module", "not an nn.Module"),
        ("facts:missing", "cannot import"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "symacct.cli", "derive", name],
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "PYTHONPATH": env_path},
        )
        one_line(proc, needle)


# ---- time: non-finite inputs, GPUs, MFU ------------------------------------------------------------


def test_estimate_refuses_non_finite_and_fractional_gpus():
    base = dict(params=1e9, tokens=1e9, hardware="H100")
    for kw in ({"tokens": math.nan}, {"tokens": math.inf}, {"params": math.inf}, {"mfu": math.nan}):
        with pytest.raises(SymacctError):
            symacct.estimate(**{**base, **kw})
    for gpus in (1.5, 0, -8, True):
        with pytest.raises(SymacctError, match="gpus must be a positive whole number"):
            symacct.estimate(**base, gpus=gpus)
    assert symacct.estimate(**base, gpus=8.0).inputs["gpus"] == 8  # a whole float is a count
    one_line(cli("estimate", "--params", "inf", "--tokens", "1e9", "--hardware", "H100", "--json"), "finite")
    one_line(cli("estimate", "--params", "1e9", "--tokens", "1e9", "--hardware", "H100", "--gpus", "1.5"), "whole")


def test_mfu_above_one_is_an_error_naming_the_cause():
    assert symacct.mfu(989e12 * 0.5, 1.0, "H100") == pytest.approx(0.5)
    with pytest.raises(SymacctError, match=r"above 1.*per step for all gpus"):
        symacct.mfu(1e18, 1.0, "H100")


def test_json_never_holds_a_bare_infinity():
    from symacct.cli import _json

    with pytest.raises(SymacctError, match="not finite"):
        _json({"days": math.inf})
    assert json.loads(_json({"days": 1.5})) == {"days": 1.5}


def test_fit_gpus_are_data_parallel_replicas(gpt2):
    one = symacct.fit(gpt2, "B", hardware="H100-SXM", S=16)
    eight = symacct.fit(gpt2, "B", hardware="H100-SXM", S=16, gpus=8)
    assert one.value == eight.value and eight.global_batch == 8 * eight.value and eight.replicas == 8
    assert one.notes == [] and "DDP's gradient buckets" in eight.notes[0] and "fit_layout" in eight.notes[0]
    for bad in (0, -8, 1.5):
        with pytest.raises(SymacctError, match="gpus"):
            symacct.fit(gpt2, "B", hardware="H100-SXM", S=16, gpus=bad)


# ---- model FLOPs, hardware FLOPs, the roofline's peaks ------------------------------------------------


def test_model_flops_leave_out_the_flash_kernels_recompute():
    cfg = GPT2Config(**{**SMALL, "sdpa": True, "dropout": 0.0})
    acct = symacct.derive(GPT2(cfg))
    B, S = 2, 8
    at = acct.at(B=B, S=S)
    one = 2 * B * cfg.n_head * S * S * (cfg.n_embd // cfg.n_head)  # one (S x Dh) @ (Dh x S) product per layer
    assert at.flops.recompute == cfg.n_layer * one  # the backward's recomputed scores
    assert at.flops.backward == 2 * at.flops.forward and at.flops.hardware == at.flops.total + at.flops.recompute
    roof = symacct.roofline(acct, "H100-SXM", B=B, S=S)
    assert roof.hfu / roof.mfu == pytest.approx(at.flops.hardware / at.flops.total)


def test_roofline_refuses_a_missing_peak_and_uses_the_steps_dtype():
    from symacct.time.hardware import Accelerator

    fp32 = symacct.derive(Cruncher(CruncherConfig(dim=64, n_layers=2)))
    no_fp32 = Accelerator("X", {"bf16": 100.0}, 10, 1.0, 1.0, "test")
    with pytest.raises(SymacctError, match="X has no fp32 peak"):
        symacct.roofline(fp32, no_fp32, B=8)
    bf16 = symacct.derive(Cruncher(CruncherConfig(dim=64, n_layers=2)), autocast="bf16")
    no_bf16 = Accelerator("Y", {"fp32": 10.0}, 10, 1.0, 1.0, "test")
    with pytest.raises(SymacctError, match="Y has no bf16 peak"):
        symacct.roofline(bf16, no_bf16, B=8)
    roof = symacct.roofline(fp32, "H100-SXM", B=8)
    at = fp32.at(B=8)
    assert roof.dtype == "fp32" and roof.mfu == pytest.approx(at.flops.total / (roof.seconds * 67e12))
    assert symacct.roofline(bf16, "H100-SXM", B=8).dtype == "bf16"


# ---- embedding_flops="matmul" ------------------------------------------------------------------------


def test_embedding_as_matmul_counts_the_one_hot_products():
    model = GPT2(GPT2Config(**SMALL))
    lookup = symacct.derive(model)
    matmul = symacct.derive(model, embedding_flops="matmul")
    B, S = 2, 8
    # the independent count: FlopCounterMode on the one-hot products the lookups stand for
    idx, pos = torch.randint(0, SMALL["vocab_size"], (B, S)), torch.arange(S)
    with FlopCounterMode(display=False) as fc:
        nn.functional.one_hot(idx, SMALL["vocab_size"]).float() @ model.wte.weight
        nn.functional.one_hot(pos, SMALL["block_size"]).float() @ model.wpe.weight
    a, b = lookup.at(B=B, S=S), matmul.at(B=B, S=S)
    assert b.flops.forward - a.flops.forward == fc.get_total_flops() == b.flops.embedding / 3
    assert b.flops.backward - a.flops.backward == 2 * fc.get_total_flops()
    assert a.flops.embedding == 0 and matmul.options["embedding_flops"] == "matmul"


# ---- optimizers: one answer per optimizer, a recipe that trains right, bytes per parameter ---------------


@pytest.mark.parametrize(
    "name, options",
    [("adamw", {}), ("adam", {}), ("adamw", {"weight_decay": 0.0}), ("adam", {"amsgrad": True}), ("adagrad", {})],
)
def test_fused_kernels_cost_what_the_single_tensor_path_costs(name, options):
    model = Cruncher(CruncherConfig(dim=16, n_layers=2))
    got = {
        path: symacct.derive(model, optimizer=name, optimizer_options={**options, path: True}).flops.other_optimizer
        for path in ("fused", "foreach")
    }
    single = symacct.derive(model, optimizer=name, optimizer_options={**options, "foreach": False})
    assert got["fused"] == single.flops.other_optimizer
    if name != "adagrad" and not options.get("amsgrad"):  # foreach runs other ops there (docs/conventions.md)
        assert got["foreach"] == got["fused"]


def test_sgd_momentum_fused_matches_single_tensor():
    model = Cruncher(CruncherConfig(dim=16, n_layers=2))
    opts = {"momentum": 0.9, "nesterov": True}
    fused = symacct.derive(model, optimizer="sgd", optimizer_options={**opts, "fused": True})
    single = symacct.derive(model, optimizer="sgd", optimizer_options={**opts, "foreach": False})
    assert fused.flops.other_optimizer == single.flops.other_optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_recipe_with_fp32_grads_trains_like_adamw(dtype):
    """Three steps with lr > 0: the recipe's fp32 master weights follow AdamW fed the same gradients."""
    torch.manual_seed(1)
    xs = [torch.randn(4, 8, dtype=dtype) for _ in range(3)]
    torch.manual_seed(0)
    model = Cruncher(CruncherConfig(dim=8, n_layers=2)).to(dtype)
    opt = MixedPrecisionAdamW(model.parameters(), lr=0.1, fp32_grads=True)
    ref = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=0.1)
    for x in xs:
        twin = Cruncher(CruncherConfig(dim=8, n_layers=2)).to(dtype)  # this step's gradients alone, apart
        twin.load_state_dict(model.state_dict())
        twin(x).backward()
        for r, t in zip(ref, twin.parameters()):
            r.grad = t.grad.float()
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        for r, p in zip(ref, model.parameters()):
            assert torch.equal(opt.state[p]["master"], r.detach())
            assert torch.equal(p.detach(), r.detach().to(dtype))
    if dtype is torch.float32:  # and equal to a plain AdamW on the same model
        torch.manual_seed(0)
        plain = Cruncher(CruncherConfig(dim=8, n_layers=2))
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
        for x in xs:
            plain(x).backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a, b)


def test_bytes_per_param_between_steps_and_at_the_step_peak():
    from symacct.measure.run import StorageTracker

    model = GPT2(GPT2Config(**SMALL))
    mixed = symacct.derive(model, optimizer="mixed_adamw", params_dtype="bf16")
    assert mixed.bytes_per_param() == 16 and mixed.bytes_per_param_peak() == 20
    # measured: a real step's live bytes at the optimizer's peak, per parameter (step 2: states exist)
    torch.manual_seed(0)
    real = GPT2(GPT2Config(**{**SMALL, "n_embd": 64, "vocab_size": 64})).to(torch.bfloat16)
    opt = MixedPrecisionAdamW(real.parameters())
    n = sum(p.numel() for p in real.parameters())
    for _ in range(2):
        real(*real.example_inputs(1, 2)).backward()
        tensors = [*real.parameters(), *(p.grad for p in real.parameters() if p.grad is not None)]
        tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        with StorageTracker(tensors) as tracker:
            opt.step()
        opt.zero_grad(set_to_none=True)
    # leading terms 20 bytes per parameter; on top, AdamW's single-tensor path keeps two fp32 temporaries of
    # the parameter it is at (sqrt(v), then the quotient) and the scalar step counters
    largest = max(p.numel() for p in real.parameters())
    assert 20 * n <= tracker.peak <= 20 * n + 2 * 4 * largest + 4096
    fp32 = symacct.derive(model, optimizer="adamw")
    assert fp32.bytes_per_param() == fp32.bytes_per_param_peak() == 16


# ---- inputs and options that escaped as tracebacks or were silently ignored ---------------------------


class DictConfig(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(config["n_embd"], config["n_embd"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config["n_embd"]),)


def test_plain_dict_config_is_read():
    acct = symacct.derive(DictConfig({"n_embd": 8}))
    assert acct.symbols == {"D": 8} and acct.at(B=3).flops.forward == 2 * 3 * 8 * 8  # 2*B*D*D


def test_keyword_inputs_are_passed_by_name():
    """inputs= may return a dict: model(**inputs), as transformers models take input_ids=, labels=."""
    model = GPT2(GPT2Config(**SMALL))
    positional = symacct.derive(model)
    by_name = symacct.derive(
        model,
        inputs=lambda m, B, S: {
            "idx": torch.zeros(B, S, dtype=torch.long),
            "targets": torch.zeros(B, S, dtype=torch.long),
        },
    )
    assert by_name.flops.total == positional.flops.total
    assert by_name.memory.activations == positional.memory.activations


def test_bad_options_are_refused_in_one_error():
    model = GPT2(GPT2Config(**SMALL))
    with pytest.raises(SymacctError, match="keys that are not argument names"):
        symacct.derive(model, inputs=lambda m, B, S: {0: torch.zeros(B, S, dtype=torch.long)})
    with pytest.raises(SymacctError, match="fixed= names n_layr.*did you mean n_layer"):
        symacct.derive(model, fixed=["n_layr"])
    for dims in ({"D": 0}, {"D": -4}, {"D": 2.5}, {"D": True}):
        with pytest.raises(SymacctError, match="positive integer"):
            symacct.derive(lambda D: nn.Linear(D, D), dims=dims, inputs=lambda B, S: (torch.randn(B, 4),))
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(SymacctError) as e:
        symacct.derive(model, optimizer=opt)
    assert "\n" not in str(e.value) and "optimizer=AdamW" in str(e.value)
    compiled = torch.compile(model)
    with pytest.raises(SymacctError, match="_orig_mod"):
        symacct.derive(compiled)
    model.blocks[0].compile()  # compiled in place: it was traced as eager without a word
    with pytest.raises(SymacctError, match=r"module blocks.0 is compiled in place \(module.compile\(\)\)"):
        symacct.derive(model)


def test_a_compiled_module_a_factory_builds_or_a_model_holds_is_refused():
    """A factory that returns ``torch.compile(model)``, and a model holding a compiled block, were traced as eager
    without a word (the wrapper is refused only where it is the model given): the figures were eager's, where
    the compiled graph fuses ops and keeps other tensors."""

    def mlp(D: int) -> nn.Module:
        return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    step = {"inputs": lambda m, B, S: (torch.randn(B, S, next(m.parameters()).shape[1]),), "loss": lambda y: y.sum()}
    with pytest.raises(SymacctError, match=r"the model the factory builds is a torch.compile wrapper.*_orig_mod"):
        symacct.derive(lambda D: torch.compile(mlp(D)), dims={"D": 8}, **step)
    holder = nn.Sequential(nn.Linear(8, 8), torch.compile(mlp(8)))
    with pytest.raises(SymacctError, match=r"the model's module 1 is a torch.compile wrapper.*pass the eager module"):
        symacct.derive(holder, **step)
    assert symacct.derive(lambda D: mlp(D), dims={"D": 8}, **step).flops.total != 0  # the eager factory derives


def test_a_torchscript_model_is_refused_by_name():
    """It failed inside the TorchScript interpreter and the refusal blamed the probe's sizes."""
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    for scripted in (torch.jit.script(mlp), torch.jit.trace(mlp, torch.randn(2, 8))):
        with pytest.raises(SymacctError, match="the model is a TorchScript module"):
            symacct.derive(scripted, inputs=lambda m, B, S: (torch.randn(B, 8),), loss=lambda y: y.sum())


def test_derive_inside_no_grad_or_inference_mode_is_the_same_step():
    model = GPT2(GPT2Config(**SMALL))
    plain = symacct.derive(model, optimizer="adamw")
    with torch.no_grad():
        inside = symacct.derive(model, optimizer="adamw")
    assert inside.flops.total == plain.flops.total and inside.memory.peak == plain.memory.peak
    memo.clear()  # every trace taken: inside inference_mode the probe model was built of inference
    with torch.inference_mode():  # tensors, refused as "cannot be saved for backward"
        inside = symacct.derive(model, optimizer="adamw")
    assert inside.flops.total == plain.flops.total and inside.memory.peak == plain.memory.peak


def test_derive_under_anomaly_detection_is_the_same_step():
    model = GPT2(GPT2Config(**SMALL))
    plain = symacct.derive(model)
    memo.clear()  # every trace taken: anomaly mode's NaN check read a gradient's value, refused as the
    with torch.autograd.detect_anomaly():  # model's "data-dependent control flow"
        inside = symacct.derive(model)
    assert inside.flops.total == plain.flops.total and inside.memory.peak == plain.memory.peak
    assert torch.is_anomaly_enabled() is False


@pytest.mark.parametrize("kind, dtype, name", [("cpu", torch.bfloat16, "bf16"), ("cpu", torch.float16, "fp16")])
def test_an_autocast_the_caller_entered_is_refused(kind, dtype, name):
    """It cast the backward too, where the ``autocast`` option casts the forward and the loss: the peak of
    a two-layer GPT-2 (D = 32, H = 2, V = 64) at B = 2, S = 8 came out 295,816 bytes against the option's
    241,416, with the
    options reporting no autocast; with the option as well, the option's figures changed; inside an fp16
    autocast, the option bf16 failed inside symacct."""
    model = GPT2(GPT2Config(**SMALL))
    with torch.autocast(kind, dtype=dtype):
        with pytest.raises(SymacctError, match=rf"inside torch.autocast\('{kind}'.*autocast='{name}'"):
            symacct.derive(model)
        with pytest.raises(SymacctError, match="does not take an autocast from the caller"):
            symacct.derive(model, autocast="bf16")
    assert symacct.derive(model, autocast=name).options["autocast"] == str(dtype)


@pytest.mark.parametrize("dtype", ["fp32", torch.float32, torch.float64])
def test_an_autocast_to_a_dtype_autocast_does_not_cast_to_is_refused(dtype):
    """It was taken and reported in the options while PyTorch disabled the autocast (a warning): the figures were
    those of the step without it."""
    with pytest.raises(SymacctError, match="is no autocast: PyTorch's autocast casts to bfloat16 or float16"):
        symacct.derive(GPT2(GPT2Config(**SMALL)), autocast=dtype)


def test_saved_tensor_hooks_disabled_by_the_caller_are_refused():
    """They failed inside symacct ("symacct failed: RuntimeError: ... a defect of symacct")."""
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(SymacctError, match="saved-tensor hooks are disabled") as e:
            symacct.derive(GPT2(GPT2Config(**SMALL)))
    assert not e.value.internal


def _to_half(t: torch.Tensor) -> torch.Tensor:
    return t.half() if t.is_floating_point() else t


def _to_float(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.float16 else t


class _Compressed(GPT2):
    """GPT-2, its forward under a compressing saved-tensor pair (fp16 copies kept for backward)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(_to_half, _to_float):
            return super().forward(idx, targets)


def test_saved_tensor_hooks_the_caller_set_are_refused():
    """They were ignored: symacct's own hooks, set inside them, took their place, and a two-layer GPT-2 (D = 16,
    H = 4, V = 32) at B = 2, S = 8 came out with the 55,108 bytes of activations of a step without them, where
    the step run inside that compressing pair keeps fp16 copies. Inside the model's forward the same pair is
    counted (fewer bytes), and that is the way the refusal names."""
    small = GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)
    plain = symacct.derive(GPT2(small)).at(B=2, S=8).memory.activations
    with torch.autograd.graph.saved_tensors_hooks(_to_half, _to_float):
        with pytest.raises(SymacctError, match="inside saved-tensor hooks the caller set.*in the model's forward"):
            symacct.derive(GPT2(small))
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(SymacctError, match="inside saved-tensor hooks the caller set"):
            symacct.derive(GPT2(small))
    inside = symacct.derive(_Compressed(small))
    assert inside.at(B=2, S=8).memory.activations < plain


class _OneInput(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.example_inputs(B, S)  # (idx, targets): one more than forward takes


def test_inputs_the_forward_does_not_take_are_named_as_such():
    """They were refused as "the model's forward failed at probe sizes", with a hint about size relations."""
    small = GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)
    with pytest.raises(SymacctError, match=r"does not take the step's inputs: _OneInput.forward\(idx.*too many") as e:
        symacct.derive(_OneInput(GPT2(small)))
    assert "probe sizes" not in str(e.value) and not e.value.internal
    with pytest.raises(SymacctError, match="does not take the step's inputs.*missing a required argument: 'idx'"):
        symacct.derive(GPT2(small), inputs=lambda m, B, S: {"ids": torch.zeros(B, S, dtype=torch.long)})


class _CastsItsRouter(nn.Module):
    """A router cast to float32 in every forward (``self.router = self.router.float()``), as SwitchTransformers'
    and NLLB-MoE's routers are: in float32 a conversion that changes nothing."""

    def __init__(self, D: int) -> None:
        super().__init__()
        self.D = D
        self.router = nn.Linear(D, 4)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, D)
        self.router = self.router.float()
        gate = self.router(x.float()).softmax(-1)[..., :1]  # (B, S, 1)
        return (self.proj(x) * gate.to(x.dtype)).square().mean()


def test_a_module_converted_in_the_step_derives_where_nothing_changes():
    """Module.to on fake parameters failed inside PyTorch (swap_tensors refuses them, pytorch/pytorch#153056),
    and the refusal blamed the probe's sizes ("the model's forward failed at probe sizes: RuntimeError: _apply():
    Couldn't swap Linear.weight"), for a model that runs eagerly. A conversion that changes nothing is now
    nothing (exact against a real step), and one that changes the dtype is refused by name."""
    from real_step import exact_against_a_real_step

    def inputs(m: nn.Module, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, m.D),)

    acct = symacct.derive(_CastsItsRouter, dims={"D": 8}, inputs=inputs, optimizer="adamw")
    model = _CastsItsRouter(8)
    model.example_inputs = lambda B, S: inputs(model, B, S)
    exact_against_a_real_step(model, acct)
    with pytest.raises(SymacctError, match="converts a module's parameters .* from torch.bfloat16 on cpu to "
                       "torch.float32") as e:  # fmt: skip
        symacct.derive(_CastsItsRouter, dims={"D": 8}, inputs=inputs, params_dtype="bf16")
    assert "probe sizes" not in str(e.value) and not e.value.internal


def test_inputs_that_ignore_b_are_noted():
    def linear(D: int) -> nn.Module:
        return nn.Linear(D, D)

    acct = symacct.derive(linear, dims={"D": 8}, inputs=lambda m, B, S: (torch.randn(3, m.in_features),),
                          loss=lambda y: y.sum())  # fmt: skip
    assert any("B reaches no tensor shape" in n for n in acct.notes)
    ok = symacct.derive(linear, dims={"D": 8}, inputs=lambda m, B, S: (torch.randn(B, m.in_features),),
                        loss=lambda y: y.sum())  # fmt: skip
    assert not any("B reaches" in n for n in ok.notes)


def test_track_refuses_an_unwritable_path_before_the_step(tmp_path):
    model = Cruncher(CruncherConfig(dim=8, n_layers=1))
    ran = []
    with pytest.raises(SymacctError, match="cannot write the log"):
        with symacct.track("a", tmp_path / "no" / "such" / "dir" / "log.jsonl", model=model):
            ran.append(1)
    assert ran == []
    with pytest.raises(SymacctError, match="cannot write the log"):
        with symacct.track("a", tmp_path, model=model):
            ran.append(1)
    assert ran == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not UTF-8"),
        ('{"header": true, "run": "a", "model": "M"}\n'.encode("utf-16"), "not UTF-8"),
        (b'{"header": true, "run": "a"}\n', "has no 'model'"),
        (b'{"header": true, "run": "a", "model": "M"}\n{"allocated": 1, "peak": 1}\n', "has no 'phase'"),
        (b'{"header": true, "run": "a", "model": "M"}\n{"phase": "p", "peak": 1}\n', "has no 'allocated'"),
        (b'{"header": true, "run": "a", "model": "M"}\n{"phase": "p", "allocated": "1", "peak": 1}\n', "not int"),
        (b'{"header": true, "run": "a", "model": "M", "predicted": {"phases": {}}}\n', "lacks its phases, parts"),
    ],
)
def test_diff_of_bad_logs_is_one_line(tmp_path, content, needle):
    good = tmp_path / "good.jsonl"
    good.write_text('{"header": true, "run": "b", "model": "M"}\n{"phase": "p", "allocated": 1, "peak": 1}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    one_line(cli("diff", str(bad), str(good)), needle)


def test_a_full_stdout_is_one_line():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "symacct.cli", "list"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    one_line(proc, "No space left on device")


def test_derive_from_two_threads_at_once():
    """PyTorch's module tracking is global: derive holds a lock, and both threads get the right answer."""
    model = GPT2(GPT2Config(**SMALL))
    want = symacct.derive(model).flops.total
    results, errors = [], []

    def run() -> None:
        try:
            results.append(symacct.derive(model).flops.total)
        except Exception as e:  # any failure is the test's failure, reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [want] * 4


def test_internal_failures_are_marked_as_such(monkeypatch):
    from symacct.cost.rules import registry

    def broken(call):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(registry, "_BY_OP", {**registry._BY_OP, torch.ops.aten.mm: broken})
    with pytest.raises(SymacctError) as e:
        symacct.derive(Cruncher(CruncherConfig(dim=8, n_layers=1)))
    assert e.value.internal and "ZeroDivisionError: a bug" in str(e.value)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_what_the_loss_function_saves_is_counted(autocast):
    """loss= runs inside the step: its saved tensors (cross-entropy's log-softmax, 4*B*S*V bytes) are
    activations, and it runs under autocast as the forward does. Before, they were left out."""
    import torch.nn.functional as F

    from symacct.measure.run import measure_memory, measure_step

    model = GPT2(GPT2Config(**SMALL))

    def loss(logits: torch.Tensor) -> torch.Tensor:  # (B, S, V) -> scalar, next-token targets all 0
        return F.cross_entropy(logits.flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long))

    acct = symacct.derive(
        model, inputs=lambda m, B, S: (torch.randint(0, SMALL["vocab_size"], (B, S)),), loss=loss, autocast=autocast,
        optimizer="sgd",
    )  # fmt: skip
    for B, S in ((2, 5), (3, 8)):
        torch.manual_seed(0)
        args = (torch.randint(0, SMALL["vocab_size"], (B, S)),)
        at = acct.at(B=B, S=S)
        counted = measure_step(model, args, loss=loss, autocast=autocast)
        assert at.memory.activations == counted.saved_bytes and at.flops.total == counted.flops_total
        model.zero_grad(set_to_none=True)
        real = measure_memory(model, args, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss=loss,
                              autocast=autocast)  # fmt: skip
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)


def test_a_failing_loss_function_is_named():
    model = GPT2(GPT2Config(**SMALL))
    with pytest.raises(SymacctError, match=r"the loss= function failed.*AttributeError.*'loss'") as e:
        symacct.derive(model, inputs=lambda m, B, S: (torch.zeros(B, S, dtype=torch.long),), loss=lambda o: o.loss)
    assert not e.value.internal


class GQA(nn.Module):
    """Grouped-query attention through SDPA's enable_gqa=True (Llama's, Qwen2's and Mistral's default path)."""

    def __init__(self, D: int, H: int, H_kv: int) -> None:
        super().__init__()
        self.H, self.H_kv = H, H_kv
        self.q = nn.Linear(D, D, bias=False)
        self.kv = nn.Linear(D, 2 * D // H * H_kv, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q = self.q(x).view(B, S, self.H, D // self.H).transpose(1, 2)  # (B, H, S, Dh)
        k, v = self.kv(x).view(B, S, 2, self.H_kv, D // self.H).unbind(2)  # 2 x (B, S, H_kv, Dh)
        y = nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                       enable_gqa=True)  # fmt: skip
        return y.sum()  # (B, H, S, Dh) -> scalar


def test_sdpa_with_enable_gqa_is_costed_and_its_head_ratio_kept():
    """The rule crashed on symbolic heads (H < H_kv has no truth value). Now exact: FlopCounterMode counts
    the projections; the CPU flash kernel (which it counts 0) is 4*B*H*S*S*Dh forward, 10*B*H*S*S*Dh backward
    with query heads, one fifth of the backward being the recomputed scores."""
    from symacct.measure.run import measure_step

    acct = symacct.derive(
        GQA, dims={"D": 32, "H": 4, "H_kv": 2}, inputs=lambda m, B, S: (torch.randn(B, S, m.q.in_features),)
    )
    for B, S, D, H, H_kv in ((2, 5, 32, 4, 2), (3, 7, 48, 6, 3)):
        torch.manual_seed(0)
        model = GQA(D, H, H_kv)
        counted = measure_step(model, (torch.randn(B, S, D),))
        one = 2 * B * H * S * S * (D // H)
        at = acct.at(B=B, S=S, D=D, H=H, H_kv=H_kv)
        assert at.flops.forward == counted.flops_forward + 2 * one
        assert at.flops.backward + at.flops.recompute == counted.flops_backward + 5 * one
        assert at.flops.recompute == one and at.memory.activations == counted.saved_bytes
    with pytest.raises(SymacctError, match="H_kv divides H"):
        acct.at(B=1, S=4, D=48, H=4, H_kv=3)


def test_a_forward_that_fails_at_probe_sizes_is_a_refusal_with_the_full_cause():
    """With the key/value heads under a name symacct does not know ('Hkv'), the probe does not keep them a
    divisor of H; SDPA's own check fails above dispatch. derive tries again with Hkv kept at its value; where
    that fails too (H = 4 over Hkv = 3 is no model), the first failure is refused, with PyTorch's whole
    message, not blamed on symacct."""
    with pytest.raises(SymacctError) as e:
        symacct.derive(
            lambda D, H, Hkv: GQA(D, H, Hkv),
            dims={"D": 36, "H": 4, "Hkv": 3},
            inputs=lambda m, B, S: (torch.randn(B, S, m.q.in_features),),
        )
    assert not e.value.internal
    assert "forward failed at probe sizes: RuntimeError: Number of heads in key and value must divide" in str(e.value)


def test_a_size_of_its_own_that_fails_at_probe_sizes_is_kept_at_its_value():
    """The same model with Hkv = 2 dividing H = 4: derived with Hkv kept at 2, the note says why; the
    parameters and the projections' FLOPs against the model's own count and FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    acct = symacct.derive(
        lambda D, H, Hkv: GQA(D, H, Hkv),
        dims={"D": 32, "H": 4, "Hkv": 2},
        inputs=lambda m, B, S: (torch.randn(B, S, m.q.in_features),),
    )
    assert "Hkv kept at 2" in acct.notes and "Number of heads in key and value must divide" in acct.notes[0]
    assert "Hkv" not in acct.symbols
    model = GQA(32, 4, 2)
    with FlopCounterMode(display=False) as fc:  # the projections (the CPU flash kernel counts 0 there)
        model(torch.randn(3, 7, 32))
    at = acct.at(B=3, S=7)
    assert at.params == sum(p.numel() for p in model.parameters())
    assert fc.get_total_flops() == 2 * 3 * 7 * 32 * (32 + 2 * 8 * 2)  # 2 B S D (D + 2 Dh Hkv)
    assert at.flops.forward == fc.get_total_flops() + 4 * 3 * 4 * 7 * 7 * 8  # + the kernel: 4 B H S^2 Dh


@dataclasses.dataclass
class PadConfig:
    n_embd: int = 8
    pad_token_id: int = 0  # an id, not a size
    ignore_index: int = -100


class Padded(nn.Module):
    def __init__(self, config: PadConfig) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.n_embd),)


def test_fixed_fields_of_zero_or_negative_value():
    """fixed= on an id of 0 raised ZeroDivisionError and on -100 hung (factoring the value for the probe)."""
    acct = symacct.derive(Padded(PadConfig()), fixed=["pad_token_id", "ignore_index"])
    assert acct.symbols == {"D": 8} and acct.at(B=2).flops.forward == 2 * 2 * 8 * 8  # 2*B*D*D


class LongError(nn.Module):
    """A constructor that fails with a message of several lines (as transformers' validators do)."""

    def __init__(self, config: PadConfig) -> None:
        super().__init__()
        self.config = config
        if config.n_embd != 8:
            raise ValueError("the width is not supported.\nSupported widths: 8.\nSee the model card.")
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, 8),)


def test_the_cause_is_kept_whole_on_one_line():
    with pytest.raises(SymacctError) as e:
        symacct.derive(LongError(PadConfig()), fixed=["pad_token_id", "ignore_index"])
    msg = str(e.value)
    assert "Supported widths: 8. See the model card." in msg and "\n" not in msg


def test_a_trace_leaves_the_optimizers_type_lists_as_they_were():
    """During a trace a fake tensor counts as a tensor when an optimizer picks foreach or the loop (the device
    then decides: the CPU's loop here, tests/test_cuda_semantics.py for CUDA's foreach); afterwards PyTorch's
    lists are as they were, and a real CPU tensor still gets PyTorch's own CPU default."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer as optim_base
    from torch.utils import _foreach_utils

    before = (list(optim_base._foreach_supported_types), list(_foreach_utils._foreach_supported_types))
    acct = symacct.derive(Cruncher(CruncherConfig(dim=8, n_layers=2)), optimizer="adamw")
    assert (optim_base._foreach_supported_types, _foreach_utils._foreach_supported_types) == before
    assert FakeTensor not in optim_base._foreach_supported_types
    assert optim_base._default_to_fused_or_foreach([torch.ones(2)], differentiable=False) == (False, False)
    assert not any(str(r.op).startswith("aten._foreach_") for r in acct.step.ops)


@dataclasses.dataclass
class LoopConfig:
    vocab: int = 50
    width: int = 16
    n_layers: int = 3  # L: the number of blocks, each an attribute of its own (Attributes); the RNN ignores it


class Unrolled(nn.Module):
    """An RNN unrolled over the sequence in Python: its op count grows with S, not with L."""

    def __init__(self, config: LoopConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)  # (B, S, width)
        h = e[:, 0]  # (B, width)
        for t in range(1, e.shape[1]):
            h = torch.tanh(h + e[:, t])
        return h.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


class Attributes(nn.Module):
    """L blocks kept as attributes block0, block1, ... (no nn.ModuleList): the op count grows with L."""

    def __init__(self, config: LoopConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        for i in range(config.n_layers):
            self.add_module(f"block{i}", nn.Linear(config.width, config.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, S, width)
        for i in range(self.config.n_layers):
            h = h + torch.tanh(getattr(self, f"block{i}")(h))
        return h.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_ops_that_change_with_the_sequence_are_not_blamed_on_the_layer_count():
    """The checking trace has other sizes and one block more; a model with a layer-count field and an op count
    that grows with S was refused as "the number of ops changes with L" (a wrong cause and a wrong hint)."""
    with pytest.raises(SymacctError) as e:
        symacct.derive(Unrolled(LoopConfig()))
    assert "size-dependent control flow" in str(e.value)
    assert "changes with L" not in str(e.value)


def test_blocks_kept_as_attributes_fix_the_layer_count():
    """No list of L blocks: derived with L at its value, exact against a real step; the note names the cause."""
    model = Attributes(LoopConfig())
    acct = symacct.derive(model)
    assert acct.notes[0].startswith("the ops change with L but no nn.ModuleList of L blocks holds them")
    for B, S in ((2, 5), (3, 7)):
        with FlopCounterMode(display=False) as fc:
            model(*model.example_inputs(B, S)).backward()
        model.zero_grad(set_to_none=True)
        assert acct.at(B=B, S=S).flops.total == fc.get_total_flops()


@dataclasses.dataclass
class TableConfig:
    vocab: int = 50
    width: int = 16
    max_len: int = 32  # S_max by its name: the position table's rows


class Table(nn.Module):
    def __init__(self, config: TableConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Parameter(torch.zeros(config.max_len, config.width))  # (S_max, width)
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]  # (B, S, width)
        return self.out(h).logsumexp(-1).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_table_named_max_len_is_the_longest_sequence():
    """``max_len`` was a size of the model's own: probed below S, the step failed on fake tensors and derive
    refused with the op's text. It is S_max now, as block_size and max_seq_len are."""
    model = Table(TableConfig())
    acct = symacct.derive(model)
    assert acct.fields["S_max"] == "max_len"
    for B, S in ((2, 5), (3, 32)):
        with FlopCounterMode(display=False) as fc:
            model(*model.example_inputs(B, S)).backward()
        model.zero_grad(set_to_none=True)
        assert acct.at(B=B, S=S).flops.total == fc.get_total_flops()
    with pytest.raises(SymacctError, match="S_max"):
        acct.at(B=1, S=33)


class AttributesOf(nn.Module):
    """Attributes with a factory's sizes: ``AttributesOf(D, L)``."""

    def __init__(self, D: int, L: int) -> None:
        super().__init__()
        self.n = L
        for i in range(L):
            self.add_module(f"block{i}", nn.Linear(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = torch.tanh(getattr(self, f"block{i}")(x))  # (B, S, D)
        return x.sum()


def test_a_factory_with_blocks_as_attributes_keeps_D_and_fixes_L():
    """A factory's sizes are named by their letters: D was taken for a size of the model's own and kept at its
    value with L (``D = D (8): it follows D``); and the checking trace refused instead of fixing L."""
    inputs = lambda m, B, S: (torch.randn(B, S, m.block0.in_features),)  # noqa: E731
    acct = symacct.derive(AttributesOf, dims={"D": 8, "L": 3}, inputs=inputs)
    assert acct.notes[0].startswith("the ops change with L but no nn.ModuleList of L blocks holds them")
    assert {s.name for s in acct.flops.total.free_symbols} == {"B", "S", "D"}
    for B, S, D in ((2, 5, 8), (3, 4, 12)):
        model = AttributesOf(D, 3)
        with FlopCounterMode(display=False) as fc:
            model(*inputs(model, B, S)).backward()
        assert acct.at(B=B, S=S, D=D).flops.total == fc.get_total_flops()


class WeightNormed(nn.Module):
    """A weight-normed layer (``nn.utils.parametrizations.weight_norm``, as transformers' wav2vec2 positional
    convolution): its fused kernel had no cost rule."""

    def __init__(self, config: LoopConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(config.width, config.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.emb(x))).sum()  # (B, S, width) summed

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_weight_normed_layer_is_costed_by_its_fused_kernel():
    from symacct.cost.graph import records
    from symacct.cost.rules.reductions import FUSED
    from symacct.symbols import sym

    model = WeightNormed(LoopConfig())
    acct = symacct.derive(model)
    width = sym("width")
    kernels = {n.op: n.cost.flops_other for _, n in records(acct.graph) if "_weight_norm_interface" in n.op}
    assert kernels == {  # per element of the (width, width) weight, by the table
        "aten._weight_norm_interface.default": FUSED["_weight_norm_interface"] * width**2,
        "aten._weight_norm_interface_backward.default": FUSED["_weight_norm_interface_backward"] * width**2,
    }
    for B, S in ((2, 5), (3, 7)):
        with FlopCounterMode(display=False) as fc:
            model(*model.example_inputs(B, S)).backward()
        model.zero_grad(set_to_none=True)
        assert acct.at(B=B, S=S).flops.total == fc.get_total_flops()


@dataclasses.dataclass
class InPlaceConfig:
    vocab: int = 50
    width: int = 16
    valid: bool = False  # out of place: h + e


class InPlaceAfterSave(nn.Module):
    """ReLU in place, then its output changed in place: relu's backward needs the output it saved, so PyTorch
    refuses the step in backward."""

    def __init__(self, config: InPlaceConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.lin = nn.Linear(config.width, config.width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)  # (B, S, width)
        h = self.act(self.lin(e))  # (B, S, width), saved by relu's backward
        h = h + e if self.config.valid else h.add_(e)
        return h.pow(2).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_saved_tensor_changed_in_place_is_refused_as_pytorch_refuses_it():
    """Saved-tensor hooks switch off PyTorch's in-place check, and symacct sets them on every step it traces
    or measures: a step that fails in PyTorch was derived (and measured) as if it ran. Now both refuse it, on
    PyTorch's engine and on symacct's Python engine."""
    from symacct.measure.run import measure_step
    from symacct.trace.record import record_step

    model = InPlaceAfterSave(InPlaceConfig())
    x = model.example_inputs(2, 5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(*x).backward()  # PyTorch, no hooks
    with pytest.raises(SymacctError, match="changed in place before backward read it") as e:
        symacct.derive(model)
    assert e.value.module == "act"
    with pytest.raises(SymacctError, match="changed in place"):
        measure_step(model, x)
    with pytest.raises(SymacctError, match="changed in place"):
        record_step(lambda fake: _fake_model(fake), lambda m: m.example_inputs(2, 5), python_engine=True)
    valid = InPlaceAfterSave(InPlaceConfig(valid=True))
    assert symacct.derive(valid).at(B=2, S=5).flops.hardware == measure_step(valid, x).flops_total


def _fake_model(fake: Any) -> nn.Module:
    with fake:
        return InPlaceAfterSave(InPlaceConfig())


@dataclasses.dataclass
class _AttnConfig:
    vocab: int = 50
    width: int = 16  # two heads: the width must be even, so no probe width builds


class _Attn(nn.Module):
    """One ``nn.MultiheadAttention`` of two heads: in inference its fused path runs (refused by design)."""

    def __init__(self, config: _AttnConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.attn = nn.MultiheadAttention(config.width, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, S, W)
        return self.attn(h, h, h)[0].sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_retry_that_stops_elsewhere_says_where():
    """The widths did not build at probe sizes (two heads need an even width); derived again with them kept,
    the step stopped at another refusal, the fused inference path. The error said only the first, whose hint
    (keep the fields fixed) leads to the second: it now says both."""
    with pytest.raises(SymacctError) as e:
        symacct.derive(_Attn(_AttnConfig()), step="forward")
    assert "embed_dim must be divisible by num_heads" in str(e.value)
    assert "the step stopped elsewhere" in str(e.value) and "fused inference path" in str(e.value)


@dataclasses.dataclass
class _TableConfig:
    vocab: int = 64
    width: int = 16
    sparse: bool = False


class _Table(nn.Module):
    """An embedding table and a linear read-out; ``sparse`` makes the table's gradient a sparse COO tensor."""

    def __init__(self, config: _TableConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width, sparse=config.sparse)
        self.out = nn.Linear(config.width, config.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (B, S)
        logits = self.out(self.emb(ids))  # (B, S, vocab)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_sparse_gradient_is_refused_by_its_op():
    """``nn.Embedding(sparse=True)`` makes its weight's gradient a sparse COO tensor, whose bytes depend on how
    many rows the batch touched (values). The recorder asked the tensor for its storage and failed, reported as
    "a defect of symacct"; now the op that makes it is refused with the module and what to do. The dense table
    derives."""
    with pytest.raises(SymacctError) as e:
        symacct.derive(_Table(_TableConfig(sparse=True)), loss=lambda out: out, optimizer="sgd")
    assert "layout torch.sparse_coo" in e.value.what and e.value.module == "emb"
    assert "defect" not in str(e.value) and "sparse=False" in e.value.hint
    dense = symacct.derive(_Table(_TableConfig()), loss=lambda out: out, optimizer="sgd")
    assert dense.at(B=2, S=7).params == 2 * 64 * 16 + 64


def test_a_layer_stack_cut_after_construction_is_refused():
    """Layers pruned from the model (``model.blocks = model.blocks[:2]``) with the config left at 4: the op
    comparison matches block by block, so derive gave the figures of the config's four-layer model at L = 4
    while the model runs two (at B = 2, S = 8 with AdamW: 1,327,104 FLOPs against 688,128 counted, a peak of
    232,660 bytes against 127,092). Refused now; with the config set to the blocks kept, derived and exact."""
    model = GPT2(GPT2Config(**{**SMALL, "n_layer": 4}))
    model.blocks = model.blocks[:2]
    with pytest.raises(SymacctError) as e:
        symacct.derive(model)
    assert "layer stack blocks has 2 blocks where its config's n_layer = 4 builds 4" in e.value.what
    model.config.n_layer = 2
    counted = FlopCounterMode(display=False)
    with counted:
        model(*model.example_inputs(2, 8)).backward()
    assert symacct.derive(model).at(B=2, S=8).flops.hardware == counted.get_total_flops()


@dataclasses.dataclass
class _LazyConfig:
    width: int = 32


class _Lazy(nn.Module):
    """A lazy first layer: its weight's shape comes from the first input."""

    def __init__(self, config: _LazyConfig) -> None:
        super().__init__()
        self.config = config
        self.first = nn.LazyLinear(config.width)
        self.out = nn.Linear(config.width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 16)
        return self.out(torch.relu(self.first(x))).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, 16),)


def test_lazy_modules_are_refused_with_what_to_do():
    """A lazy module's parameters failed inside symacct ("a defect of symacct") before the model had run, and
    the model rebuilt from its config, lazy again, failed to build under the fake mode after. Both are refused
    with the reason now. Without a config the materialised model is copied as it is: derived."""
    model = _Lazy(_LazyConfig())
    with pytest.raises(SymacctError) as e:
        symacct.derive(model)
    assert "parameter first.weight is not initialized yet" in e.value.what and e.value.module == "first"
    model(*model.example_inputs(2, 1))  # materialised: the rebuilt model is lazy again
    with pytest.raises(SymacctError, match="it has lazy modules"):
        symacct.derive(model)
    plain = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 1))
    plain(torch.randn(2, 16))
    acct = symacct.derive(plain, inputs=lambda B, S: (torch.randn(B, 16),), loss=lambda out: out.sum())
    assert acct.at(B=4, S=1).params == 16 * 32 + 32 + 32 + 1


@dataclasses.dataclass
class _MisfitConfig:
    width: int = 16


class _Misfit(nn.Module):
    """Its inputs are one feature wider than its layer takes: it fails at every size, its own included."""

    def __init__(self, config: _MisfitConfig) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, width + 1)
        return self.lin(x).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.width + 1),)


def test_a_model_that_fails_at_its_own_sizes_is_told_so():
    """A step that fails at probe sizes was refused as a probe-size failure, with a hint about size relations,
    also where the model cannot run at any size (DeepSeek-V3 given fewer key/value heads than heads: its latent
    attention repeats keys it has one a head). The model is now run at its own sizes before that refusal."""
    from symacct.pipeline import OWN_SIZES_FAIL

    model = _Misfit(_MisfitConfig())
    with pytest.raises(RuntimeError):
        model(*model.example_inputs(2, 1))
    with pytest.raises(SymacctError) as e:
        symacct.derive(model)
    assert e.value.what == (
        f"{OWN_SIZES_FAIL} (B=2, S=8): RuntimeError: a and b must have same reduction dim, but got [2, 17] X [16, 16]."
    )
    assert "probe sizes" not in e.value.what and e.value.module == "lin"


class _TwoPaths(nn.Module):
    """An embedding and two Linears: a, always, and b on one path only (the subclass's forward says which)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.a = nn.Linear(config.width, config.width)
        self.b = nn.Linear(config.width, config.width)

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


class _ByParity(_TwoPaths):
    """One more layer at an even length: a branch on S's parity, which no product of symbols expresses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.a(self.emb(x))  # (B, S, width)
        if x.shape[1] % 2 == 0:
            h = self.b(h)  # (B, S, width): the even path only
        return h.sum()


@dataclasses.dataclass
class LengthConfig:
    vocab: int = 50
    width: int = 16
    n_positions: int | None = 2048  # S_max: the position table's rows (None: no table, any length runs)
    clip: bool = False  # min(S, 1000) in place of the branch


class _ByLength(_TwoPaths):
    """One more Linear past 1,000 positions: a branch on S's value beyond both probes' lengths."""

    def __init__(self, config: LengthConfig) -> None:
        super().__init__(config)
        self.pos = nn.Embedding(config.n_positions, config.width) if config.n_positions else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.emb(x)  # (B, S, width)
        if self.pos is not None:
            h = h + self.pos(torch.arange(x.shape[1]))  # (B, S, width)
        h = self.a(h)
        if self.config.clip:  # the same ops at every length, other shapes past 1,000 positions
            return h.sum() + h.new_ones(x.shape[0], min(x.shape[1], 1000)).sum()  # (B, min(S, 1000))
        if x.shape[1] > 1000:
            h = self.b(h)  # (B, S, width): past 1,000 positions only
        return h.sum()


def _forward_matmul_flops(model: nn.Module, B: int, S: int) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(*model.example_inputs(B, S))
    return fc.get_total_flops()


@pytest.mark.parametrize("table", [2048, None])
def test_a_branch_on_a_length_past_the_probes_is_refused(table):
    """Both probes run a few hundred positions at most, so a step that takes another path past 1,000 was
    derived on the short side, and every longer size users run got the short path's figures (at S = 1,500
    here: half the forward matmul FLOPs). The user's own model is now traced as long as it runs (below its
    position table, else 8,191 positions) and compared with the probe's ops: the model is refused, naming
    the lengths. With a table that ends below the threshold it derives, exact there."""
    model = _ByLength(LengthConfig(n_positions=table))
    assert _forward_matmul_flops(model, 2, 1001) == 2 * _forward_matmul_flops(model, 2, 1000) * 1001 // 1000
    with pytest.raises(SymacctError) as e:
        symacct.derive(model)
    longest = 2047 if table else 8191
    assert f"takes another path at S = {longest}" in e.value.what and "branches on a length's value" in e.value.what
    assert e.value.module == "b" and "position table" in e.value.hint
    short = _ByLength(LengthConfig(n_positions=1000))  # lengths up to 999: the short side only
    acct = symacct.derive(short, step="forward")
    assert acct.at(B=2, S=999).flops.forward == _forward_matmul_flops(short, 2, 999)


def test_a_size_that_stops_growing_past_the_probes_is_refused():
    """``min(S, 1000)``: the same ops at every length, and a tensor that stops growing at 1,000 positions. The
    probes' lengths never reach it, so its formula read S there; the user's model traced at 2,047 positions
    returns another shape than that formula gives, where at the probe's own length it returns the same:
    refused as a branch on a length, naming the op."""
    with pytest.raises(SymacctError) as e:
        symacct.derive(_ByLength(LengthConfig(clip=True)), step="forward")
    assert "takes another path at S = 2047" in e.value.what and "returns" in e.value.what
    assert e.value.op == "aten.new_ones.default"


@pytest.mark.parametrize("configless", [False, True])
def test_a_branch_on_a_lengths_parity_is_refused(configless):
    """Both probes' lengths were odd primes: a step that takes another path at an even length (here one more
    Linear) was derived on the odd side, and the even sizes users run got the odd path's figures (at B = 2,
    S = 6: forward matmul FLOPs 6,144 derived where the step runs 12,288). The second probe's lengths are even
    now, and the check refuses the model."""
    model = _ByParity(LoopConfig())
    counts = []
    for S in (5, 6):  # the model's own two paths, counted on a real step
        with FlopCounterMode(display=False) as fc:
            model(*model.example_inputs(2, S))
        counts.append(fc.get_total_flops() / S)
    assert counts[1] == 2 * counts[0]
    with pytest.raises(SymacctError) as e:
        if configless:
            symacct.derive(
                lambda width: _ByParity(LoopConfig(width=width)),
                dims={"width": 16},
                inputs=lambda m, B, S: m.example_inputs(B, S),
            )
        else:
            symacct.derive(model)
    assert "does not predict a second trace" in e.value.what and "parity" in e.value.hint


@dataclasses.dataclass
class ShortConfig:
    vocab: int = 50
    width: int = 16
    at: int = 32  # the threshold: below both probes' lengths (the second runs about 74 positions)
    how: str = "branch"  # "branch": one more Linear up to `at`; "pad": max(S, at) wide; "top": the `at` largest


class _ByShortLength(_TwoPaths):
    """Another path at short lengths, below both probes' (see ``ShortConfig.how``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.a(self.emb(x))  # (B, S, width)
        if self.config.how == "top":  # (B, at, width): the `at` largest along S, which needs `at` positions
            return h.topk(self.config.at, dim=1).values.sum()
        if self.config.how == "pad":  # the same ops at every length, a tensor max(S, at) wide
            return h.sum() + h.new_ones(x.shape[0], max(x.shape[1], self.config.at)).sum()  # (B, max(S, at))
        if x.shape[1] <= self.config.at:
            h = self.b(h)  # (B, S, width): up to `at` positions only
        return h.sum()


def _bounded(make: Any, holds: tuple[int, int], other: tuple[int, int], breaks: str, at: str, bound: str) -> Any:
    """Derive ``make()``'s forward twice (the second from the family memo); each time exact against
    FlopCounterMode at ``holds`` (B, S), refused at ``other`` as another path (``breaks``, naming the op in b),
    and noted (another path ``at``, the figures holding for ``bound``). The second accounting."""
    for _ in range(2):
        acct = symacct.derive(make(), step="forward")
        assert acct.at(B=holds[0], S=holds[1]).flops.forward == _forward_matmul_flops(make(), *holds)
        with pytest.raises(SymacctError) as e:
            acct.at(B=other[0], S=other[1])
        assert breaks in e.value.what and "takes another path there" in e.value.what
        assert "aten.addmm.default in b" in e.value.what
        assert any(f"takes another path at {at}" in n and bound in n for n in acct.notes)
    return acct


def test_a_branch_on_a_length_below_the_probes_bounds_the_formulas():
    """Both probes run dozens of positions at least, and pass 4 traced the user's model at its longest: a step
    that takes another path at short lengths (here one more Linear up to 32 positions) was derived on the long
    side, and at S = 32 and below the figures were the long path's (half the forward matmul FLOPs). The user's
    model is now traced at S = 2 too; where it runs other ops there, the least length from which it runs the
    probe's is found, and ``at`` refuses shorter ones as another path, named in a note. The family memo keeps it."""
    model = _ByShortLength(ShortConfig())
    assert _forward_matmul_flops(model, 2, 32) == 2 * _forward_matmul_flops(model, 2, 33) * 32 // 33  # two paths
    _bounded(lambda: _ByShortLength(ShortConfig()), (2, 33), (2, 32), "S=32 breaks 33 <= S", "S = 32", "S >= 33")
    plain = symacct.derive(_ByLength(LengthConfig(n_positions=1000)), step="forward")  # one path up to 999
    assert not any("at() refuses shorter lengths" in n for n in plain.notes)
    assert plain.at(B=2, S=2).flops.forward == _forward_matmul_flops(_ByLength(LengthConfig()), 2, 2)


def test_a_size_that_stops_shrinking_below_the_probes_bounds_the_formulas():
    """``max(S, 32)``: the same ops at every length, a tensor that stops shrinking at 32 positions; its formula
    read S, wrong below 32. Bounded from 32 by the shapes the user's model returns at shorter lengths."""
    acct = symacct.derive(_ByShortLength(ShortConfig(how="pad")), step="forward")
    with pytest.raises(SymacctError) as e:
        acct.at(B=2, S=31)
    assert "S=31 breaks 32 <= S" in e.value.what and "aten.new_ones.default" in e.value.what
    assert acct.at(B=2, S=32).memory.params > 0


def test_a_length_the_model_cannot_run_below_the_probes_is_refused_as_such():
    """The 5 largest values along the sequence (``topk``) need 5 positions: ``at`` refused nothing below the
    probes' lengths and gave figures for lengths the model fails at. Now bounded from 5, as sizes the model
    cannot run (a real step at 4 fails too), naming the op."""
    model = _ByShortLength(ShortConfig(at=5, how="top"))
    with pytest.raises(RuntimeError):
        model(*model.example_inputs(2, 4))
    acct = symacct.derive(model, step="forward")
    with pytest.raises(SymacctError) as e:
        acct.at(B=2, S=4)
    assert "cannot run these sizes: S=4 breaks 5 <= S" in e.value.what and "aten.topk.default" in e.value.what
    assert acct.at(B=2, S=5).flops.forward == _forward_matmul_flops(model, 2, 5)


@dataclasses.dataclass
class CacheConfig:
    vocab: int = 50
    width: int = 16
    at: int = 32  # the threshold on the cached positions C


class _ByShortCache(nn.Module):
    """A decode step with one more Linear while the cache holds up to ``at`` positions."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.a = nn.Linear(config.width, config.width)
        self.b = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:  # x (B, S) ids, cache (B, C, width)
        h = self.a(self.emb(x))  # (B, S, width)
        kv = torch.cat([cache, h], 1)  # (B, C + S, width)
        if cache.shape[1] <= self.config.at:
            kv = self.b(kv)  # (B, C + S, width): up to `at` cached positions only
        return (h @ kv.transpose(1, 2)).sum()  # (B, S, C + S) scores

    def decode_inputs(self, B: int, S: int, C: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randint(0, self.config.vocab, (B, S)), "cache": torch.zeros(B, C, self.config.width)}


def test_a_decode_step_that_branches_on_a_short_cache_is_bounded_in_c():
    """The same for the cached positions of a decode step: the user's model is traced at C = 2, and the figures
    hold from the least C that runs the probe's ops (33 here), exact there against a real step."""
    model = _ByShortCache(CacheConfig())

    def flops(C: int) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(**model.decode_inputs(2, 1, C))
        return fc.get_total_flops()

    acct = symacct.derive(model, step="decode")
    f33, f34 = (acct.at(B=2, C=C).flops.forward for C in (33, 34))
    assert (f33, f34) == (flops(33), flops(34))
    assert flops(32) > 2 * f33 - f34  # the formula (linear in C) read at 32: short of the short cache's path
    with pytest.raises(SymacctError) as e:
        acct.at(B=2, C=32)
    assert "C=32 breaks 33 <= C" in e.value.what and "aten.addmm.default in b" in e.value.what


def test_a_decode_step_that_branches_on_a_cache_of_one_is_bounded_from_two():
    """A cache of one position, C = 1, as S = 1: compared in the ops the probe's FLOPs count, and bounded."""
    model = _ByShortCache(CacheConfig(at=1))
    acct = symacct.derive(model, step="decode")
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(**model.decode_inputs(2, 1, 2))
    assert acct.at(B=2, C=2).flops.forward == fc.get_total_flops()
    with pytest.raises(SymacctError) as e:
        acct.at(B=2, C=1)
    assert "C=1 breaks 2 <= C" in e.value.what and "aten.addmm.default in b" in e.value.what


class _PlainByLength(nn.Module):
    """A module without config (only B and S are symbols) with one more Linear up to 32 positions (``short``) or
    past 1,000."""

    def __init__(self, short: bool) -> None:
        super().__init__()
        self.short = short
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, 16)
        h = self.a(x)  # (B, S, 16)
        if (x.shape[1] <= 32) if self.short else (x.shape[1] > 1000):
            h = self.b(h)  # (B, S, 16)
        return h.sum()


def test_a_module_without_config_is_traced_at_its_longest_and_shortest_lengths():
    """A module without config was traced at the probes' lengths only (pass 4 compared nothing: the probe model
    is the module itself), so a branch on S past or below them was derived on one side, silently. Its own
    trace at 8,191 and at 2 positions now refuses the first and bounds the second."""
    inputs = lambda m, B, S: (torch.randn(B, S, 16),)  # noqa: E731
    with pytest.raises(SymacctError) as e:
        symacct.derive(_PlainByLength(short=False), inputs=inputs, step="forward")
    assert "takes another path at S = 8191" in e.value.what and "give the model a config" in e.value.hint
    model = _PlainByLength(short=True)
    acct = symacct.derive(model, inputs=inputs, step="forward")
    with pytest.raises(SymacctError, match="S=32 breaks 33 <= S"):
        acct.at(B=2, S=32)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(*inputs(model, 2, 33))
    assert acct.at(B=2, S=33).flops.forward == fc.get_total_flops()


def test_fit_searches_from_the_least_length_the_formulas_hold_at():
    """``fit`` searched S from 1, through lengths below the bound where the model takes another path: at B = 20
    million it answered S = 24 from the long path's formulas. It starts at the bound now: the answer is above
    it, or nothing fits there, which says so."""
    from symacct.time.model import fit, least

    acct = symacct.derive(_ByShortLength(ShortConfig()), step="forward")
    assert least(acct, "S") == 33 and least(acct, "B") == 1
    got = fit(acct, "S", hardware="h100", B=8_000_000)
    assert got.value > 33 and acct.peak_every_step(B=8_000_000, S=got.value) <= got.budget_bytes
    with pytest.raises(SymacctError, match="S=33 is the least value the formulas hold at"):
        fit(acct, "S", hardware="h100", B=20_000_000)


@dataclasses.dataclass
class BatchConfig:
    vocab: int = 50
    width: int = 16
    at: int = 8  # the threshold: below both probes' batch sizes (the second runs B = 53)
    how: str = "batch"  # one more Linear where "batch": B <= at; "tokens": B * S <= at; "one": B == 1; "S1": S == 1


class _ByBatch(_TwoPaths):
    """Another path at small batches, or few tokens in a step, below both probes' (see ``BatchConfig.how``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.a(self.emb(x))  # (B, S, width)
        B, S = x.shape
        small = {"batch": B <= self.config.at, "tokens": B * S <= self.config.at, "one": B == 1, "S1": S == 1}[
            self.config.how
        ]
        if small:
            h = self.b(h)  # (B, S, width): on the small side only
        return h.sum()


def test_a_branch_on_a_batch_size_below_the_probes_bounds_the_formulas():
    """The probes run B = 233 and 53, pass 4 the probe's B: a step that takes another path at small batches
    (one more Linear up to B = 8) was derived on the large side, and at B = 8 and below the figures were the
    large path's (half the forward matmul FLOPs: 20,480 derived at B = 8, S = 5, where a real step counts 40,960).
    The user's model is now traced at B = 2 too; where it runs other ops there, the least batch from which it
    runs the probe's is found, and ``at`` refuses smaller ones as another path. The family memo keeps it."""
    model = _ByBatch(BatchConfig())
    assert _forward_matmul_flops(model, 8, 5) == 2 * _forward_matmul_flops(model, 9, 5) * 8 // 9  # two paths
    acct = _bounded(lambda: _ByBatch(BatchConfig()), (9, 5), (8, 5), "B=8 breaks 9 <= B", "B = 8", "B >= 9")
    assert not any("refuses shorter lengths" in n for n in acct.notes)  # no bound on S: S = 2 runs at B = 9
    from symacct.time.model import least

    assert least(acct, "B") == 9 and least(acct, "S") == 1  # where fit's search starts


def test_a_branch_on_the_tokens_in_a_step_bounds_the_length_at_the_least_batch():
    """``if B * S <= 64``, a chunked path on a step's token count: below both probes' tokens. Bounded where the
    product says: the length from the least batch, B = 2 (S >= 33), and B = 1, where 33 positions are too
    few tokens (a real step at B = 1, S = 33 takes the small path); each exact on its side. The old tree gave
    the large path's figures on the small side: 32,768 forward matmul FLOPs at B = 2, S = 32 where a real step
    counts 65,536."""
    model = _ByBatch(BatchConfig(at=64, how="tokens"))
    acct = symacct.derive(model, step="forward")
    assert acct.at(B=2, S=33).flops.forward == _forward_matmul_flops(model, 2, 33)
    assert acct.at(B=5, S=40).flops.forward == _forward_matmul_flops(model, 5, 40)
    with pytest.raises(SymacctError, match="S=32 breaks 33 <= S"):
        acct.at(B=2, S=32)
    assert _forward_matmul_flops(model, 1, 33) == _forward_matmul_flops(model, 2, 33)  # half the tokens, two Linears
    with pytest.raises(SymacctError, match="B=1 breaks 2 <= B"):
        acct.at(B=1, S=33)
    assert any("takes another path at S = 32, B = 2" in n for n in acct.notes)


def test_a_branch_at_batch_one_bounds_the_formulas_from_two():
    """``if B == 1``: at a size of 1 PyTorch views what it otherwise copies and skips a reduction over the size
    of 1, so bytes and the pointwise FLOPs are a convention there, and the matmuls' FLOPs were said not to
    change; this model runs one more Linear at B = 1, and at(B=1, S=7) gave half the forward matmul FLOPs of
    a real step (3,584 against 7,168). The user's model is now traced at B = 1 and compared in the ops the
    probe's FLOPs count (and any op of its own that is no view or copy): another op there bounds B from 2.
    The reference models run the probe's matmuls at B = 1 (test_passes: no bound), so at(B=1) stays open."""
    model = _ByBatch(BatchConfig(how="one"))
    acct = symacct.derive(model, step="forward")
    assert acct.at(B=2, S=7).flops.forward == _forward_matmul_flops(model, 2, 7)
    assert _forward_matmul_flops(model, 1, 7) == _forward_matmul_flops(model, 2, 7)  # two Linears at B = 1
    with pytest.raises(SymacctError) as e:
        acct.at(B=1, S=7)
    assert "B=1 breaks 2 <= B" in e.value.what and "aten.addmm.default in b" in e.value.what
    assert any("at B = 1, in the ops its FLOPs count" in n for n in acct.notes)
    gpt2 = symacct.derive(GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, block_size=64)))
    assert not any("in the ops its FLOPs count" in n for n in gpt2.notes)
    assert any("B = 1: byte figures" in n for n in gpt2.at(B=1, S=8).notes)  # given, with the bytes' convention


def test_a_branch_at_a_length_of_one_bounds_the_formulas_from_two():
    """``if S == 1``: as at B = 1, the matmuls' FLOPs were said not to change at a size of 1, and pass 4 compared
    them at B = 1 only: this model runs one more Linear at S = 1, and at(B=7, S=1) gave half the forward
    matmul FLOPs of a real step (3,584 against 7,168). The user's model is now traced at S = 1 too (at B = 2)
    and compared as at B = 1: another op there bounds S from 2. B = 1 stays open."""
    model = _ByBatch(BatchConfig(how="S1"))
    assert _forward_matmul_flops(model, 7, 1) == _forward_matmul_flops(model, 7, 2)  # two Linears at S = 1
    acct = _bounded(lambda: _ByBatch(BatchConfig(how="S1")), (7, 2), (7, 1), "S=1 breaks 2 <= S", "S = 1", "S >= 2")
    assert acct.at(B=1, S=2).flops.forward == _forward_matmul_flops(model, 1, 2)
    assert any("at S = 1, in the ops its FLOPs count" in n for n in acct.notes)
    gpt2 = symacct.derive(GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, block_size=64)))
    assert not any("in the ops its FLOPs count" in n for n in gpt2.notes)
    assert any("S = 1: byte figures" in n for n in gpt2.at(B=2, S=1).notes)  # given, with the bytes' convention


class _EinsumAttention(_TwoPaths):
    """One attention head written with einsum, as research code often is: queries a, keys b, values the
    embedding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.emb(x)  # (B, S, width)
        scores = torch.einsum("bsd,btd->bst", self.a(h), self.b(h)).softmax(-1)  # (B, S, S)
        return torch.einsum("bst,btd->bsd", scores, h).sum()  # (B, S, width)


def test_einsum_attention_at_one_position_is_refused_where_it_runs_no_matmul():
    """PyTorch's einsum multiplies and sums instead of calling bmm where the sizes it keeps and contracts are 1:
    at S = 1 a real step of this attention runs one bmm where it runs two at S = 2, and at(B=3, S=1) gave
    3,264 forward matmul FLOPs where FlopCounterMode counts 3,168. Now bounded from S = 2, exact there."""
    model = _EinsumAttention(BatchConfig())
    acct = symacct.derive(model, step="forward")
    assert acct.at(B=3, S=2).flops.forward == _forward_matmul_flops(model, 3, 2)
    sizes = {**acct.symbols, "B": 3, "S": 1}
    old = acct.flops.forward.subs({x: sizes[x.name] for x in acct.flops.forward.free_symbols})
    assert (old, _forward_matmul_flops(model, 3, 1)) == (3264, 3168)  # the formula read at S = 1: wrong
    with pytest.raises(SymacctError, match="S=1 breaks 2 <= S"):
        acct.at(B=3, S=1)


@dataclasses.dataclass
class LargeConfig:
    vocab: int = 32
    width: int = 16
    at: int = 256  # the threshold: above both probes' batch sizes (the first runs B = 233)
    how: str = "batch"  # "batch": one more Linear where B > at; "tokens": where B * S > at; "pad": max(B, at) rows
    n_positions: int | None = None  # S_max (a table the model does not read: it bounds the lengths pass 4 runs)


class _ByLargeBatch(_TwoPaths):
    """Another path at large batches, or many tokens in a step, above both probes' (``LargeConfig.how``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.a(self.emb(x))  # (B, S, width)
        B, S = x.shape
        if self.config.how == "pad":  # the same ops at every batch size, a tensor max(B, at) rows high
            return h.sum() + h.new_ones(max(B, self.config.at), S).sum()  # (max(B, at), S)
        if (B if self.config.how == "batch" else B * S) > self.config.at:
            h = self.b(h)  # (B, S, width): on the large side only
        return h.sum()


def _meta_forward_flops(model: nn.Module, B: int, S: int) -> int:
    """FlopCounterMode's count of the forward on meta tensors (sizes too large to allocate)."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        twin(torch.zeros(B, S, dtype=torch.long, device="meta"))
    return fc.get_total_flops()


def test_a_branch_on_a_batch_size_above_the_probes_bounds_the_formulas():
    """The probes run B = 233 and 53 and pass 4 ran the user's model at the probe's B: a step that takes
    another path at large batches (one more Linear past B = 256: a batch chunked or sent to another kernel
    past a size) was derived on the small side, and every larger batch got the small path's figures (at
    B = 300, S = 5: 768,000 forward matmul FLOPs derived where a real step counts 1,536,000). Pass 4's longest
    trace now runs B = 8,191 too; where it runs other ops there, the largest batch that runs the probe's is
    found, ``at`` refuses larger ones, and ``fit`` stops there with a note. The family memo keeps it."""
    model = _ByLargeBatch(LargeConfig())
    assert _forward_matmul_flops(model, 257, 5) == 2 * _forward_matmul_flops(model, 256, 5) * 257 // 256
    acct = _bounded(
        lambda: _ByLargeBatch(LargeConfig()), (256, 5), (257, 5), "B=257 breaks B <= 256", "B = 257", "B <= 256"
    )
    assert any("up to B = 256 it runs the probe's ops" in n and "refuses larger batches" in n for n in acct.notes)
    from symacct.time.model import fit, least, most

    assert (least(acct, "B"), most(acct, "B"), most(acct, "S")) == (1, 256, None)
    got = fit(acct, "B", hardware="H100-SXM", S=5)  # a few KiB a sequence: B = 256 fits, 257 is not derived
    assert got.value == 256 and got.next_peak_bytes is None
    assert any("B=256 is the largest value the formulas hold at" in n for n in got.notes)
    small = fit(acct, "S", hardware="H100-SXM", B=256)  # no bound on S: the search as before
    assert small.next_peak_bytes is not None and small.next_peak_bytes > small.budget_bytes >= small.peak_bytes
    from symacct.parallel.layout import make_layout
    from symacct.parallel.plan import fit_layout

    trained = symacct.derive(_ByLargeBatch(LargeConfig()), optimizer="adamw")  # a training step, two ranks
    ranks = fit_layout(trained, make_layout(dp=2), hardware="H100-SXM", seq=5)
    assert (ranks.micro_batch, ranks.next_peak, ranks.global_batch) == (256, None, 512)
    assert any("B=256 is the largest value the formulas hold at" in n for n in ranks.notes)


def test_a_shape_that_stops_at_a_batch_size_above_the_probes_bounds_the_formulas():
    """``max(B, 256)`` rows: the same ops at every batch size, and a tensor whose height both probes' batches
    (233, 53) read as the constant 256. The user's trace at B = 8,191 returns another shape there (pass 4's
    shape check, after the readings are confirmed), its trace at the probe's B the same: B is bounded at 256,
    the largest batch whose shapes the formulas give, and the new_ones op is named."""
    model = _ByLargeBatch(LargeConfig(how="pad"))
    acct = symacct.derive(model, step="forward")
    assert acct.at(B=256, S=5).flops.forward == _forward_matmul_flops(model, 256, 5)
    with pytest.raises(SymacctError) as e:
        acct.at(B=257, S=5)
    assert "B=257 breaks B <= 256" in e.value.what and "aten.new_ones.default" in e.value.what


def test_a_branch_on_many_tokens_in_a_step_bounds_the_batch_at_the_longest_lengths():
    """``if B * S > 4,000,000``: at the probe's lengths (a few hundred positions) even B = 8,191 is too few
    tokens, at the longest the model runs (999, below its table) it is not. The largest batch is then read
    there (B * 999 <= 4,000,000: B <= 4,004) and bounds every length, which is conservative for shorter ones
    and never wrong; the note says at which length it was read. Exact at the bound, against FlopCounterMode on
    meta tensors."""
    make = lambda: _ByLargeBatch(LargeConfig(at=4_000_000, how="tokens", n_positions=1000))  # noqa: E731
    acct = symacct.derive(make(), step="forward")
    assert acct.at(B=4004, S=999).flops.forward == _meta_forward_flops(make(), 4004, 999)
    assert _meta_forward_flops(make(), 4005, 999) == 2 * _meta_forward_flops(make(), 4004, 999) * 4005 // 4004
    with pytest.raises(SymacctError, match="B=4005 breaks B <= 4004"):
        acct.at(B=4005, S=999)
    assert any("at B = 4005 (at S = 999" in n and "B <= 4004" in n for n in acct.notes)


class _IndexedBlock(nn.Module):
    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.a, self.index = nn.Linear(width, width), index

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h (B, S, width)
        h = self.a(h)
        return h * 2 if self.index == 2 and h.shape[0] > 256 else h  # block 2, on the large side only


class _MiddleBranch(nn.Module):
    """Blocks built alike, whose third alone takes another path past B = 256 (its index read in the forward)."""

    def __init__(self, config: StackConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(_IndexedBlock(config.width, i) for i in range(config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.emb(x)  # (B, S, width)
        for block in self.blocks:
            h = block(h)  # (B, S, width)
        return h.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_branch_above_the_probes_batch_in_a_middle_block_only_is_refused():
    """The largest batch is bisected on a stack's first and last blocks (the middle ones built alike), as the
    least is: a branch that block 2 alone takes is seen at B = 8,191 (pass 4 keeps blocks 0, 1, 2 and the
    last there) but not between, so no bound can be read and the model is refused, naming the block."""
    with pytest.raises(SymacctError) as e:
        symacct.derive(_MiddleBranch(StackConfig()), step="forward")
    assert "takes another path at B = 8191 than at the probe's B = 233, in a block of its layer stack" in e.value.what
    assert e.value.module == "blocks.2" and e.value.op == "aten.mul.Tensor" and "every block" in e.value.hint


def test_a_step_that_loops_over_the_batch_is_not_traced_at_the_largest_batch(monkeypatch):
    """A step that runs an op once a sequence of the batch (its op count read in B: ``stack``'s backward
    selects each of B pieces) would run 8,191 of those ops at the largest batch: pass 4 keeps the probe's B
    there, and the model derives without a bound. A step without them is traced at B = 8,191 once (pass 4's
    longest trace)."""
    import symacct.pipeline as pipeline

    batches: list[int] = []
    real = pipeline._trace

    def traced(src: Any, probe: Any, build: Any, B: int, *args: Any, **kw: Any) -> Any:
        batches.append(B)
        return real(src, probe, build, B, *args, **kw)

    monkeypatch.setattr(pipeline, "_trace", traced)
    memo.clear()

    class PerSample(_TwoPaths):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
            h = self.a(self.emb(x))  # (B, S, width)
            return torch.stack(h.unbind(0)).sum()  # the B pieces go to one op; its backward selects each

    looped = symacct.derive(PerSample(LargeConfig()))
    assert pipeline.LARGEST_BATCH not in batches and not any("refuses larger batches" in n for n in looped.notes)
    batches.clear()
    symacct.derive(_ByLargeBatch(LargeConfig(at=10**9)), step="forward")
    assert batches.count(pipeline.LARGEST_BATCH) == 1


@dataclasses.dataclass
class StackConfig:
    vocab: int = 50
    width: int = 16
    n_layer: int = 6  # past the four blocks pass 4 keeps at the longest lengths, the two at the shortest


class _ShortBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h (B, S, width)
        h = self.a(h)
        return self.b(h) if h.shape[1] <= 32 else h  # (B, S, width): one more Linear up to 32 positions


class _StackByShortLength(nn.Module):
    """A layer stack whose blocks take another path up to 32 positions."""

    def __init__(self, config: StackConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(_ShortBlock(config.width) for _ in range(config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S) token ids
        h = self.emb(x)  # (B, S, width)
        for block in self.blocks:
            h = block(h)
        return h.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab, (B, S)),)


def test_a_stack_whose_blocks_branch_on_a_short_length_is_bounded():
    """Blocks that take another path up to 32 positions, in a stack of 6: the trace at the shortest lengths keeps
    its first block and its last, where the branch shows; bounded from 33, exact there in L and S."""
    model = _StackByShortLength(StackConfig())
    acct = symacct.derive(model, step="forward")
    with pytest.raises(SymacctError, match="S=32 breaks 33 <= S"):
        acct.at(B=2, S=32)
    assert acct.at(B=2, S=33).flops.forward == _forward_matmul_flops(model, 2, 33)
    deeper = _StackByShortLength(StackConfig(n_layer=9))
    assert acct.at(B=2, S=40, L=9).flops.forward == _forward_matmul_flops(deeper, 2, 40)


def test_a_factorys_model_is_traced_at_its_longest_and_shortest_lengths():
    """A factory's model (``dims=``) was not traced at the given sizes at all: a branch on S past or below the
    probes' lengths was derived on one side, silently. It is built at those sizes (meta tensors) and traced
    as long and as short as it runs: refused past, bounded below; with a position table in dims that ends
    below the threshold (the hint's way) the long side is out of reach and it derives."""
    inputs = lambda m, B, S: m.example_inputs(B, S)  # noqa: E731

    def by_length(width: int, n_positions: int | None = None) -> _ByLength:
        return _ByLength(LengthConfig(width=width, n_positions=n_positions))

    with pytest.raises(SymacctError) as e:
        symacct.derive(by_length, dims={"width": 16}, inputs=inputs, step="forward")
    assert "takes another path at S = 8191" in e.value.what and "give the factory" in e.value.hint
    short = symacct.derive(by_length, dims={"width": 16, "n_positions": 1000}, inputs=inputs, step="forward")
    assert short.at(B=2, S=999).flops.forward == _forward_matmul_flops(by_length(16, 1000), 2, 999)

    def stack(width: int, n_layer: int) -> _StackByShortLength:
        return _StackByShortLength(StackConfig(width=width, n_layer=n_layer))

    acct = symacct.derive(stack, dims={"width": 16, "n_layer": 6}, inputs=inputs, step="forward")
    with pytest.raises(SymacctError, match="S=32 breaks 33 <= S"):
        acct.at(B=2, S=32)
    assert acct.at(B=2, S=33).flops.forward == _forward_matmul_flops(stack(16, 6), 2, 33)


def test_a_factory_that_fails_at_the_sizes_given_is_refused():
    """The probes build a factory at their own sizes: one that cannot build its model at the sizes given was
    derived all the same, for a model that does not exist. Pass 4 builds it there now, and says why not."""

    def linear(D: int) -> nn.Module:
        if D == 16:
            raise ValueError("no layer of 16")
        return nn.Linear(D, D)

    with pytest.raises(SymacctError, match=r"the factory fails at the sizes given \(D=16\): ValueError: no layer"):
        symacct.derive(
            linear, dims={"D": 16}, inputs=lambda m, B, S: (torch.randn(B, m.in_features),), loss=lambda o: o.sum()
        )
