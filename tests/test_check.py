"""Every claim of the rules-of-thumb catalog: its verdict recomputed from an independent count.

The independent side: FlopCounterMode on the real model (on the meta device
for full-size configs, nothing is allocated), real tensors' bytes after a
real optimizer step, saved_tensors_hooks, numpy and bit-level probes of the
number formats, and plain arithmetic of the seeds' figures. Each test applies
``check.judge`` (the documented rule) to its own numbers and must reach the
catalog's verdict.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from symacct.measure.run import measure_step
from symacct.models import GPT2, Cruncher, CruncherConfig, GPT2Config, Llama, LlamaConfig
from symacct.recipes import MixedPrecisionAdamW
from symacct.report import check
from symacct.report.check import ASSUMING, HOLDS, LOOSE, WRONG, judge, rel


@pytest.fixture(scope="module")
def claims() -> dict[str, check.Claim]:
    return {c.id: c for c in check.catalog()}


def _n(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights once (parameters() deduplicates)


def _meta_flops(model_fn, B: int, S: int) -> tuple[int, int, dict]:
    """Forward and backward matmul FLOPs of a full-size model on the meta device."""
    with torch.device("meta"):
        model = model_fn()
        args = model.example_inputs(B, S)
    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd:
        loss = model(*args)
    with bwd:
        loss.backward()
    counts = {str(k): v for k, v in fwd.get_flop_counts()["Global"].items()}
    for k, v in bwd.get_flop_counts()["Global"].items():
        counts[str(k)] = counts.get(str(k), 0) + v
    return fwd.get_total_flops(), bwd.get_total_flops(), counts


def test_six_nd(claims):
    fw, bw, counts = _meta_flops(lambda: GPT2(GPT2Config()), 8, 1024)
    with torch.device("meta"):
        n = _n(GPT2(GPT2Config()))
    rule = 6 * n * 8 * 1024
    dense = fw + bw - counts["aten.bmm"]  # the bmm ops are the S^2 attention scores
    c = claims["6nd"]
    assert c.numbers["flops"] == fw + bw and c.numbers["rule"] == rule and c.numbers["dense"] == dense
    assert c.verdict == judge(fw + bw, rule, assumption_holds=rel(dense, rule) <= LOOSE) == ASSUMING
    assert c.numbers["crossover"] == 6 * 768


def test_six_nd_embeddings(claims):
    cfg = GPT2Config(tie_weights=False)
    fw, bw, _ = _meta_flops(lambda: GPT2(cfg), 8, 1024)
    with torch.device("meta"):
        m = GPT2(cfg)
    n = _n(m)
    n_emb = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Embedding))
    c = claims["6nd-embeddings"]
    rule, rule_ne = 6 * n * 8 * 1024, 6 * (n - n_emb) * 8 * 1024
    assert c.numbers == {"flops": fw + bw, "rule": rule, "rule_no_embedding": rule_ne}
    assert c.verdict == judge(fw + bw, rule, assumption_holds=rel(fw + bw, rule_ne) <= LOOSE)


def test_first_layer_and_backward_twice_forward(claims):
    torch.manual_seed(0)
    model = Cruncher(CruncherConfig())
    m = measure_step(model, model.example_inputs(8))
    rule = 6 * _n(model) * 8
    c = claims["6nd-first-layer"]
    assert c.numbers["flops"] == m.flops_total and c.numbers["rule"] == rule
    d = model.config.dim
    assert m.flops_total - rule == -2 * 8 * d * d  # the first layer's missing dL/dx
    # module by module with FlopCounterMode's own per-module counts: only the first layer's backward
    # (dL/dW alone) is not twice its forward, and it reads the raw input
    fc = FlopCounterMode(display=False)
    args = model.example_inputs(8)
    with fc:
        model(*args).backward()
    counts = fc.get_flop_counts()
    differ = [
        name.removeprefix("Cruncher.")
        for name, ops in counts.items()
        if name.startswith("Cruncher.") and name.count(".") == 2 and sum(ops.values()) != 3 * _fwd(model, name)
    ]
    assert differ == ["layers.0"] and c.numbers["differ"] == c.numbers["raw"] == differ
    assert c.verdict == ASSUMING
    # backward = 2 x forward: exact on gpt2 at two sizes
    twice = []
    for B, S in ((2, 7), (3, 16)):
        g = GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
        mg = measure_step(g, g.example_inputs(B, S))
        twice.append(mg.flops_backward == 2 * mg.flops_forward)
    assert all(twice) and claims["4nd-backward"].verdict == HOLDS


def _fwd(model, name: str) -> int:
    """Forward matmul FLOPs of one submodule of the cruncher (FlopCounterMode over the forward alone)."""
    fc = FlopCounterMode(display=False)
    with fc:
        model(*model.example_inputs(8))
    return sum(fc.get_flop_counts().get(name, {}).values())


def test_two_nd_forward(claims):
    fw, _, _ = _meta_flops(lambda: GPT2(GPT2Config()), 8, 1024)
    fw_mode = FlopCounterMode(display=False)
    with torch.device("meta"):
        m = GPT2(GPT2Config())
        args = m.example_inputs(8, 1024)
    with fw_mode:
        m(*args)
    bmm = sum(v for k, v in fw_mode.get_flop_counts()["Global"].items() if str(k) == "aten.bmm")
    rule = 2 * _n(m) * 8 * 1024
    c = claims["2nd-forward"]
    assert c.numbers["flops"] == fw and c.numbers["dense"] == fw - bmm
    assert c.verdict == judge(fw, rule, assumption_holds=rel(fw - bmm, rule) <= LOOSE)


def test_two_bdk(claims):
    exact = []
    for B, D, K in ((3, 5, 7), (16, 64, 48)):
        lin = torch.nn.Linear(D, K, bias=False)
        with FlopCounterMode(display=False) as fc:
            lin(torch.randn(B, D))
        exact.append(fc.get_total_flops() == 2 * B * D * K)
    assert claims["2bdk"].verdict == (HOLDS if all(exact) else WRONG)


def test_elementwise_share(claims):
    """FLOP share from FlopCounterMode (matmuls) and the CPU profiler's per-op time is not used: the share
    of non-matmul FLOPs is recomputed from torch's own counts of elementwise outputs on the meta device."""
    c = claims["elementwise-negligible"]
    fw, bw, _ = _meta_flops(lambda: GPT2(GPT2Config()), 8, 1024)
    share = c.numbers["share_flops"]
    other = share * (fw + bw) / (1 - share)
    # at least one FLOP per element of the (B, S, V) logits' softmax in the loss, forward and backward
    assert other > 2 * 8 * 1024 * 50257 and share < check.TOL
    assert c.numbers["share_bytes"] > 0.5  # most bytes are moved by non-matmul ops
    assert c.numbers["share_time"] >= check.TOL and c.verdict == ASSUMING


def _static_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of params + grads + per-parameter states, bytes of scalar step counters) after one real step."""
    model(*model.example_inputs(2, 8)).backward()
    opt.step()
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    steps = 0
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                if v.dim() == 0:
                    steps += v.untyped_storage().nbytes()
                else:
                    tensors.append(v)
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total, steps


@pytest.mark.parametrize(
    "cid, dtype, make_opt, want",
    [
        ("16-bytes-fp32", None, lambda m: torch.optim.AdamW(m.parameters()), 16),
        ("16-bytes-mixed", torch.bfloat16, lambda m: MixedPrecisionAdamW(m.parameters()), 16),
        ("18-bytes-fp32-grads", torch.bfloat16, lambda m: MixedPrecisionAdamW(m.parameters(), fp32_grads=True), 18),
    ],
)
def test_bytes_per_param(claims, cid, dtype, make_opt, want):
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    if dtype is not None:
        model = model.to(dtype)
    opt = make_opt(model)
    static, steps = _static_bytes(model, opt)
    assert static == want * _n(model)  # exact once the scalar step counters are set aside
    assert claims[cid].numbers["bytes_per_param"] == want
    assert claims[cid].verdict == HOLDS


def test_two_bytes_inference(claims):
    m = GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)).to(torch.bfloat16)
    assert sum(p.untyped_storage().nbytes() for p in m.parameters()) == 2 * _n(m)
    assert claims["2-bytes-inference"].verdict == HOLDS


def _per_layer_saved(B: int, S: int) -> int:
    """Bytes saved for backward by one block of gpt2 at the seed's 1.3B width (bf16 autocast, dropout)."""
    out = []
    for layers in (1, 2):
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=layers, n_embd=2048, n_head=16, vocab_size=64, block_size=64)
        m = GPT2(cfg)
        out.append(measure_step(m, m.example_inputs(B, S), autocast=torch.bfloat16).saved_bytes)
    return out[1] - out[0]


@pytest.mark.slow
def test_activation_claims(claims):
    seed = claims["activations-seed-rule"]
    korth = claims["activations-korthikanti"]
    acct = check._gpt2(config=check.GPT2_1B3, autocast="bf16")
    per_layer = acct.memory.activations_per_layer["blocks"]
    for B, S in ((2, 8), (3, 12)):  # the per-layer formula is what saved_tensors_hooks sees
        assert check._val(acct, per_layer, B, S) == _per_layer_saved(B, S)
    arith = 4 * 1024 * 2048 * (34 + 5 * 24)  # the seed's rule, at its example
    paper = 24 * 1024 * 4 * 2048 * (34 + 5 * 16 * 1024 / 2048)
    assert seed.numbers["seed_rule"] == arith and seed.numbers["korthikanti"] == paper
    assert seed.verdict == judge(seed.numbers["derived"], arith) == WRONG
    assert korth.numbers["bsd"] >= 34 and korth.numbers["bhs2"] >= 5
    assert korth.verdict == judge(korth.numbers["per_layer"], paper / 24, assumption_holds=True)
    one = claims["1.3b-activations"]
    assert math.isclose(arith, 1.29e9, rel_tol=0.01)  # the seed's arithmetic is right; its formula is not
    assert one.verdict == judge(one.numbers["derived"], 1.29e9) == WRONG


def _bits(dtype: torch.dtype) -> tuple[int, int, int]:
    """(bytes, exponent bits, mantissa bits) probed from values, not from finfo."""
    nbytes = torch.empty(1, dtype=dtype).element_size()
    one = torch.tensor(1.0)
    mant = max(k for k in range(1, 30) if (one + 2.0**-k).to(dtype).float() != 1.0)
    big = torch.tensor(1.0)
    for _ in range(300):  # largest power of two the format still holds
        nxt = big * 2
        if dtype.is_floating_point and not torch.isfinite(nxt.to(dtype).float()) or nxt.to(dtype).float() != nxt:
            break
        big = nxt
    top = int(math.log2(big.item()))
    expo = int(math.floor(math.log2(top + 1))) + 1
    return nbytes, expo, mant


def test_number_formats(claims):
    assert np.finfo(np.float32).nmant == 23 and np.finfo(np.float16).nexp == 5  # numpy agrees for IEEE types
    for name, tname, nbytes, bits, _ in check.SEED_FORMATS:
        got = _bits(getattr(torch, tname))
        c = claims[f"format-{name.lower()}"]
        assert (c.numbers["bytes"], c.numbers["exponent"], c.numbers["mantissa"]) == got
        assert c.verdict == (HOLDS if got == (nbytes, bits[1], bits[2]) else WRONG)
    wrapped = torch.tensor([127], dtype=torch.int8) + torch.tensor([1], dtype=torch.int8)
    assert wrapped.item() == claims["format-int8"].numbers["min"] == -128
    assert claims["format-int8"].verdict == HOLDS


def test_worked_numbers(claims):
    with torch.device("meta"):
        n13 = _n(GPT2(GPT2Config(n_embd=2048, n_layer=24, n_head=16)))
        n7 = _n(Llama(LlamaConfig()))
    c = claims["1.3b-static"]
    assert c.numbers["params"] == n13
    assert 16 * n13 <= c.numbers["static"] <= 16 * n13 + 64 * 4 * 200  # plus one scalar step counter per tensor
    assert c.verdict == judge(16 * n13, 20e9)
    fw, bw, _ = _meta_flops(lambda: GPT2(GPT2Config(n_embd=2048, n_layer=24, n_head=16)), 32, 1024)
    c = claims["1.3b-step-flops"]
    assert c.numbers["derived"] == fw + bw and c.verdict == judge(fw + bw, 2.56e14)
    days = 6 * 70e9 * 15e12 / (989e12 * 0.5 * 1024) / 86400
    assert math.isclose(claims["146-days"].numbers["days"], days) and claims["146-days"].verdict == judge(days, 146)
    assert claims["40b-on-8xh100"].numbers["params"] == 8 * 80e9 / 16  # the fp32 AdamW 16 measured above
    assert claims["40b-on-8xh100"].verdict == judge(8 * 80e9 / 16, 40e9) == HOLDS
    c = claims["7b-112gb"]
    assert c.numbers["params"] == n7 and 16 * n7 <= c.numbers["static"] <= 16 * n7 + 4096
    assert c.verdict == judge(16 * n7, 112e9)
    c = claims["7b-14gb-inference"]
    cache = 2 * 32 * 4096 * 2 * 4096  # keys and values, 32 layers of width 4096, bf16, 4096 positions
    assert c.numbers["weights"] == 2 * n7 and c.numbers["kv_cache"] == cache
    assert c.verdict == judge(2 * n7 + cache, 14e9, assumption_holds=judge(2 * n7, 14e9) == HOLDS)


def test_check_cli_json_and_md(capsys):
    from symacct.cli import main

    assert main(["check", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert {r["verdict"] for r in rows} <= {HOLDS, ASSUMING, WRONG}
    assert len({r["id"] for r in rows}) == len(rows)
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    for r in rows:
        assert r["verdict"] in out


@pytest.mark.skipif(torch.version.cuda is not None, reason="the CPU build's refusal")
def test_check_on_cuda_needs_the_cuda_build(capsys: pytest.CaptureFixture[str]) -> None:
    from symacct.cli import main

    assert main(["check", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs the CUDA build of torch" in err and len(err.splitlines()) == 1
