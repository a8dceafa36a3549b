"""Bad input never turns into a silent wrong number: one SymacctError naming where and what to do."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from cli_run import cli
from torch import nn

import symacct
from symacct import SymacctError
from symacct.models import GPT2, GPT2Config


@dataclass
class PaddedConfig:
    vocab_size: int = 50257
    n_embd: int = 16


class PaddedVocab(nn.Module):
    """Pads the vocabulary to a multiple of 64 in __init__: not a product of symbols."""

    def __init__(self, config: PaddedConfig) -> None:
        super().__init__()
        self.config = config
        padded = (config.vocab_size + 63) // 64 * 64
        self.emb = nn.Embedding(padded, config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, self.config.vocab_size, (B, S)),)


def test_padded_vocab_is_refused_naming_the_module():
    with pytest.raises(SymacctError) as e:
        symacct.derive(PaddedVocab(PaddedConfig()))
    msg = str(e.value)
    assert ("not a product" in msg or "not the product" in msg) and "aten.embedding" in msg
    assert e.value.module == "emb"


@dataclass
class BranchConfig:
    n_embd: int = 8


class DataDependent(nn.Module):
    def __init__(self, config: BranchConfig) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # depends on values
            y = y * 2
        return y.sum()

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
        return (torch.randn(B, self.config.n_embd),)


def test_data_dependent_control_flow_is_refused():
    with pytest.raises(SymacctError, match="depends on tensor values"):
        symacct.derive(DataDependent(BranchConfig()))


class Sorts(DataDependent):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.i0(self.lin(x)).sum()


def test_op_without_rule_fails_strict_and_is_listed_otherwise(monkeypatch):
    from symacct.cost.rules import registry

    # pretend the pointwise family has no rule: i0 then has none
    monkeypatch.setattr(registry, "_BY_TAG", {})
    with pytest.raises(SymacctError, match="no cost rule for aten.special_i0|no cost rule for aten.i0") as e:
        symacct.derive(Sorts(BranchConfig()))
    assert e.value.module == "" and e.value.op is not None
    acct = symacct.derive(Sorts(BranchConfig()), strict=False)
    assert any("i0" in u for u in acct.unaccounted)


def test_model_without_example_inputs():
    class NoInputs(nn.Module):
        def __init__(self, config: BranchConfig) -> None:
            super().__init__()
            self.config = config
            self.lin = nn.Linear(config.n_embd, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    with pytest.raises(SymacctError, match="example_inputs"):
        symacct.derive(NoInputs(BranchConfig()))
    acct = symacct.derive(NoInputs(BranchConfig()), inputs=lambda m, B, S: (torch.randn(B, m.config.n_embd),))
    assert acct.at(B=3).flops.forward == 2 * 3 * 8 * 1  # 2*B*D*1


def test_inputs_that_fail_to_build():
    with pytest.raises(SymacctError, match="could not build the inputs"):
        symacct.derive(GPT2(GPT2Config(n_layer=1, n_embd=8, n_head=2)), inputs=lambda B, S: 1 / 0)


def test_output_that_is_not_a_loss():
    with pytest.raises(SymacctError, match="not a scalar loss"):
        symacct.derive(
            GPT2(GPT2Config(n_layer=1, n_embd=8, n_head=2)),
            inputs=lambda m, B, S: (torch.zeros(B, S, dtype=torch.long),),
        )


def test_at_rejects_missing_and_unknown_symbols():
    acct = symacct.derive(GPT2(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, block_size=8)))
    with pytest.raises(SymacctError, match="no value for B, S"):
        acct.at()
    with pytest.raises(SymacctError, match="unknown symbol"):
        acct.at(B=1, S=2, Q=3)
    with pytest.raises(SymacctError, match="positive integer"):
        acct.at(B=0, S=2)


_GLOBAL_BIAS = torch.ones(1)


class _UsesGlobal(nn.Module):
    def __init__(self, n_embd: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + _GLOBAL_BIAS).sum()  # a real tensor from outside the module


def test_a_real_tensor_in_the_step_is_named_with_what_to_do():
    with pytest.raises(SymacctError) as e:
        symacct.derive(_UsesGlobal, dims={"n_embd": 8}, inputs=lambda m, B, S: (torch.randn(B, m.lin.in_features),))
    assert "real tensor" in str(e.value) and "registered buffer" in str(e.value)
    assert e.value.op == "aten.add.Tensor"


def test_a_typed_in_size_is_named_and_torch_logs_nothing(capfd):
    with pytest.raises(SymacctError) as e:
        symacct.derive(_UsesGlobal, dims={"n_embd": 8}, inputs=lambda B, S: (torch.randn(B, 8),))
    assert e.value.module == "lin" and "typed in" in str(e.value)
    assert capfd.readouterr().err == ""  # fake tensors' own traceback log is silenced


def test_differing_blocks_are_left_unfactored():
    @dataclass
    class Cfg:
        n_layers: int = 3
        dim: int = 8

    class Growing(nn.Module):
        """Block i has i+1 linears: the blocks are not identical."""

        def __init__(self, config: Cfg) -> None:
            super().__init__()
            self.config = config
            self.blocks = nn.ModuleList(
                nn.Sequential(*[nn.Linear(config.dim, config.dim) for _ in range(i + 1)])
                for i in range(config.n_layers)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x.sum()

        def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor]:
            return (torch.randn(B, self.config.dim),)

    acct = symacct.derive(Growing(Cfg()))
    assert "unfactored" in acct.notes[0]
    assert "L" not in acct.free_symbols()
    # 1 + 2 + 3 linears, each 2*B*D*D forward
    assert acct.at(B=5).flops.forward == 6 * 2 * 5 * 8 * 8


@pytest.mark.parametrize(
    "args,needle",
    [
        (["derive", "gtp2"], "did you mean gpt2"),
        (["derive", "gpt2", "--config", "n_layer"], "KEY=VALUE"),
        (["derive", "gpt2", "--config", "n_lyer=3"], "did you mean n_layer"),
        (["derive", "no_such_module:factory"], "cannot import"),
        (["derive", "gpt2", "--batch", "0"], "positive"),
    ],
)
def test_cli_errors_are_one_line_exit_2(args, needle):
    proc = cli(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
@pytest.mark.parametrize("cmd", [["hardware"], ["derive", "gpt2", "--config", "n_layer=2", "--seq", "16"]])
def test_a_closed_pipe_ends_the_cli_quietly(cmd):
    """`symacct ... | head` closes the pipe early: no traceback on stderr."""
    p = subprocess.Popen(
        [sys.executable, "-m", "symacct.cli", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    p.stdout.close()  # the reader is gone before the first line is written
    err = p.stderr.read()
    assert p.wait() == 1 and "Traceback" not in err and "Exception ignored" not in err, err


class Selects(DataDependent):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.masked_select(y > 0).sum()  # as many elements as are positive


def test_an_output_shape_set_by_values_is_refused_as_such():
    """Before, refused as "the op failed on fake tensors", with a hint about sizes typed in."""
    with pytest.raises(SymacctError, match="depends on tensor values: aten.masked_select") as e:
        symacct.derive(Selects(BranchConfig()))
    assert "torch.where" in e.value.hint


class Lerps(DataDependent):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.lerp(self.lin(x), x, 0.3).sum()  # under autocast: a bf16 start, a float32 end


def test_an_op_refusing_its_dtypes_is_refused_as_eager_refuses_it():
    """Before, with a hint about sizes typed in; eager PyTorch refuses the same step."""
    model = Lerps(BranchConfig())
    with pytest.raises(RuntimeError, match="expected dtype"), torch.autocast("cpu", dtype=torch.bfloat16):
        model(*model.example_inputs(2, 3))
    with pytest.raises(SymacctError, match="refuses its arguments' dtypes") as e:
        symacct.derive(model, autocast="bf16")
    assert "one dtype" in e.value.hint
