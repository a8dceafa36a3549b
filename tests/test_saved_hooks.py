"""A model that sets saved-tensor hooks of its own (``symacct.trace.saved``): what they keep is counted.

symacct counts saved tensors through hooks of its own, which a model's hooks replace where they are set: the
saved bytes of a model whose blocks run under ``torch.autograd.graph.save_on_cpu`` came out at 3,700 where
19,828 are saved (B=2, S=7), on derive's side and on the measuring side alike, so the comparison passed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from real_step import POINTS, exact_against_a_real_step
from torch import nn

import symacct
from symacct.errors import SymacctError
from symacct.measure.run import measure_step
from symacct.trace.record import record_step


@dataclasses.dataclass
class HookedConfig:
    vocab: int = 50
    width: int = 16
    n_layers: int = 2
    everywhere: bool = False  # the whole step under the hooks, not the blocks only


class Hooked(nn.Module):
    """Embedding, ``n_layers`` MLP blocks with residuals, a head and cross-entropy; ``hooks()`` returns the
    saved-tensor hooks the blocks run under (none: a plain model), or the whole step (``config.everywhere``)."""

    def __init__(self, config: HookedConfig) -> None:
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.width)
        W = config.width
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W)) for _ in range(config.n_layers)]
        )
        self.out = nn.Linear(W, config.vocab)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks | None:
        return None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        outer = self.hooks() if self.config.everywhere else None
        if outer is not None:
            with outer:
                return self.step(x, y, lambda: None)
        return self.step(x, y, self.hooks)

    def step(self, x: torch.Tensor, y: torch.Tensor, hooks) -> torch.Tensor:  # noqa: ANN001
        h = self.emb(x)  # (B, S, W)
        for block in self.blocks:
            with hooks() or _nothing():
                h = h + block(h)  # (B, S, W)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        V = self.config.vocab
        return torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class OnCpu(Hooked):
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.save_on_cpu()


class Halved(Hooked):
    """Keeps a float16 copy of every float32 tensor of two or more dimensions it is given to save, and tallies
    what it keeps (the storages it returns, less the parameters' and inputs'): an independent count."""

    kept: dict[int, int]
    external: set[int]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            out = t.to(torch.float16) if t.dtype == torch.float32 and t.dim() > 1 else t
            st = out.untyped_storage()
            if getattr(self, "kept", None) is not None and st.data_ptr() not in self.external:
                self.kept[st.data_ptr()] = st.nbytes()
            return out

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.float32) if t.dtype == torch.float16 else t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def test_activations_offloaded_on_the_cpu_are_the_plain_models() -> None:
    """On the CPU, ``save_on_cpu`` keeps each tensor as it is: the saved bytes are the plain model's, as
    PyTorch's hooks count them on a real step of the plain model."""
    torch.manual_seed(0)
    model = OnCpu(HookedConfig())
    acct = symacct.derive(model, optimizer="adamw")
    plain = Hooked(HookedConfig())
    plain.load_state_dict(model.state_dict())
    for B, S in POINTS:
        assert acct.at(B=B, S=S).memory.activations == measure_step(plain, plain.example_inputs(B, S)).saved_bytes
    exact_against_a_real_step(model, acct)


def test_what_compressing_hooks_keep_is_their_own_tally() -> None:
    torch.manual_seed(0)
    model = Halved(HookedConfig(everywhere=True))
    acct = symacct.derive(model, optimizer="adamw")
    for B, S in POINTS:
        args = model.example_inputs(B, S)
        model.kept, model.external = {}, {t.untyped_storage().data_ptr() for t in [*model.parameters(), *args]}
        model(*args).backward()
        model.zero_grad(set_to_none=True)
        kept, model.kept = sum(model.kept.values()), None  # type: ignore[assignment]
        assert acct.at(B=B, S=S).memory.activations == kept
    exact_against_a_real_step(model, acct)


class Offloaded(Hooked):
    """Keeps what it saves on another device (the meta device here, standing for the CPU of a CUDA step)."""

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: (t.device, t.to("meta")), lambda p: torch.empty_like(p[1], device=p[0])
        )


@pytest.mark.parametrize("python_engine", [False, True])
def test_hooks_that_keep_another_devices_tensors_or_that_the_python_engine_cannot_release_are_refused(
    python_engine: bool,
) -> None:
    def build(fake):  # noqa: ANN001, ANN202
        with fake:
            return (OnCpu if python_engine else Offloaded)(HookedConfig())

    want = "Python autograd engine" if python_engine else "keep a saved tensor on meta"
    with pytest.raises(SymacctError, match=want):
        record_step(build, lambda m: m.example_inputs(2, 5), python_engine=python_engine)
