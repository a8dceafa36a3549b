"""CUDA semantics without a GPU: ``derive(device="cuda")`` with the CUDA build of torch on a machine that has
no GPU (skipped on the CPU build, which cannot make a fake CUDA tensor without aborting).

Checked here:
- the saved activations of the CUDA derivation equal an independent count: ``saved_tensors_hooks`` on a
  forward of the user's model on fake CUDA tensors at the same sizes (parameters, buffers and inputs
  excluded), with PyTorch's own autograd (the forward needs no engine);
- they differ from the CPU derivation by the terms CUDA's kernels change, each named: dropout's bool
  mask (1 byte) where the CPU saves a noise tensor of the input's dtype; softmax in fp32 under CUDA
  autocast (the CPU's autocast leaves it in bf16); flash attention's random-number state.
- the Python engine's backward is PyTorch's on the CPU (``tests/test_engine.py``); here it runs on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import symacct
from symacct.errors import SymacctError
from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
from symacct.symbols import sym

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs the CUDA build of torch (no GPU needed)")

B_, S_, D_, H_ = (sym(n) for n in "BSDH")


def _gpt2(**kw: Any) -> GPT2:
    return GPT2(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, block_size=64, **kw))


def _llama(**kw: Any) -> Llama:
    return Llama(
        LlamaConfig(n_layers=3, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=128, max_seq_len=64, **kw)
    )


def _saved_on_fake_cuda(
    model: torch.nn.Module, B: int, S: int, autocast: torch.dtype | None, backend: str | None
) -> int:
    """Bytes of the distinct storages autograd saves in one forward (and loss) of ``model`` on fake CUDA
    tensors, parameters, buffers and inputs excluded: PyTorch's forward, counted by its own hooks."""
    from symacct.sameness import fake_copy
    from symacct.trace.record import _autocast
    from symacct.trace.sdpa import choosing

    fake = FakeTensorMode()
    m = fake_copy(model, fake, "cuda").train()  # parameters as fake CUDA tensors, ties kept
    with fake:
        args = tuple(a.to("cuda") for a in model.example_inputs(B, S))
        own = {t.untyped_storage()._cdata for t in [*m.parameters(), *m.buffers(), *args]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st._cdata not in own:
                saved[st._cdata] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), choosing(backend, "cuda"):
            with _autocast(autocast, "cuda"):
                out = m(*args)
    del out
    return sum(saved.values())


CASES = {
    "gpt2 bf16 autocast": (_gpt2, {}, {"autocast": torch.bfloat16}),
    "gpt2 bf16 params": (_gpt2, {}, {"params_dtype": torch.bfloat16}),
    "gpt2 no dropout": (_gpt2, {"dropout": 0.0}, {"autocast": torch.bfloat16}),
    "gpt2 sdpa flash": (_gpt2, {"sdpa": True}, {"autocast": torch.bfloat16, "sdpa_backend": "flash"}),
    "gpt2 sdpa math": (_gpt2, {"sdpa": True}, {"autocast": torch.bfloat16, "sdpa_backend": "math"}),
    "llama bf16 autocast": (_llama, {}, {"autocast": torch.bfloat16}),
    "llama sdpa flash": (_llama, {"sdpa": True}, {"autocast": torch.bfloat16, "sdpa_backend": "flash"}),
    # memory-efficient attention: its logsumexp padded to 32*ceiling(S/32) rows (S = 40: 64)
    "gpt2 sdpa efficient fp32": (_gpt2, {"sdpa": True}, {"sdpa_backend": "efficient"}),
    "llama sdpa efficient bf16": (_llama, {"sdpa": True}, {"autocast": torch.bfloat16, "sdpa_backend": "efficient"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_saved_bytes_equal_an_independent_count(case: str) -> None:
    make, config, kw = CASES[case]
    acct = symacct.derive(make(**config), optimizer="adamw", device="cuda", **kw)
    B, S = 3, 40
    model = make(**config)
    if kw.get("params_dtype") is not None:
        model = model.to(kw["params_dtype"])
    counted = _saved_on_fake_cuda(model, B, S, kw.get("autocast"), kw.get("sdpa_backend"))
    assert acct.at(B=B, S=S).memory.activations == counted


def _per_layer(acct: Any) -> sympy.Expr:
    (expr,) = acct.memory.activations_per_layer.values()
    return sympy.expand(expr)


def test_gpt2_cuda_minus_cpu_is_the_named_terms() -> None:
    """Per layer, CUDA minus CPU, worked out from the kernels: each of a block's two B*S*D dropouts saves a
    bool mask (1 byte) where the CPU saves a noise tensor of the input's dtype (bf16 under autocast: 2,
    fp32: 4); the attention dropout likewise on B*H*S^2 scores; and under CUDA autocast softmax runs and
    saves its output in fp32 (4 bytes) where the CPU's autocast keeps bf16 (2)."""
    for kw, want in (
        ({"autocast": torch.bfloat16}, 2 * (1 - 2) * B_ * S_ * D_ + ((1 - 2) + (4 - 2)) * B_ * H_ * S_**2),
        ({}, 2 * (1 - 4) * B_ * S_ * D_ + (1 - 4) * B_ * H_ * S_**2),
        # bf16 parameters: the masks against bf16 noise, and LayerNorm's mean and rstd in fp32 on CUDA, in
        # the input's bf16 on the CPU (two norms, two tensors of B*S each: 2 * 2 * (4 - 2))
        (
            {"params_dtype": torch.bfloat16},
            2 * (1 - 2) * B_ * S_ * D_ + (1 - 2) * B_ * H_ * S_**2 + 2 * 2 * (4 - 2) * B_ * S_,
        ),
    ):
        cuda = symacct.derive(_gpt2(), optimizer="adamw", device="cuda", **kw)
        cpu = symacct.derive(_gpt2(), optimizer="adamw", **kw)
        assert sympy.expand(_per_layer(cuda) - _per_layer(cpu)) == sympy.expand(want), kw


def test_sdpa_without_a_gpu_is_refused_unless_a_kernel_is_named() -> None:
    from symacct.errors import SymacctError

    with pytest.raises(SymacctError, match="sdpa_backend"):
        symacct.derive(_gpt2(sdpa=True), device="cuda", autocast=torch.bfloat16)
    with pytest.raises(SymacctError, match="unknown SDPA backend"):
        symacct.derive(_gpt2(sdpa=True), device="cuda", sdpa_backend="fast")


def test_llama_flash_cuda_minus_cpu_is_the_random_number_state() -> None:
    """CUDA's flash attention saves what the CPU's flash kernel saves (the output and an fp32 logsumexp per
    query) plus its random-number state, a (2,) and a () uint64 tensor as PyTorch's fake kernel makes them:
    24 bytes a layer."""
    kw = {"autocast": torch.bfloat16}
    cuda = symacct.derive(_llama(sdpa=True), optimizer="adamw", device="cuda", sdpa_backend="flash", **kw)
    cpu = symacct.derive(_llama(sdpa=True), optimizer="adamw", **kw)
    assert sympy.expand(_per_layer(cuda) - _per_layer(cpu)) == 24


def test_korthikanti_on_cuda_semantics() -> None:
    """Megatron's setting (bf16 parameters, dropout, eager attention) on CUDA's kernels: per layer exactly
    s*b*h*(34 + 5*a*s/h) plus what PyTorch adds: LayerNorm's fp32 mean and rstd (two norms: 16*B*S) and
    the causal mask's bool S x S slice that masked_fill saves (S^2)."""
    acct = symacct.derive(_gpt2(), device="cuda", params_dtype=torch.bfloat16)
    want = 34 * B_ * S_ * D_ + 5 * B_ * H_ * S_**2 + 16 * B_ * S_ + S_**2
    assert _per_layer(acct) == sympy.expand(want)


def test_reserved_on_cuda_leaves_out_what_eager_cuda_keeps_on_the_cpu() -> None:
    """AdamW's step counters stay on the CPU in an eager CUDA run (no capturable/fused), and so do the scalars
    its foreach step computes from them: the CUDA trace records them there, and the caching-allocator replay
    leaves out exactly the storages recorded on the CPU, the step counters among them."""
    acct = symacct.derive(_gpt2(), optimizer="adamw", device="cuda", autocast=torch.bfloat16)
    L = acct.liveness.layers  # the first trace's blocks (acct.step is that trace)
    values = {sym(k): v for k, v in acct.values_at(B=2, S=16, L=L).items()}
    tl = acct.timelines(L)
    full = acct.liveness.base
    left_out = {st for st in full.start if st not in tl.intervals.start}
    assert left_out == {st for st in full.start if acct.step.storage_device.get(st) == "cpu"}
    steps = {st for st, (_, key) in acct.step.state_storages.items() if key == "step"}
    assert steps and steps <= left_out
    step_bytes = sum(int(full.nbytes[st].subs(values)) for st in steps)
    assert step_bytes == acct.at(B=2, S=16, L=L).memory.optimizer_by_state["step"]


def test_a_transformers_model_with_grouped_query_flash_attention() -> None:
    """transformers' Llama with its SDPA path (enable_gqa: two key/value heads for four query heads): on
    CUDA's flash kernel it saves what the CPU's flash kernel saves plus the 24-byte random-number state a
    layer; the eager path runs CUDA's kernels too."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    kw = {"autocast": torch.bfloat16, "optimizer": "adamw"}
    cuda = symacct.derive(model, device="cuda", sdpa_backend="flash", **kw)
    cpu = symacct.derive(model, **kw)
    assert sympy.expand(_per_layer(cuda) - _per_layer(cpu)) == 24
    assert any("flash attention" in n for n in cuda.notes)
    model.config._attn_implementation = "eager"
    eager = symacct.derive(model, device="cuda", **kw)
    assert eager.at(B=2, S=16).memory.activations > 0


def test_sdpa_under_cuda_autocast_runs_as_cpu_autocast_runs_it() -> None:
    """Autocast runs ahead of the named kernel as it runs ahead of PyTorch's own choice: SDPA is on both
    devices' lower-precision lists, so query, key and value (fp32 after a rotary embedding, bf16 from a
    linear) are cast to bf16 and the kernel runs with autocast off. The reference is the CPU build's own
    autocast around the math kernel (``sdpa_kernel``): the ops and dtypes inside it must be the same on the
    CUDA route (without the cast and the switch-off, math's fp32 upcast would be cast back by its matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    from symacct.trace.record import _autocast
    from symacct.trace.sdpa import choosing

    class Spy(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.namespace != "aten":  # prim.device: the CPU path asks for devices more often
                return out
            flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else (out,))]
            self.seen.append((str(func), tuple(t.dtype for t in flat if isinstance(t, torch.Tensor))))
            return out

    def run(device: str, backend: Any) -> list[tuple[str, tuple[torch.dtype, ...]]]:
        with FakeTensorMode():
            q, k = (torch.randn(2, 4, 16, 8, device=device, requires_grad=True) for _ in range(2))
            v = torch.randn(2, 4, 16, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
            with _autocast(torch.bfloat16, device), backend, Spy() as spy:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return spy.seen

    cpu = run("cpu", sdpa_kernel([SDPBackend.MATH]))
    assert ("aten._to_copy.default", (torch.float32, torch.bfloat16)) in cpu  # the casts are there to check
    assert run("cuda", choosing("math", "cuda")) == cpu
    flash = [d for f, d in run("cuda", choosing("flash", "cuda")) if "flash" in f]
    assert flash and set(flash[0][:3]) == {torch.bfloat16}


def _wide_llama() -> Llama:
    cfg = LlamaConfig(n_layers=3, dim=512, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=128, max_seq_len=64)
    return Llama(dataclasses.replace(cfg, sdpa=True))


def test_hardware_runs_the_kernel_pytorch_chooses_there() -> None:
    """derive(hardware=...) runs the kernel PyTorch 2.14 picks on that GPU, judged at the model's own head dim
    (128) and not the probe's (232, which cuDNN's backward rule would turn away): cuDNN attention on an H100,
    flash on an A100; each derivation equals the one with that kernel named, and the two differ (cuDNN keeps
    two int64 random-number scalars, 16 bytes a layer, flash a (2,) and a () tensor, 24)."""
    kw: dict[str, Any] = {"autocast": torch.bfloat16, "optimizer": "adamw", "device": "cuda"}
    per_layer = {}
    for hw, backend, name in (
        ("H100", "cudnn", "cuDNN attention (sm90, bf16, head dim 128) on H100-SXM"),
        ("A100", "flash", "flash attention (sm80, bf16, head dim 128) on A100-SXM-80GB"),
    ):
        chosen = symacct.derive(_wide_llama(), hardware=hw, **kw)
        named = symacct.derive(_wide_llama(), sdpa_backend=backend, **kw)
        assert any(name in n for n in chosen.notes), chosen.notes
        assert _per_layer(chosen) == _per_layer(named)
        assert chosen.at(B=2, S=32).memory.activations == named.at(B=2, S=32).memory.activations
        per_layer[backend] = _per_layer(chosen)
    assert sympy.expand(per_layer["flash"] - per_layer["cudnn"]) == 8


def test_fp32_attention_trains_on_memory_efficient_attention() -> None:
    """fp32 attention on an H100 runs the memory-efficient kernel (flash and cuDNN take half types only), whose
    logsumexp holds 32*ceiling(S/32) rows per head, fp32: the derived per-layer activations carry exactly that
    term, and at S = 40 (64 rows) and S = 64 (64 rows) the saved bytes equal PyTorch's own forward's."""
    acct = symacct.derive(_gpt2(sdpa=True), optimizer="adamw", device="cuda", hardware="H100")
    assert any("memory-efficient attention (sm90, fp32" in n for n in acct.notes), acct.notes
    assert sympy.expand(_per_layer(acct)).coeff(sympy.ceiling(S_ / 32)) == 128 * B_ * H_
    for S in (40, 64):
        counted = _saved_on_fake_cuda(_gpt2(sdpa=True), 3, S, None, "efficient")
        assert acct.at(B=3, S=S).memory.activations == counted


def test_a_head_dim_flash_pads_is_refused() -> None:
    """Flash attention pads a head dim that is no multiple of 8 (copies of query, key and value); a probe's head
    is always a multiple of 8, so a model whose own head is not would lose those copies: refused, naming the
    kernel, and derived once another kernel is named."""
    model = GPT2(GPT2Config(n_layer=2, n_embd=60, n_head=6, vocab_size=128, block_size=64, sdpa=True))
    kw: dict[str, Any] = {"autocast": torch.bfloat16, "optimizer": "adamw", "device": "cuda"}
    with pytest.raises(SymacctError, match="head dim 10 is padded to a multiple of 8"):
        symacct.derive(model, hardware="A100", **kw)
    with pytest.raises(SymacctError, match="head dim 10 is padded to a multiple of 8"):
        symacct.derive(model, sdpa_backend="flash", **kw)
    assert symacct.derive(model, sdpa_backend="math", **kw).memory.activations != 0


def test_without_gpu_is_the_route_taken_here() -> None:
    """Without a GPU, ``without_gpu=True`` is the route every CUDA derivation takes: the same formulas, the
    flag on record, the note naming symacct's engine (on a GPU, tests/test_cuda.py compares the two routes)."""
    kw: dict[str, Any] = {"autocast": torch.bfloat16, "optimizer": "adamw", "device": "cuda", "hardware": "H100"}
    plain = symacct.derive(_wide_llama(), **kw)
    routed = symacct.derive(_wide_llama(), without_gpu=True, **kw)
    assert (plain.options["without_gpu"], routed.options["without_gpu"]) == (False, True)
    assert routed.memory == plain.memory and routed.flops == plain.flops
    assert any("backward by symacct.trace.engine" in n for n in routed.notes)


def test_optimizers_take_the_implementation_pytorch_defaults_to_on_cuda() -> None:
    """With neither foreach= nor fused= given, PyTorch's optimizers run foreach on CUDA and the single-tensor
    loop on the CPU (torch.optim's docs; ``_default_to_fused_or_foreach`` checks the parameters' type and
    device). A fake tensor is not on its type list, so before the fix a CUDA trace ran the loop: the optimizer
    phase a real CUDA run does not have. Now the CUDA default is foreach exactly, the CPU default the loop,
    and foreach AdamW's phase holds five fp32 copies of the parameters at once (each parameter, its gradient,
    m, v, and the sqrt(v) list ``_multi_tensor_adamw`` makes), where the loop holds one temporary at a time."""
    from symacct.models import GPT2, GPT2Config

    def derive(device: str, **options: Any) -> Any:
        model = GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32))
        return symacct.derive(model, optimizer="adamw", device=device, optimizer_options=options)

    cuda, cuda_foreach, cuda_loop = derive("cuda"), derive("cuda", foreach=True), derive("cuda", foreach=False)
    assert cuda.memory == cuda_foreach.memory and cuda.memory != cuda_loop.memory
    assert any(str(r.op).startswith("aten._foreach_") for r in cuda.step.ops if r.phase == "optimizer")
    cpu, cpu_loop = derive("cpu"), derive("cpu", foreach=False)
    assert cpu.memory == cpu_loop.memory
    assert not any(str(r.op).startswith("aten._foreach_") for r in cpu.step.ops)

    L, D = sym("L"), sym("D")
    five = 5 * cuda.memory.params  # fp32 parameters: 4 bytes each, five copies
    terms = cuda.memory.peak.args if isinstance(cuda.memory.peak, sympy.Max) else (cuda.memory.peak,)
    held = [t for t in terms if sympy.expand(t - five).coeff(D**2 * L) == 0 and sympy.expand(t).coeff(D**2 * L)]
    assert held, terms  # the optimizer phase: 20 bytes per parameter of the D**2*L weights
    loop = cuda_loop.memory.peak.args if isinstance(cuda_loop.memory.peak, sympy.Max) else ()
    assert all(sympy.expand(t - five).coeff(D**2 * L) < 0 for t in loop)


def test_hardware_names_the_kernel_it_passed_over() -> None:
    """gpt2's attention dropout of 0.1 is no multiple of 1/16: on an H100 cuDNN is passed over for flash, and
    the note says why."""
    acct = symacct.derive(_gpt2(sdpa=True), device="cuda", hardware="H100", autocast=torch.bfloat16)
    (note,) = [n for n in acct.notes if "SDPA:" in n]
    assert "flash attention (sm90, bf16, head dim 16; not cuDNN attention: dropout not a multiple of 1/16)" in note
    named = symacct.derive(_gpt2(sdpa=True), device="cuda", sdpa_backend="flash", autocast=torch.bfloat16)
    assert _per_layer(acct) == _per_layer(named)


def test_hardware_on_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from symacct.cli import main

    args = ["derive", "llama", "--config", "sdpa=true", "--config", "n_layers=2", "--config", "dim=256"]
    assert main([*args, "--device", "cuda", "--hardware", "H100", "--autocast", "bf16"]) == 0
    assert "SDPA: cuDNN attention (sm90, bf16, head dim" in capsys.readouterr().out


def test_check_gives_cuda_beside_cpu() -> None:
    """``symacct check --device cuda``'s Korthikanti claim in Megatron's setting (bf16 parameters): the paper's
    34 and 5 exactly on CUDA's kernels, the remainder LayerNorm's fp32 statistics (16 B S) and the mask slice
    (S^2), and the CPU's figure beside it differing by the masks and statistics (worked out in
    test_gpt2_cuda_minus_cpu_is_the_named_terms)."""
    from symacct.report.check import HOLDS, catalog

    (claim,) = [c for c in catalog("cuda") if c.id == "activations-korthikanti-cuda"]
    assert claim.verdict == HOLDS and (claim.numbers["bsd"], claim.numbers["bhs2"]) == (34, 5)
    assert "CUDA minus the paper: `16*B*S + S**2`" in claim.details[0]
    assert "CUDA minus CPU: `-B*S**2*H - 2*B*S*D + 8*B*S`" in claim.details[1]
    assert "activations-korthikanti-cuda" not in {c.id for c in catalog()}


def test_check_gives_the_optimizer_steps_bytes_per_parameter_on_cuda() -> None:
    """'16 bytes per parameter' (AdamW, fp32) on CUDA: 4 + 4 + 4 + 4 between steps, as on the CPU; inside the
    step CUDA's default foreach AdamW holds the sqrt(v) list too (5 x 4 = 20, ``_multi_tensor_adamw``), where
    the CPU's loop holds one parameter's temporary at a time (16 in the leading terms)."""
    from symacct.report.check import HOLDS, catalog

    (claim,) = [c for c in catalog("cuda") if c.id == "16-bytes-fp32-cuda"]
    assert claim.verdict == HOLDS
    assert (claim.numbers["bytes_per_param"], claim.numbers["bytes_per_param_peak"]) == (16, 20)
    assert claim.numbers["cpu_bytes_per_param_peak"] == 16
    assert "optimizer path foreach" in claim.derived and "(the single-tensor loop)" in claim.derived
    assert "16-bytes-fp32-cuda" not in {c.id for c in catalog()}


def test_an_inference_step_that_a_gpu_may_fuse_is_refused_unless_the_fused_path_is_off():
    """symacct chooses SDPA's kernel on CUDA through a torch-function mode, and while a mode is active PyTorch
    never takes nn.TransformerEncoderLayer's fused inference path, which a GPU takes: refused, not derived as
    the unfused path; with the fused path switched off, derived (training never takes it)."""
    from test_torch_transformer import Encoder, EncoderConfig, ids

    model = Encoder(EncoderConfig())
    with pytest.raises(SymacctError, match="fused inference path"):
        symacct.derive(model, step="forward", inputs=ids, device="cuda", hardware="H100-SXM")
    assert symacct.derive(model, optimizer="adamw", device="cuda", hardware="H100-SXM").flops.total != 0
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        cuda = symacct.derive(model, step="forward", inputs=ids, device="cuda", hardware="H100-SXM")
        cpu = symacct.derive(model, step="forward", inputs=ids)
        assert sympy.expand(cuda.flops.total - cpu.flops.total) == 0
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
