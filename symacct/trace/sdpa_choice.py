"""Which kernel ``F.scaled_dot_product_attention`` runs on a named GPU, decided as PyTorch 2.14 decides.

PyTorch (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``) tries its kernels
in a priority order and runs the first whose constraints all hold. :func:`choose` evaluates the same
constraints from what a fake tensor knows (shapes, strides, storage offsets, dtypes, the mask, dropout,
causality, grouped-query heads, whether a gradient is wanted), from the named hardware (its compute
capability, :class:`Target`), from the cuDNN this torch loads (``torch.backends.cudnn.version()``, known
without a GPU) and from the process's settings (kernels switched off by ``torch.backends.cuda.enable_*_sdp``
or ``sdpa_kernel``, deterministic algorithms, the priority order, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``).

**Order.** ``torch._C._get_sdp_priority_order()``: flash, efficient, math, cuDNN unless changed. At its first
choice PyTorch moves cuDNN to the front when the runtime cuDNN is above 9.15.0 on compute capability 9.x or
10.x and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is not set; read in the machine code of ``select_sdp_backend`` in
the 2.14.1 CUDA 13.0 wheel (``cudnn_version > 91500``, ``major - 9 <= 1``). Here the move is made when the
order is still PyTorch's default (a process that set its own order keeps it).

**Constraints** (dense 4-D inputs; nested tensors are not modelled):

- flash: fp16 or bf16 (sm80 and up), no mask, query/key/value head dims equal and at most 256, sm80 to
  sm121; on sm86-sm89 and sm120-sm121 with a gradient a head dim at most 192 (or above 224 without dropout);
  causal only with as many queries as keys; batch sizes equal; head counts equal, or with ``enable_gqa`` key
  heads equal to value heads and dividing the query heads; no zero length; the last dimension of stride 1.
- memory-efficient: sm50 to sm121; fp16, bf16 or fp32 (no bf16 below sm80); the query's and key's head dims
  equal, the query's and value's multiples of the GEMM alignment (8 elements for 16-bit types and 4 for fp32
  on sm80 and up, as ``minimum_gemm_alignment``) and storage offsets aligned to it (sm80 and up); then the
  dense checks as flash's (the last dimension of stride 1 even for a head dim of 1).
- cuDNN: a cuDNN of 9.0 or later (the wheels are built against 9.x; no dropout on 9.11-9.13), not
  switched off, not under deterministic algorithms (unless warn-only), fp16 or bf16, a mask (if any) that
  needs no gradient and is 2-D or 4-D broadcastable to (B, H, S_q, S_k), sm80 to sm121, dropout a multiple
  of 1/16; no zero length, the last dimension of stride 1, grouped heads dividing the query heads
  (``enable_gqa``) or equal heads; batch and heads at most 65,535; head dims at most 128 (256 on sm90 and
  sm10x, but sm107 below cuDNN 9.25.0, with cuDNN above 9.22.0; 192/128 on sm90 and sm10x with cuDNN 9.11.0
  or later), multiples of 8; more than one key; with dropout more than one query; and with a gradient on a
  256-capable GPU, head dims (<=128, <=128), (192, 128) or (256, 256) for its backward.
- math: unless switched off.

Key and value head counts that differ from the query's without ``enable_gqa`` (multi-query broadcasting)
are refused: PyTorch 2.14 checks them by a rule not read here.

**Sizes.** The choice turns on head dims (and on batch, heads and lengths only at their extremes). A traced
call runs at probe sizes (a head 232 wide), so ``size`` maps a probed dimension to the user's model's value
(its config's head dim) before a rule reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from symacct.errors import SymacctError
from symacct.options import dtype_key

_HALF = (torch.float16, torch.bfloat16)
_DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")
_ENUM = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # at::SDPBackend; 4 (overrideable) is never CUDA's


@dataclass(frozen=True)
class Target:
    """The GPU the choice is made for: a catalog name and its compute capability; ``cudnn`` the runtime cuDNN
    version as ``torch.backends.cudnn.version()`` gives it (None: no cuDNN)."""

    name: str
    major: int
    minor: int
    cudnn: int | None

    @property
    def tag(self) -> str:
        return f"sm{self.major}{self.minor}"

    @classmethod
    def of(cls, hw: Any) -> Target:
        """The target of a catalog entry (``symacct.time.hardware.Accelerator``); refused for an entry that is
        not a CUDA device."""
        if hw.compute_capability is None:
            raise SymacctError(
                f"{hw.name} has no CUDA compute capability in the catalog: PyTorch's CUDA kernel choices do "
                "not apply to it",
                hint="name an NVIDIA GPU (symacct hardware), or add compute_capability to your entry",
            )
        major, minor = hw.compute_capability
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return cls(hw.name, major, minor, version)

    def between(self, low: tuple[int, int], high: tuple[int, int]) -> bool:
        return low <= (self.major, self.minor) <= high


@dataclass(frozen=True)
class Choice:
    """The kernel PyTorch runs (``backend``: flash, efficient, cudnn, math) and why: ``why`` names the
    target, dtype and head dim; ``passed`` the kernels tried before it, each with the constraint that failed."""

    backend: str
    why: str
    passed: tuple[tuple[str, str], ...]


RULES = "2.14"  # the PyTorch release whose rules ``choose`` reads


def provenance(version: str | None = None) -> str:
    """How a note names the rules a choice followed: PyTorch 2.14's, and, when the torch here is another
    release (``version``, default this one's), that its own choice may differ."""
    version = torch.__version__ if version is None else version
    mine = ".".join(version.split("+")[0].split(".")[:2])
    if mine == RULES:
        return f"as PyTorch {RULES} chooses"
    return f"as PyTorch {RULES} chooses (this torch is {version}: its own choice may differ)"


def choose(
    target: Target,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    size: Callable[[int], int] = int,
) -> Choice:
    """The kernel PyTorch 2.14 runs for this call on ``target`` (module docstring); ``size`` maps a traced
    dimension to the user's model's."""
    call = _Call(target, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, size)
    passed: list[tuple[str, str]] = []
    for backend in priority_order(target):
        failed = call.fails(backend)
        if failed is None:
            why = f"{target.tag}, {dtype_key(query.dtype)}, head dim {call.d_qk}"
            return Choice(backend, why, tuple(passed))
        passed.append((backend, failed))
    reasons = "; ".join(f"{b}: {r}" for b, r in passed)
    raise SymacctError(
        f"PyTorch has no SDPA kernel for this call on {target.name} ({reasons})",
        op="scaled_dot_product_attention",
        shapes=[tuple(query.shape), tuple(key.shape), tuple(value.shape)],
        hint="a GPU would raise 'No available kernel' here; enable the math kernel or change the call",
    )


def priority_order(target: Target) -> list[str]:
    """The order PyTorch tries the kernels in on ``target`` (module docstring)."""
    order = [_ENUM[i] for i in torch._C._get_sdp_priority_order() if i in _ENUM]
    env = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().upper()
    prefer_cudnn = env not in ("1", "ON", "YES", "TRUE", "Y") and (target.cudnn or 0) > 91500
    if prefer_cudnn and target.major in (9, 10) and tuple(order) == _DEFAULT_ORDER:
        return ["cudnn", "flash", "efficient", "math"]
    return order


class _Call:
    """One SDPA call as the constraints read it; each check returns None or the reason it fails."""

    def __init__(
        self,
        target: Target,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        dropout: float,
        causal: bool,
        gqa: bool,
        size: Callable[[int], int],
    ) -> None:
        self.t, self.q, self.k, self.v, self.mask = target, q, k, v, mask
        self.dropout, self.causal, self.gqa = dropout, causal, gqa
        self.four_d = q.dim() == k.dim() == v.dim() == 4
        self.d_qk, self.d_k, self.d_v = (size(int(t.shape[-1])) for t in (q, k, v))
        self.s_q, self.s_k = size(int(q.shape[-2])), size(int(k.shape[-2]))
        self.batches = tuple(size(int(t.shape[0])) for t in (q, k, v))
        self.heads = tuple(size(int(t.shape[-3])) for t in (q, k, v)) if self.four_d else (0, 0, 0)
        self.grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if self.four_d and self.heads[0] != self.heads[1] and not gqa:
            raise SymacctError(
                "SDPA with fewer key/value heads than query heads and no enable_gqa (multi-query broadcasting): "
                "PyTorch's kernel choice for it is not modelled",
                op="scaled_dot_product_attention",
                shapes=[tuple(q.shape), tuple(k.shape), tuple(v.shape)],
                hint="pass enable_gqa=True or repeat the key/value heads, or name the kernel with sdpa_backend=",
            )

    def fails(self, backend: str) -> str | None:
        enabled = {
            "flash": torch.backends.cuda.flash_sdp_enabled,
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
            "math": torch.backends.cuda.math_sdp_enabled,
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
        }
        if not enabled[backend]():
            return "switched off (torch.backends.cuda)"
        if backend == "math":
            return None
        if not self.four_d:
            return "query, key and value are not 4-D"
        checks = {"flash": self._flash, "efficient": self._efficient, "cudnn": self._cudnn}[backend]()
        return next((why for bad, why in checks if bad), None)

    def _dense(self, same_kv_heads: bool, singleton_ok: bool) -> list[tuple[bool, str]]:
        """The dense checks the fused kernels share: no zero length, the last dimension of stride 1, batch
        and head counts (``same_kv_heads``: key and value heads equal under enable_gqa)."""
        hq, hk, hv = self.heads
        strides_ok = all(t.stride(-1) == 1 for t in (self.q, self.k, self.v)) or (singleton_ok and self.d_qk == 1)
        if self.gqa:
            heads_ok = hq % hk == 0 and (hk == hv if same_kv_heads else hq % hv == 0)
        else:
            heads_ok = hq == hk == hv
        return [
            (self.s_q == 0 or self.s_k == 0, "a zero sequence length"),
            (not strides_ok, "the last dimension is not of stride 1"),
            (len(set(self.batches)) != 1, "batch sizes differ"),
            (not heads_ok, f"heads {hq}, {hk}, {hv} do not group"),
        ]

    def _flash(self) -> list[tuple[bool, str]]:
        t, d = self.t, self.d_qk
        if torch._C._get_fa3_sdp_enabled():
            raise SymacctError("flash attention 3 (activate_flash_attention_impl('FA3')) is not modelled")
        narrow_sm = t.between((8, 6), (8, 9)) or t.between((12, 0), (12, 1))
        head_ok = d <= 192 or (self.dropout == 0.0 and d > 224)
        return [
            (self.mask is not None, "a mask"),
            (not (d == self.d_k == self.d_v and d <= 256), f"head dims {d}, {self.d_k}, {self.d_v} (equal, <= 256)"),
            (not t.between((8, 0), (12, 1)), f"{t.tag} (sm80 to sm121)"),
            (self.grad and narrow_sm and not head_ok, f"training with head dim {d} on {t.tag}"),
            (self.causal and self.s_q != self.s_k, "causal with fewer queries than keys"),
            (not self._dtypes(_HALF), f"{self._names()} (fp16 or bf16 only)"),
            *self._dense(same_kv_heads=True, singleton_ok=True),
        ]

    def _efficient(self) -> list[tuple[bool, str]]:
        t = self.t
        half = self.q.dtype in _HALF
        tensor_cores = t.major >= 8 or (t.major >= 7 and half)
        align = max(4 if t.major >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
        heads_ok = self.d_qk == self.d_k and self.d_qk % align == 0 and self.d_v % align == 0 and self.d_v > 0
        offsets_ok = t.major < 8 or all(
            t.numel() == 0 or (t.storage_offset() * t.element_size()) % (align * t.element_size()) == 0
            for t in (self.q, self.k, self.v)
        )
        allowed = (torch.float16, torch.float32, torch.bfloat16) if t.major >= 8 else (torch.float16, torch.float32)
        return [
            (not t.between((5, 0), (12, 1)), f"{t.tag} (sm50 to sm121)"),
            (not heads_ok, f"head dims {self.d_qk}, {self.d_k}, {self.d_v} (a multiple of {align})"),
            (not offsets_ok, f"storage offsets not aligned to {align} elements"),
            *self._dense(same_kv_heads=True, singleton_ok=False),
            (not self._dtypes(allowed), f"{self._names()} (not on {t.tag})"),
        ]

    def _cudnn(self) -> list[tuple[bool, str]]:
        t, version = self.t, self.t.cudnn or 0
        deterministic = torch.are_deterministic_algorithms_enabled() and not (
            torch.is_deterministic_algorithms_warn_only_enabled()
        )
        sm90_10x = (t.major == 9 and t.minor == 0) or t.major == 10
        old_sm107 = t.major == 10 and t.minor == 7 and version <= 92500
        d256 = sm90_10x and not old_sm107 and version > 92200
        limit = 128
        if d256:
            limit = 256
        elif sm90_10x and version >= 91100 and self.d_qk == 192 and self.d_v == 128:
            limit = 192
        d_qk, d_v = self.d_qk, self.d_v
        bprop_ok = (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
        return [
            (version < 90000, f"cuDNN {version or 'absent'} (9.0 or later)"),
            (self.dropout > 0 and 91100 < version < 91400, "dropout on cuDNN 9.11-9.13"),
            (deterministic, "deterministic algorithms"),
            (not self._dtypes(_HALF), f"{self._names()} (fp16 or bf16 only)"),
            (not self._mask_shape_ok(), "the mask's shape"),
            (not t.between((8, 0), (12, 1)), f"{t.tag} (sm80 to sm121)"),
            (self.dropout * 16 != int(self.dropout * 16), "dropout not a multiple of 1/16"),
            *self._dense(same_kv_heads=False, singleton_ok=True),
            (max(self.batches[0], self.heads[0]) > 65535, "batch or heads above 65,535"),
            (not (d_qk <= limit and d_v <= limit), f"head dims {d_qk}, {d_v} (at most {limit})"),
            (d_qk % 8 != 0 or d_v % 8 != 0, f"head dims {d_qk}, {d_v} (multiples of 8)"),
            (self.s_k == 1, "one key"),
            (self.dropout != 0.0 and self.s_q == 1, "one query with dropout"),
            (self.grad and d256 and not bprop_ok, f"backward with head dims {d_qk}, {d_v}"),
        ]

    def _names(self) -> str:
        return ", ".join(sorted({dtype_key(t.dtype) for t in (self.q, self.k, self.v)}))

    def _dtypes(self, allowed: tuple[torch.dtype, ...]) -> bool:
        return self.q.dtype == self.k.dtype == self.v.dtype and self.q.dtype in allowed

    def _mask_shape_ok(self) -> bool:
        m = self.mask
        if m is None:
            return True
        if m.requires_grad:
            return False
        rows, cols = int(m.shape[-2]), int(m.shape[-1])
        if rows not in (int(self.q.shape[2]), 1) or cols not in (int(self.k.shape[2]), 1):
            return False
        if m.dim() == 2:
            return True
        return m.dim() == 4 and int(m.shape[0]) in (1, int(self.q.shape[0])) and int(m.shape[1]) in (1, self.q.shape[1])
