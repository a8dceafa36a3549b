"""Accelerator catalog: datasheet figures, each entry with its source.

Units, everywhere in symacct: FLOP/s, bytes, bytes/s. GB means 10**9 bytes
(the datasheets' and the seeds' unit); a card's nominal 80 GB is taken as
80e9 bytes (74.5 GiB). That is a conservative reading: the HBM cards hold
more. PyTorch reports a total capacity (``torch.cuda.mem_get_info()[1]``)
of 79.11 GiB on an H100 80GB HBM3 (nvidia-smi: 81,559 MiB) and 79.25 to
79.35 GiB on an A100 80GB, in public out-of-memory messages
(vllm-project/vllm#27508, huggingface/text-generation-inference#2572,
levihsu/OOTDiffusion#235, Instruction-Tuning-with-GPT-4/GPT-4-LLM#16): about
6 % above the catalog's figure, so "what fits" leaves that much unused there.
No device here has measured it (``scripts/gpu_check.sh`` prints the total
when one is lent). An entry loaded with :func:`load` can give the measured
total as ``memory_gb`` (bytes / 1e9).

Peaks are **dense** (no structured sparsity): vendors headline the
with-sparsity figure, twice the dense one, for tensor-core dtypes; that
figure is kept apart as ``sparse`` so that it can never be used as a peak.
``fp32`` is the non-tensor (vector) peak, used for elementwise work.

Users add their own entries from a JSON (or, on Python >= 3.11, TOML) file
with :func:`load`; the file holds a list of objects with the fields of
:class:`Accelerator` (``peak`` in TFLOP/s per dtype, ``memory_gb``,
``bandwidth_tbs``, ``interconnect_gbs``, ``source``; for many GPUs ``network_gbs``, ``gpus_per_node``,
``network_source``; for ``Accounting.reserved`` ``cublas_workspace`` and ``cuda_context`` in bytes (with
``cuda_context_source``); for the CUDA kernels' choices ``compute_capability`` as ``[major, minor]``).

Compute capabilities are NVIDIA's (CUDA GPUs, developer.nvidia.com/cuda-gpus): A100 8.0, H100 and H200
9.0, B200 10.0, L40S and GeForce RTX 4090 8.9; MI300X and the TPUs are not CUDA devices.

Interconnect: ``interconnect_gbs`` is the scale-up link inside a node (NVLink, one direction, per GPU);
``network_gbs`` the scale-out network between nodes, per GPU and one direction (a DGX's one 400 Gb/s
ConnectX-7 per GPU: 50 GB/s), for the ``gpus_per_node`` GPUs of the vendor's reference node. An entry
without a network figure answers for one node only (``symacct.parallel``).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from symacct.errors import SymacctError
from symacct.options import dtype_key

TERA = 10**12
GIGA = 10**9


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak: dict[str, float]  # dtype -> dense TFLOP/s ('bf16', 'fp16', 'fp8', 'tf32', 'fp32')
    memory_gb: float  # 10**9 bytes
    bandwidth_tbs: float  # memory bandwidth, 10**12 bytes/s
    interconnect_gbs: float  # per device, one direction, 10**9 bytes/s
    source: str
    sparse: dict[str, float] = field(default_factory=dict)  # the with-sparsity headline, never a peak
    aliases: tuple[str, ...] = ()
    notes: str = ""
    network_gbs: float | None = None  # per GPU between nodes, one direction, 10**9 bytes/s
    gpus_per_node: int = 1
    network_source: str = ""
    # bytes the cuBLAS workspace takes from the caching allocator at the first matmul (None: no CUDA)
    cublas_workspace: int | None = None
    # CUDA compute capability (major, minor): PyTorch chooses its SDPA kernel by it (None: not a CUDA device)
    compute_capability: tuple[int, int] | None = None
    # bytes the CUDA context and the modules loaded with it take outside the caching allocator (nvidia-smi
    # counts them, torch.cuda.max_memory_reserved does not), with where the figure comes from (None: no figure)
    cuda_context: int | None = None
    cuda_context_source: str = ""

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak in FLOP/s for ``dtype`` ('bf16', 'fp16', 'fp8', 'tf32', 'fp32')."""
        key = dtype_key(dtype)
        if key not in self.peak:
            raise SymacctError(
                f"{self.name} has no {key} peak in the catalog",
                hint=f"{self.name} lists: {', '.join(sorted(self.peak))}",
            )
        return self.peak[key] * TERA

    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_gb * GIGA))

    @property
    def bandwidth(self) -> float:
        """Memory bandwidth in bytes/s."""
        return self.bandwidth_tbs * TERA


_NV = "NVIDIA datasheet"
# PyTorch's default cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize, with
# CUBLAS_WORKSPACE_CONFIG unset; cuBLASLt shares it by default): 4096 KiB x 8 on compute capability 9.x to 12.x
# (Hopper, Blackwell), ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB) on the others. None for MI300X: on ROCm
# hipBLASLt keeps a workspace of its own beside hipBLAS's, which no run here has measured
# The CUDA context: one published measurement, PyTorch PR #86509 (CUDA 11.7, lazy module loading, the GPU not
# named): 287,047,680 bytes of device memory used (cudaMemGetInfo) after one 6.4 MB tensor, whose request the
# caching allocator serves from a 20 MiB segment (a large-pool request under 10 MiB), leaving 266,076,160 for
# the context and modules. It grows as kernels load (lazily, on first use) and differs by GPU and driver: a
# planning figure, measured on the device by scripts/gpu_check.sh (the 'CUDA context' row of its verify runs).
_CONTEXT = 287_047_680 - 20 * 2**20
_CONTEXT_SOURCE = (
    "PyTorch PR #86509 (2022): 287,047,680 B in use after one 6.4 MB tensor (CUDA 11.7, lazy loading) less its "
    "20 MiB segment, on an unnamed GPU; grows as kernels load, differs by GPU and driver"
)
_WS_HOPPER = 8 * 4096 * 1024
_WS_OTHER = 2 * 4096 * 1024 + 8 * 16 * 1024
_POD = (
    "NVIDIA DGX BasePOD reference architecture, core components: DGX H100 / H200 / B200, eight GPUs and "
    "eight single-port ConnectX-7 VPI, up to 400 Gb/s InfiniBand/Ethernet each"
)
_DGXA100 = "NVIDIA DGX A100 user guide: eight GPUs and eight single-port ConnectX-6 VPI, 200 Gb/s HDR InfiniBand"
CATALOG: dict[str, Accelerator] = {
    a.name: a
    for a in [
        Accelerator(
            "A100-SXM-80GB",
            {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
            80,
            2.039,
            300,
            f"{_NV}: A100 Tensor Core GPU (80GB SXM); NVLink 600 GB/s bidirectional",
            sparse={"bf16": 624, "fp16": 624, "tf32": 312},
            aliases=("A100", "A100-80GB", "A100-SXM"),
            notes="no FP8",
            network_gbs=25,
            gpus_per_node=8,
            network_source=_DGXA100,
            cublas_workspace=_WS_OTHER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(8, 0),
        ),
        Accelerator(
            "A100-40GB",
            {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
            40,
            1.555,
            300,
            f"{_NV}: A100 Tensor Core GPU (40GB SXM); NVLink 600 GB/s bidirectional",
            sparse={"bf16": 624, "fp16": 624, "tf32": 312},
            aliases=("A100-SXM-40GB",),
            notes="no FP8",
            network_gbs=25,
            gpus_per_node=8,
            network_source=_DGXA100,
            cublas_workspace=_WS_OTHER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(8, 0),
        ),
        Accelerator(
            "H100-SXM",
            {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 494.5, "fp32": 67},
            80,
            3.35,
            450,
            f"{_NV}: H100 Tensor Core GPU (SXM5); NVLink 900 GB/s bidirectional",
            sparse={"bf16": 1979, "fp16": 1979, "fp8": 3958, "tf32": 989},
            aliases=("H100", "H100-SXM5"),
            network_gbs=50,
            gpus_per_node=8,
            network_source=_POD,
            cublas_workspace=_WS_HOPPER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(9, 0),
        ),
        Accelerator(
            "H100-PCIe",
            {"bf16": 756, "fp16": 756, "fp8": 1513, "tf32": 378, "fp32": 51},
            80,
            2.0,
            64,
            f"{_NV}: H100 Tensor Core GPU (PCIe); PCIe Gen5 x16 128 GB/s bidirectional",
            sparse={"bf16": 1513, "fp16": 1513, "fp8": 3026, "tf32": 756},
            aliases=("H100-PCIE",),
            cublas_workspace=_WS_HOPPER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(9, 0),
        ),
        Accelerator(
            "H200",
            {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 494.5, "fp32": 67},
            141,
            4.8,
            450,
            f"{_NV}: H200 Tensor Core GPU (SXM); NVLink 900 GB/s bidirectional",
            sparse={"bf16": 1979, "fp16": 1979, "fp8": 3958, "tf32": 989},
            aliases=("H200-SXM",),
            network_gbs=50,
            gpus_per_node=8,
            network_source=_POD,
            cublas_workspace=_WS_HOPPER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(9, 0),
        ),
        Accelerator(
            "B200",
            {"bf16": 2250, "fp16": 2250, "fp8": 4500, "tf32": 1125, "fp32": 80},
            180,
            8.0,
            900,
            f"{_NV}: DGX B200 / HGX B200 (per GPU); NVLink 5 1.8 TB/s bidirectional",
            sparse={"bf16": 4500, "fp16": 4500, "fp8": 9000, "tf32": 2250},
            network_gbs=50,
            gpus_per_node=8,
            network_source=_POD,
            cublas_workspace=_WS_HOPPER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(10, 0),
        ),
        Accelerator(
            "L40S",
            {"bf16": 362, "fp16": 362, "fp8": 733, "tf32": 183, "fp32": 91.6},
            48,
            0.864,
            32,
            f"{_NV}: L40S GPU (362.05 dense / 733 sparse BF16 as printed); PCIe Gen4 x16 64 GB/s bidirectional",
            sparse={"bf16": 733, "fp16": 733, "fp8": 1466, "tf32": 366},
            cublas_workspace=_WS_OTHER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(8, 9),
        ),
        Accelerator(
            "RTX-4090",
            {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
            24,
            1.008,
            32,
            "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090); PCIe Gen4 x16",
            sparse={"bf16": 330.4, "fp16": 330.4, "tf32": 165.2},
            aliases=("4090", "RTX4090"),
            notes="bf16/fp16 with FP32 accumulate; FP8 omitted: sources disagree",
            cublas_workspace=_WS_OTHER,
            cuda_context=_CONTEXT,
            cuda_context_source=_CONTEXT_SOURCE,
            compute_capability=(8, 9),
        ),
        Accelerator(
            "MI300X",
            {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
            192,
            5.3,
            448,
            "AMD Instinct MI300X data sheet; Infinity Fabric 896 GB/s bidirectional",
            sparse={"bf16": 2614.9, "fp16": 2614.9, "fp8": 5229.8, "tf32": 1307.4},
        ),
        Accelerator(
            "TPU-v5e",
            {"bf16": 197},
            16,
            0.81,
            200,
            "Google Cloud TPU v5e documentation; ICI 1600 Gbps per chip",
            aliases=("v5e", "TPUv5e"),
        ),
        Accelerator(
            "TPU-v5p",
            {"bf16": 459},
            95,
            2.765,
            600,
            "Google Cloud TPU v5p documentation; ICI 4800 Gbps per chip",
            aliases=("v5p", "TPUv5p"),
        ),
    ]
}


def _index() -> dict[str, str]:
    out = {}
    for a in CATALOG.values():
        for n in (a.name, *a.aliases):
            out[n.lower()] = a.name
    return out


def get(name: str | Accelerator) -> Accelerator:
    """An accelerator by name or alias (case-insensitive); unknown names list the close ones."""
    if isinstance(name, Accelerator):
        return name
    key = _index().get(str(name).lower())
    if key is None:
        names = sorted(_index())
        close = difflib.get_close_matches(str(name).lower(), names, n=4, cutoff=0.4)
        close_names = sorted({_index()[c] for c in close})
        raise SymacctError(
            f"unknown hardware {name!r}",
            hint=(f"did you mean {', '.join(close_names)}? " if close_names else "")
            + f"known: {', '.join(sorted(CATALOG))}",
        )
    return CATALOG[key]


_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "amd", "instinct"}
_DROPPABLE = re.compile(r"^(\d+GB|HBM\d*E?|SXM\d*)$", re.IGNORECASE)  # memory size and type, the default form


def for_device(name: str) -> Accelerator:
    """The catalog entry of a GPU as ``torch.cuda.get_device_name`` names it.

    'NVIDIA H200' -> H200, 'NVIDIA H100 80GB HBM3' -> H100-SXM, 'NVIDIA H100 PCIe'
    -> H100-PCIe, 'NVIDIA A100-SXM4-40GB' -> A100-40GB. The longest leading run
    of the name's words that the catalog knows wins, and only words naming the
    memory (80GB, HBM3) or the SXM form may be left over: 'H200 NVL' is not
    taken for an H200 SXM, whose peaks differ. A memory size in the name must
    match the entry's.
    """
    words = [w for w in re.split(r"[\s_\-]+", name) if w and w.lower() not in _VENDOR_WORDS]
    size = next((int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w, re.IGNORECASE)), None)
    index = _index()
    for n in range(len(words), 0, -1):
        if not all(_DROPPABLE.match(w) for w in words[n:]):
            break
        key = index.get("-".join(words[:n]).lower())
        if key is None:
            continue
        entry = CATALOG[key]
        if size is None or entry.memory_gb == size:
            return entry
        same = [a for a in CATALOG.values() if a.name.lower().startswith(words[0].lower()) and a.memory_gb == size]
        if len(same) == 1:
            return same[0]
        break
    raise SymacctError(
        f"no catalog entry for the GPU {name!r}",
        hint="pass --hardware NAME (see symacct hardware), or add one with symacct.time.hardware.load",
    )


def load(path: str | Path) -> list[Accelerator]:
    """Add the accelerators of a JSON or TOML file to the catalog; returns them."""
    p = Path(path)
    try:
        text = p.read_text()
        if p.suffix == ".toml":
            import tomllib  # Python >= 3.11

            data = tomllib.loads(text).get("accelerator", [])
        else:
            data = json.loads(text)
        added = []
        for item in data:
            a = Accelerator(
                name=item["name"],
                peak={k: float(v) for k, v in item["peak"].items()},
                memory_gb=float(item["memory_gb"]),
                bandwidth_tbs=float(item["bandwidth_tbs"]),
                interconnect_gbs=float(item.get("interconnect_gbs", 0)),
                source=item["source"],
                sparse={k: float(v) for k, v in item.get("sparse", {}).items()},
                aliases=tuple(item.get("aliases", ())),
                network_gbs=float(item["network_gbs"]) if item.get("network_gbs") is not None else None,
                gpus_per_node=int(item.get("gpus_per_node", 1)),
                network_source=str(item.get("network_source", "")),
                cublas_workspace=int(item["cublas_workspace"]) if item.get("cublas_workspace") is not None else None,
                compute_capability=_capability(item.get("compute_capability")),
                cuda_context=int(item["cuda_context"]) if item.get("cuda_context") is not None else None,
                cuda_context_source=str(item.get("cuda_context_source", "")),
            )
            validate(a)
            CATALOG[a.name] = a
            added.append(a)
        return added
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise SymacctError(
            f"cannot read hardware file {str(path)!r}: {type(e).__name__}: {e}",
            hint="a JSON list of objects with name, peak (TFLOP/s per dtype), memory_gb, bandwidth_tbs, source",
        ) from e


def _capability(value: object) -> tuple[int, int] | None:
    """``[9, 0]`` or ``"9.0"`` as (9, 0); None stays None."""
    if value is None:
        return None
    parts = str(value).split(".") if isinstance(value, str | float) else list(value)  # type: ignore[call-overload]
    if len(parts) != 2:
        raise ValueError(f"compute_capability {value!r}: want [major, minor]")
    return int(parts[0]), int(parts[1])


def validate(a: Accelerator) -> None:
    """Units and sanity: positive figures, dense <= sparse, a source."""
    if not a.source:
        raise ValueError(f"{a.name}: no source")
    if a.memory_gb <= 0 or a.bandwidth_tbs <= 0 or a.interconnect_gbs < 0:
        raise ValueError(f"{a.name}: capacity and bandwidth must be positive")
    if a.gpus_per_node < 1 or (a.network_gbs is not None and a.network_gbs <= 0):
        raise ValueError(f"{a.name}: gpus_per_node and network_gbs must be positive")
    if not a.peak or any(v <= 0 for v in a.peak.values()):
        raise ValueError(f"{a.name}: peaks must be positive")
    for k, v in a.sparse.items():
        if k in a.peak and a.peak[k] > v:
            raise ValueError(f"{a.name}: dense {k} peak above the sparse one")
    if a.cuda_context is not None and (a.cuda_context < 0 or not a.cuda_context_source):
        raise ValueError(f"{a.name}: cuda_context must be a byte count with a cuda_context_source")
