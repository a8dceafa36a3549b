"""The SDPA kernel PyTorch 2.14 picks on a named GPU (``symacct.trace.sdpa_choice``), worked out by hand from
the rules of ``sdp_utils.cpp`` (the module docstring quotes them) for one case per rule. The rules read only
shapes, strides, dtypes and settings, so these run on CPU tensors and the CPU build; ``tests/test_cuda.py``
compares the choice with PyTorch's own (``torch._fused_sdp_choice``) on a GPU, and
``tests/test_cuda_semantics.py`` derives with it on fake CUDA tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from symacct.errors import SymacctError
from symacct.time.hardware import get
from symacct.trace.sdpa_choice import Target, choose, priority_order

CUDNN = 92400  # the cuDNN of the torch 2.14.1 CUDA 13.0 wheel
H100, A100, B200 = Target("H100", 9, 0, CUDNN), Target("A100", 8, 0, CUDNN), Target("B200", 10, 0, CUDNN)
RTX4090 = Target("RTX-4090", 8, 9, CUDNN)


def _qkv(
    head: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    grad: bool = True,
    s_q: int = 16,
    s_k: int = 16,
    heads: tuple[int, int] = (4, 4),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.zeros(2, heads[0], s_q, head, dtype=dtype, requires_grad=grad)
    k, v = (torch.zeros(2, heads[1], s_k, head, dtype=dtype, requires_grad=grad) for _ in range(2))
    return q, k, v


def _backend(
    target: Target,
    *,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    causal: bool = True,
    gqa: bool = False,
    **kw: Any,
) -> str:
    q, k, v = _qkv(**kw)
    return choose(target, q, k, v, mask, dropout, causal, gqa).backend


def test_priority_order() -> None:
    """cuDNN goes first above cuDNN 9.15.0 on compute capability 9.x and 10.x, else PyTorch's default order."""
    assert priority_order(H100) == ["cudnn", "flash", "efficient", "math"]
    assert priority_order(B200) == ["cudnn", "flash", "efficient", "math"]
    assert priority_order(A100) == ["flash", "efficient", "math", "cudnn"]
    assert priority_order(Target("H100", 9, 0, 91500)) == ["flash", "efficient", "math", "cudnn"]
    assert priority_order(Target("H100", 9, 0, None)) == ["flash", "efficient", "math", "cudnn"]


def test_priority_order_follows_the_environment_and_a_set_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert priority_order(H100)[0] == "flash"
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    was = torch._C._get_sdp_priority_order()
    torch._C._set_sdp_priority_order([0, 1, 2, 3])  # math first: the process's own order is kept
    try:
        assert priority_order(H100) == ["math", "flash", "efficient", "cudnn"]
    finally:
        torch._C._set_sdp_priority_order(was)


@pytest.mark.parametrize(
    ("target", "kw", "want"),
    [
        (H100, {}, "cudnn"),  # bf16, head 128, causal: cuDNN first and it fits
        (B200, {}, "cudnn"),
        (A100, {}, "flash"),  # flash first on sm80
        (RTX4090, {}, "flash"),
        (H100, {"dropout": 0.1}, "flash"),  # cuDNN needs dropout in sixteenths
        (H100, {"dropout": 0.125}, "cudnn"),
        (H100, {"head": 232}, "flash"),  # a 256-capable cuDNN runs its backward for <=128, 192/128, 256/256 only
        (H100, {"head": 232, "grad": False}, "cudnn"),  # no backward: up to 256
        (H100, {"head": 256}, "cudnn"),
        (Target("H100", 9, 0, 92200), {"head": 160}, "flash"),  # cuDNN 9.22.0: head dims up to 128
        (H100, {"head": 124}, "flash"),  # cuDNN: head dims multiples of 8 (flash pads)
        (H100, {"dtype": torch.float32}, "efficient"),  # fp32: neither cuDNN nor flash
        (H100, {"dtype": torch.float32, "head": 30}, "math"),  # efficient: fp32 head dims multiples of 4
        (A100, {"head": 300}, "math"),  # flash: <= 256; efficient: 300 is no multiple of 8
        (A100, {"head": 264}, "efficient"),
        (A100, {"mask": torch.ones(16, 16, dtype=torch.bool), "causal": False}, "efficient"),  # flash: no mask
        (H100, {"mask": torch.ones(16, 16, dtype=torch.bool), "causal": False}, "cudnn"),
        # cuDNN: a 2-D or 4-D mask; flash: none
        (H100, {"mask": torch.ones(3, 16, 16, dtype=torch.bool), "causal": False}, "efficient"),
        (A100, {"s_q": 1}, "efficient"),  # causal decode: flash needs as many queries as keys
        (A100, {"s_q": 1, "causal": False}, "flash"),
        (H100, {"s_k": 1, "s_q": 1, "causal": False}, "flash"),  # cuDNN: more than one key
        (RTX4090, {"head": 200}, "efficient"),  # sm89 training: flash's backward stops at 192 (to 224)
        (RTX4090, {"head": 256}, "flash"),  # ... and runs above 224 without dropout
        (RTX4090, {"head": 256, "dropout": 0.25}, "efficient"),
        (RTX4090, {"head": 200, "grad": False}, "flash"),
        (Target("V100", 7, 0, CUDNN), {"dtype": torch.float16}, "efficient"),  # flash and cuDNN: sm80 and up
        (Target("V100", 7, 0, CUDNN), {}, "math"),  # no bf16 below sm80
        (A100, {"heads": (8, 2), "gqa": True}, "flash"),
        (H100, {"heads": (8, 2), "gqa": True}, "cudnn"),
        (A100, {"heads": (8, 3), "gqa": True, "dtype": torch.float32}, "math"),  # heads that do not group
    ],
)
def test_choice(target: Target, kw: dict[str, Any], want: str) -> None:
    assert _backend(target, **kw) == want


@contextlib.contextmanager
def _setting(set_: Any, get: Any, value: Any) -> Iterator[None]:
    was = get()
    set_(value)
    try:
        yield
    finally:
        set_(was)


def test_switched_off_kernels_and_determinism() -> None:
    cuda = torch.backends.cuda
    with _setting(cuda.enable_flash_sdp, cuda.flash_sdp_enabled, False):
        assert _backend(A100) == "efficient"
    with _setting(cuda.enable_cudnn_sdp, cuda.cudnn_sdp_enabled, False):
        assert _backend(H100) == "flash"
    with _setting(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled, True):
        assert _backend(H100) == "flash"  # cuDNN attention is not deterministic


def test_storage_offsets_the_efficient_kernel_cannot_align() -> None:
    q, k, v = _qkv(head=64, dtype=torch.float32)
    shifted = torch.zeros(2 * 4 * 16 * 64 + 1)[1:].view(2, 4, 16, 64)  # one element off: fp32 wants 4
    assert choose(A100, q, k, v, is_causal=True).backend == "efficient"
    assert choose(A100, shifted, k, v, is_causal=True).backend == "math"


def test_the_user_models_head_dim_decides() -> None:
    """A traced call at probe sizes (a 232-wide head) is judged at the model's own head dim through ``size``."""
    q, k, v = _qkv(head=232)
    assert choose(H100, q, k, v, is_causal=True).backend == "flash"
    own = choose(H100, q, k, v, is_causal=True, size=lambda n: 128 if n == 232 else n)
    assert (own.backend, own.why) == ("cudnn", "sm90, bf16, head dim 128")


def test_what_the_choice_names_and_refuses() -> None:
    q, k, v = _qkv(dtype=torch.float32)
    c = choose(H100, q, k, v, is_causal=True)
    assert c.backend == "efficient" and [b for b, _ in c.passed] == ["cudnn", "flash"]
    assert "fp32" in dict(c.passed)["flash"]
    q, k, v = _qkv(heads=(8, 2))
    with pytest.raises(SymacctError, match="enable_gqa"):
        choose(H100, q, k, v, is_causal=True)
    with pytest.raises(SymacctError, match="not a CUDA device|no CUDA compute capability"):
        Target.of(get("MI300X"))
    assert (Target.of(get("H200")).major, Target.of(get("H200")).minor) == (9, 0)
    with _setting(torch.backends.cuda.enable_math_sdp, torch.backends.cuda.math_sdp_enabled, False):
        with pytest.raises(SymacctError, match="no SDPA kernel"):
            _backend(A100, head=300)


def test_hardware_needs_the_cuda_device() -> None:
    import symacct
    from symacct.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    with pytest.raises(SymacctError, match="device='cuda'"):
        symacct.derive(model, hardware="H100")


def test_without_gpu_needs_a_named_gpu_on_cuda() -> None:
    """without_gpu=True derives for a named GPU as a machine without one would: without device='cuda' and
    hardware= there is nothing for it to do, and it is refused rather than ignored."""
    import symacct
    from symacct.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    with pytest.raises(SymacctError, match="needs device='cuda' and hardware="):
        symacct.derive(model, without_gpu=True)
    with pytest.raises(SymacctError, match="is not True or False"):
        symacct.derive(model, without_gpu="yes")


def test_the_note_says_whose_rules_the_choice_followed() -> None:
    """The choice reads PyTorch 2.14's rules: under 2.14 the note says so; under another release it says too
    that that release's own choice may differ (a newer one may have moved a kernel up or down)."""
    from symacct.trace.sdpa_choice import provenance

    assert provenance("2.14.1+cu130") == "as PyTorch 2.14 chooses"
    assert provenance("2.13.0+cpu") == "as PyTorch 2.14 chooses (this torch is 2.13.0+cpu: its own choice may differ)"
    assert "2.15.0" in provenance("2.15.0")


class _Attention(torch.nn.Module):
    """One causal SDPA over a fused q/k/v projection."""

    def __init__(self, D: int, H: int) -> None:
        super().__init__()
        self.D, self.H = D, H
        self.qkv = torch.nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, D)
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)  # each (B, H, S, D/H)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def test_sdpa_backend_on_the_cpu_restricts_the_cpus_choice() -> None:
    """``sdpa_backend`` on the CPU did nothing: ``"math"`` gave the flash kernel's figures while the options said
    math. Now each CPU kernel's figures equal a real step under ``sdpa_kernel`` naming it (the math composite
    keeps the probabilities, flash the output and a logsumexp row), and a CUDA-only name is refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import symacct
    from symacct.measure.run import measure_step

    def inputs(m: torch.nn.Module, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, S, m.D),)

    model = _Attention(16, 2)
    saved = {}
    for backend, kind in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION)):
        acct = symacct.derive(_Attention, dims={"D": 16, "H": 2}, inputs=inputs, sdpa_backend=backend)
        assert acct.options["sdpa_backend"] == backend
        for B, S in ((2, 8), (3, 5)):
            with sdpa_kernel([kind]):
                real = measure_step(model, inputs(model, B, S))
            model.zero_grad(set_to_none=True)
            assert acct.at(B=B, S=S).memory.activations == real.saved_bytes
        saved[backend] = acct.at(B=2, S=8).memory.activations
    assert saved["math"] != saved["flash"]
    with pytest.raises(SymacctError, match="names a CUDA kernel.*'flash'.*or 'math'"):
        symacct.derive(_Attention, dims={"D": 16, "H": 2}, inputs=inputs, sdpa_backend="efficient")
