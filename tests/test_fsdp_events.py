"""FSDP2's own buffers placed on the traced step (``symacct.parallel.fsdp``): a rank's peak against PyTorch's
``fully_shard`` run for real (real CPU tensors on the fake process group: every buffer FSDP2 allocates is
real, the collectives move nothing), to the byte, over drawn models, degrees, HSDP, resharding, mixed
precision, activation checkpointing, gradient accumulation and sizes, and with tensor parallelism."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from parallel_cases import GPT2_SMALL, LLAMA_SMALL, Batch, Build, adamw

import symacct
from symacct.errors import SymacctError
from symacct.measure.parallel import fake_rank_peak
from symacct.models.llama import Llama, LlamaConfig
from symacct.parallel.layout import make_layout
from symacct.parallel.rank import derive_compute, derive_parallel

CONFIGS = {
    "gpt2": GPT2_SMALL,
    "gpt2-sdpa-checkpointed": dataclasses.replace(GPT2_SMALL, n_layer=3, sdpa=True, checkpoint=True),
    "llama": LLAMA_SMALL,  # rotary tables: fp32 buffers, cast into each block under the policy
}


@functools.cache
def _derived(name: str, param: str | None) -> symacct.Accounting:
    """The model in its own dtype (param None), or as FSDP2's MixedPrecisionPolicy(param) runs it."""
    model = Build(CONFIGS[name])()
    if param is None:
        return symacct.derive(model, optimizer="adamw")
    return derive_compute(model, make_layout(dp=2, dp_mode="fsdp", param_dtype=param), optimizer="adamw")


def _stack(name: str) -> str:
    return "layers" if name.startswith("llama") else "blocks"


@given(
    name=st.sampled_from(sorted(CONFIGS)),
    dp=st.integers(2, 4),
    hsdp=st.booleans(),
    reshard=st.booleans(),
    mixed=st.sampled_from([None, ("bf16", None), ("bf16", "fp32")]),
    m=st.integers(1, 2),
    B=st.integers(2, 4),  # B = 1: see docs/conventions.md, "a size of 1" (eager attention's views)
    S=st.integers(2, 16),
)
def test_peak_to_the_byte(name: str, dp: int, hsdp: bool, reshard: bool, mixed: Any, m: int, B: int, S: int) -> None:
    """Rank 0's peak of a later step: every op of the traced forward and backward, FSDP2's all-gather outputs,
    unsharded parameters (the root's kept, a block's prefetched), unsharded gradients, reduce-scatter inputs
    and sharded gradients at its hooks, and the optimizer step: equal to the real allocation, to the byte
    (small models: FSDP2's buffers are a large part of the peak, which lands in backward or the optimizer);
    with gradient accumulation (m = 2) too, whose second micro-batch holds the first's sharded gradients."""
    param, reduce = mixed or (None, None)
    lay = make_layout(
        dp=dp,
        dp_mode="fsdp",
        hsdp_shard=2 if hsdp and dp == 4 else None,
        reshard_after_forward=reshard,
        param_dtype=param,
        reduce_dtype=reduce,
        micro_batches=m,
    )
    cfg = CONFIGS[name]
    par = derive_parallel(_derived(name, None), lay, _derived(name, param) if param else None)
    assert par.overlay is not None
    pred = par.at(B=B, S=S).ranks[0].peak
    assert fake_rank_peak(Build(cfg), lay, 0, Batch(B, S, cfg.vocab_size), adamw, stack=_stack(name)) == pred


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
@pytest.mark.parametrize("param", [None, "bf16"])
def test_with_tensor_parallelism(param: str | None) -> None:
    """FSDP2 over dp = 2 of tensor-parallel ranks (tp = 2, the Megatron plan with sequence parallelism): the
    tensor-parallel rank's traced step with FSDP2's buffers on it, to the byte against the 2-D mesh run
    for real on the fake process group (with bf16 parameters: rotary tables left in fp32 and cast into
    each block, as FSDP2 does). The additive model gave 0.82 of it here."""
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=32, max_seq_len=64)
    lay = make_layout(dp=2, tp=2, dp_mode="fsdp", param_dtype=param)
    acct = symacct.derive(Llama(cfg), optimizer="adamw", **lay.rank_options)
    compute = derive_compute(Llama(cfg), lay, optimizer="adamw", **lay.rank_options)
    par = derive_parallel(acct, lay, compute)
    for B, S in ((2, 8), (3, 12)):
        pred = par.at(B=B, S=S).ranks[0].peak
        assert fake_rank_peak(Build(cfg), lay, 0, Batch(B, S, 64), adamw, stack="layers") == pred


def test_formula_and_planner() -> None:
    """The formula is a Max over the points largest somewhere in a sample of the sizes: never above the exact
    peak (each of its terms is the live bytes at one point); ``at()`` and the planner's compiled path evaluate
    every point and agree."""
    from symacct.parallel.plan import plan
    from symacct.symbols import evaluate

    acct = _derived("gpt2", None)
    rows = plan(acct, gpus=4, hardware="H100-SXM", global_batch=8, seq=16, dp_modes=("fsdp",))
    assert rows
    for r in rows:
        par = derive_parallel(acct, r.layout)
        exact = par.at(B=r.micro_batch, S=16)
        assert r.peak == max(k.peak for k in exact.ranks)
        if par.overlay is not None:
            values = {**acct.values_at(B=r.micro_batch, S=16), **par.degrees()}
            assert evaluate(par.ranks[0].peak, values) <= exact.ranks[0].peak


@pytest.mark.slow  # subprocesses and the planner: tens of seconds (CI's slow pass)
def test_planner_with_the_policy() -> None:
    """``plan(fsdp_policy=...)`` ranks FSDP2 and HSDP with the policy (over a pipeline too), each row the figures of
    ``derive_parallel(acct, layout, compute).at()`` and ``step_time``; the CLI's ``--fsdp-param-dtype`` the
    same; other modes, a degree without its compute trace, and a compute trace without a policy refused."""
    import json
    import subprocess
    import sys

    from symacct.parallel.plan import plan, step_time

    own, low = _derived("llama", None), _derived("llama", "bf16")
    kw: dict[str, Any] = {"gpus": 4, "hardware": "H100-SXM", "global_batch": 8, "seq": 16}
    rows = plan(own, **kw, fsdp_policy=("bf16", "fp32"), compute={(1, 1): low})
    assert {(r.layout.dp_mode, r.layout.param_dtype, r.layout.reduce_dtype) for r in rows} == {("fsdp", "bf16", "fp32")}
    assert any(r.layout.hsdp_shard for r in rows)
    assert any(r.layout.pp > 1 for r in rows)  # FSDP2 with the policy over a pipeline
    for r in rows:
        exact = derive_parallel(own, r.layout, low).at(B=r.micro_batch, S=16)
        assert r.peak == max(k.peak for k in exact.ranks)
        t = step_time(exact, "H100-SXM")
        assert r.seconds == pytest.approx(t.seconds, rel=1e-12) and r.mfu == pytest.approx(t.mfu, rel=1e-12)
    with pytest.raises(SymacctError, match="plans FSDP2 and HSDP only"):
        plan(own, **kw, fsdp_policy=("bf16", None), compute={(1, 1): low}, dp_modes=("ddp",))
    with pytest.raises(SymacctError, match="tp=1, cp=1 need that rank traced with its parameters in bf16"):
        plan(own, **kw, fsdp_policy=("bf16", None), compute={})
    with pytest.raises(SymacctError, match="goes with fsdp_policy="):
        plan(own, **kw, compute={(1, 1): low})
    cfg = {"dim": 12, "n_layers": 2, "n_heads": 3, "n_kv_heads": 1, "vocab_size": 29, "hidden_dim": 20}
    flags = [a for k, v in {**cfg, "max_seq_len": 16}.items() for a in ("--config", f"{k}={v}")]
    run = [sys.executable, "-m", "symacct.cli", "plan", "llama", *flags, "--gpus", "4", "--hardware", "H100-SXM"]
    run += ["--seq", "16", "--global-batch", "8", "--tp", "1", "--json"]
    got = subprocess.run(
        [*run, "--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32"], capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    by_layout = {(r.layout.hsdp_shard, r.micro_batch): r.peak for r in rows}
    printed = json.loads(got.stdout)["layouts"]
    assert {(r["hsdp_shard"], r["micro_batch"]): r["peak_bytes"] for r in printed} == by_layout
    bad = subprocess.run([*run, "--fsdp-param-dtype", "bf16", "--params-dtype", "bf16"], capture_output=True, text=True)
    assert bad.returncode == 2 and "drop --params-dtype" in bad.stderr


@pytest.mark.slow  # a derivation more of a path the default run also covers: in CI's slow pass (20 minutes)
def test_compute_trace_as_the_policy_runs_it() -> None:
    """``fsdp_policy=True`` keeps floating buffers in their dtype (the compute trace's buffer bytes are the
    model's own); a compute trace that cast them (``model.to(bf16)``) is refused for a model with floating
    buffers, as is the policy without a dtype."""
    own, policy = _derived("llama", None), _derived("llama", "bf16")
    assert policy.options["fsdp_policy"] is True and policy.memory.buffers == own.memory.buffers
    cast = symacct.derive(Llama(LLAMA_SMALL), optimizer="adamw", params_dtype="bf16")
    assert cast.memory.buffers != own.memory.buffers
    with pytest.raises(SymacctError, match="floating buffers to bf16: FSDP2's MixedPrecisionPolicy"):
        derive_parallel(own, make_layout(dp=2, dp_mode="fsdp", param_dtype="bf16"), cast)
    with pytest.raises(SymacctError, match="fsdp_policy=True .* needs params_dtype"):
        symacct.derive(Llama(LLAMA_SMALL), optimizer="adamw", fsdp_policy=True)
    torch.manual_seed(0)  # the GPT-2 reference has no floating buffer: model.to(bf16) is the policy there
    gpt2 = symacct.derive(Build(GPT2_SMALL)(), optimizer="adamw", params_dtype="bf16")
    derive_parallel(_derived("gpt2", None), make_layout(dp=2, dp_mode="fsdp", param_dtype="bf16"), gpt2)
