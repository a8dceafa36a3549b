"""Bad and edge inputs through the CLI and the API, as a hostile but realistic user would type them.

Each case must end in one of two ways: a right answer (the case says what it must be), or a refusal
(a SymacctError from the API; on the CLI exit code 2 with one line on stderr and nothing on stdout).
Anything else is a BAD row: a traceback, another exception type, a wrong exit code, or a figure where a
refusal was due. Run on demand: ``python scripts/hostile.py`` (a minute or two: each CLI case is a
process); it prints one row per case and exits 1 if any row is BAD.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Refuse(str):
    """A refusal, and what its message must hold (the CLI's one line on stderr, the SymacctError's text): a case
    refused for another reason than the one it stands for is a BAD row, not a pass."""


def cli_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv, expect): expect is a Refuse, or a substring the output must hold with exit 0."""
    binary = tmp / "binary.jsonl"
    binary.write_bytes(b"\x89PNG\x00\xff\xfe")
    utf16 = tmp / "utf16.jsonl"
    utf16.write_bytes('{"header": true, "run": "a", "model": "M"}\n'.encode("utf-16"))
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    good = tmp / "good.jsonl"
    good.write_text('{"header": true, "run": "b", "model": "M"}\n{"phase": "p", "allocated": 1, "peak": 1}\n')
    small = ["--config", "n_layer=2"]
    d = ["derive", "gpt2", *small]
    e = ["estimate", "--params", "7e9", "--tokens", "1e12", "--hardware", "H100"]
    return [
        ("batch 0", [*d, "--batch", "0"], Refuse("--batch and --seq must be positive integers")),
        ("batch -1", [*d, "--batch", "-1"], Refuse("--batch and --seq must be positive integers")),
        ("batch 1.5", [*d, "--batch", "1.5"], Refuse("argument --batch: invalid int value")),
        ("seq beyond S_max", [*d, "--seq", "2048"], Refuse("S=2048, S_max=1024 breaks S <= S_max")),
        ("seq 0", [*d, "--seq", "0"], Refuse("--batch and --seq must be positive integers")),
        ("config abc", ["derive", "gpt2", "--config", "n_layer=abc"], Refuse("n_layer is an integer")),
        ("config 2.5", ["derive", "gpt2", "--config", "n_layer=2.5"], Refuse("n_layer is an integer")),
        ("config 0 layers", ["derive", "gpt2", "--config", "n_layer=0"], Refuse("L=0 is not a positive integer")),
        ("config -1 layers", ["derive", "gpt2", "--config", "n_layer=-1"], Refuse("n_layer = -1")),
        ("config 1e3", ["derive", "gpt2", "--config", "n_embd=1e3"], Refuse("n_embd is an integer")),
        ("config dropout abc", ["derive", "gpt2", "--config", "dropout=abc"], Refuse("dropout is a number")),
        ("config n_head 5", ["derive", "gpt2", "--config", "n_head=5"], Refuse("config.n_embd % config.n_head == 0")),
        ("config no value", ["derive", "gpt2", "--config", "n_layer="], Refuse("--config expects KEY=VALUE")),
        (
            "config unknown",
            ["derive", "gpt2", "--config", "n_layers=2"],
            Refuse("no config field 'n_layers'; did you mean n_layer?"),
        ),
        ("config tie no", [*d, "--config", "tie_weights=no", "--json"], '"params"'),
        ("config tie maybe", [*d, "--config", "tie_weights=maybe"], Refuse("tie_weights is a bool")),
        ("model unknown", ["derive", "gtp2"], Refuse("unknown model 'gtp2'; did you mean gpt2?")),
        ("model import", ["derive", "nosuch.mod:make"], Refuse("No module named 'nosuch'")),
        ("factory needs args", ["derive", "json:loads"], Refuse("missing 1 required positional argument")),
        ("factory not a module", ["derive", "os:getcwd"], Refuse("returned str, not an nn.Module")),
        ("optimizer unknown", [*d, "--optimizer", "adamx"], Refuse("unknown optimizer 'adamx'")),
        (
            "estimate params nan",
            ["estimate", "--params", "nan", "--tokens", "1e12", "--hardware", "H100"],
            Refuse("--params: must be a finite non-negative number: 'nan'"),
        ),
        (
            "estimate params inf",
            ["estimate", "--params", "inf", "--tokens", "1e12", "--hardware", "H100"],
            Refuse("--params: must be a finite non-negative number: 'inf'"),
        ),
        (
            "estimate inf json",
            ["estimate", "--params", "inf", "--tokens", "1", "--hardware", "H100", "--json"],
            Refuse("--params: must be a finite non-negative number: 'inf'"),
        ),
        (
            "estimate tokens -1",
            ["estimate", "--params", "7e9", "--tokens", "-1", "--hardware", "H100"],
            Refuse("--tokens: must be a finite non-negative number: '-1'"),
        ),
        ("estimate gpus 0", [*e, "--gpus", "0"], Refuse("--gpus: must be a positive whole number: '0'")),
        ("estimate gpus 1.5", [*e, "--gpus", "1.5"], Refuse("--gpus: must be a positive whole number: '1.5'")),
        ("estimate gpus -8", [*e, "--gpus", "-8"], Refuse("--gpus: must be a positive whole number: '-8'")),
        ("estimate mfu 2", [*e, "--mfu", "2"], Refuse("MFU must be in (0, 1], got 2.0")),
        ("estimate mfu 0", [*e, "--mfu", "0"], Refuse("MFU must be in (0, 1], got 0.0")),
        (
            "estimate hardware",
            ["estimate", "--params", "7e9", "--tokens", "1e12", "--hardware", "Z9"],
            Refuse("unknown hardware 'Z9'"),
        ),
        ("estimate dtype fp64", [*e, "--dtype", "fp64"], Refuse("no fp64 peak in the catalog")),
        (
            "estimate fp8 on A100",
            ["estimate", "--params", "7e9", "--tokens", "1", "--hardware", "A100", "--dtype", "fp8"],
            Refuse("no fp8 peak in the catalog"),
        ),  # fmt: skip
        (
            "estimate no params",
            ["estimate", "--tokens", "1e12", "--hardware", "H100"],
            Refuse("estimate needs --params"),
        ),
        (
            "estimate model seq",
            ["estimate", "gpt2", *small, "--tokens", "1e9", "--hardware", "H100", "--seq", "4096"],
            Refuse("S=4096, S_max=1024 breaks S <= S_max"),
        ),  # fmt: skip
        (
            "fit gpus 0",
            ["fit", "--hardware", "H100", "--gpus", "0"],
            Refuse("--gpus: must be a positive whole number: '0'"),
        ),
        ("fit reserve 1", ["fit", "--hardware", "H100", "--reserve", "1"], Refuse("reserve must be in [0, 1), got 1")),
        ("fit optimizer", ["fit", "--hardware", "H100", "--optimizer", "nosuch"], Refuse("unknown optimizer 'nosuch'")),
        (
            "fit layout nothing fits",
            [
                "fit",
                "gpt2",
                *small,
                "--hardware",
                "H100",
                "--seq",
                "16",
                "--pp",
                "2",
                "--micro-batches",
                "2",
                "--reserve",
                "0.9999999",
            ],
            Refuse("nothing fits: B=1 already needs"),
        ),
        (
            "serve int4",
            ["serve", "gpt2", *small, "--hardware", "H100", "--context", "64", "--weight-bits", "4"],
            "int4",
        ),
        (
            "serve llama MHA",
            ["serve", "llama", "--config", "n_layers=2", "--hardware", "H100", "--context", "64"],
            "fp32",
        ),
        (
            "fit seq raises S_max",
            ["fit", "gpt2", *small, "--hardware", "H100", "--solve", "seq", "--batch", "1", "--json"],
            "S_max raised",
        ),  # fmt: skip
        ("sheet batch 0", ["sheet", "gpt2", "--batch", "0"], Refuse("--batch and --seq must be positive integers")),
        ("sheet mfu 0", ["sheet", "gpt2", "--mfu", "0"], Refuse("--mfu must be in (0, 1], got 0")),
        ("sheet out unwritable", ["sheet", "cruncher", "--out", str(binary / "x")], Refuse("cannot write to --out")),
        ("verify steps 0", ["verify", "cruncher", "--steps", "0"], Refuse("--steps must be at least 1, got 0")),
        ("diff binary", ["diff", str(binary), str(good)], Refuse("not UTF-8 text")),
        ("diff utf16", ["diff", str(utf16), str(good)], Refuse("not UTF-8 text")),
        ("diff empty", ["diff", str(empty), str(good)], Refuse("no symacct header line")),
        ("diff missing", ["diff", str(tmp / "missing"), str(good)], Refuse("cannot read log")),
    ]


def api_cases() -> list[tuple[str, Callable[[], Any], Any]]:
    """(name, thunk, expect): expect is a Refuse, or a predicate on the result."""
    import numpy as np
    import torch
    from torch import nn

    import symacct
    from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig
    from symacct.time.model import fit

    small = GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, block_size=16)
    g = symacct.derive(GPT2(small))
    lcfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, hidden_dim=48, max_seq_len=16)
    llama = symacct.derive(Llama(lcfg))
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())

    def ids(m: Any, B: int, S: int) -> tuple[Any, ...]:
        return (torch.zeros(B, S, dtype=torch.long),)

    def in_no_grad() -> Any:
        with torch.no_grad():
            return symacct.derive(GPT2(small)).flops.total

    def in_autocast() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return symacct.derive(GPT2(small)).memory.peak

    def hooks_disabled() -> Any:
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            return symacct.derive(GPT2(small)).memory.peak

    def in_saved_hooks() -> Any:
        with torch.autograd.graph.save_on_cpu():
            return symacct.derive(GPT2(small)).memory.peak

    def in_anomaly_mode() -> Any:
        with torch.autograd.detect_anomaly(check_nan=True):
            return symacct.derive(GPT2(small)).memory.peak

    mask32 = torch.ones(32, 32, dtype=torch.bool).tril()  # (S_max, S_max) is (16, 16) in the config's model
    from symacct.time.serving import serve

    two = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=16)
    prefill = symacct.derive(GPT2(small), step="prefill")
    wide_decode = symacct.derive(
        GPT2(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=32, block_size=16)), step="decode"
    )

    def one_head_a_rank() -> Any:  # H == tp: the rank's FLOPs are the model's over tp
        rank = symacct.derive(GPT2(two), tensor_parallel="megatron", tp=2).at(B=2, S=8, tp=2).flops.total
        return rank * 2 == symacct.derive(GPT2(two)).at(B=2, S=8).flops.total

    layer = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True)
    encoder = nn.Sequential(nn.Embedding(32, 16), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))

    def tokens(B: int, S: int) -> tuple[Any, ...]:
        return (torch.zeros(B, S, dtype=torch.long),)

    class ByParity(nn.Module):  # one more Linear at an even length: the path turns on S's parity
        def __init__(self, width: int) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x: Any) -> Any:  # x (B, S, width)
            h = self.a(x)
            return (self.b(h) if x.shape[1] % 2 == 0 else h).sum()

    @dataclasses.dataclass
    class LengthConfig:
        width: int = 8
        n_positions: int = 2048  # S_max
        short: int = 0  # > 0: one more Linear up to this many positions (a branch below the probes' lengths)
        batch: int = 0  # > 0: one more Linear up to this batch size (a branch below the probes' batch sizes)
        large: int = 0  # > 0: one more Linear past this batch size (a branch above the probes' batch sizes)

    class ByLength(nn.Module):  # one more Linear past 1,000 positions: the path turns on S's value
        def __init__(self, config: LengthConfig) -> None:
            super().__init__()
            self.config = config
            self.pos = nn.Embedding(config.n_positions, config.width)
            self.a, self.b = nn.Linear(config.width, config.width), nn.Linear(config.width, config.width)

        def forward(self, x: Any) -> Any:  # x (B, S, width)
            h = self.a(x + self.pos(torch.arange(x.shape[1])))
            if self.config.short:
                return (self.b(h) if x.shape[1] <= self.config.short else h).sum()
            if self.config.batch:
                return (self.b(h) if x.shape[0] <= self.config.batch else h).sum()
            if self.config.large:
                return (self.b(h) if x.shape[0] > self.config.large else h).sum()
            return (self.b(h) if x.shape[1] > 1000 else h).sum()

    def by_length() -> Any:
        model = ByLength(LengthConfig())
        return symacct.derive(model, inputs=lambda m, B, S: (torch.randn(B, S, m.config.width),))

    def by_short_length() -> Any:
        model = ByLength(LengthConfig(short=32))
        acct = symacct.derive(model, inputs=lambda m, B, S: (torch.randn(B, S, m.config.width),))
        return acct.at(B=2, S=8).flops.total

    def by_small_batch(batch: int) -> Callable[[], Any]:
        def run() -> Any:
            model = ByLength(LengthConfig(batch=batch))
            acct = symacct.derive(model, inputs=lambda m, B, S: (torch.randn(B, S, m.config.width),))
            return acct.at(B=batch, S=8).flops.total

        return run

    def by_large_batch(fits: bool = False) -> Callable[[], Any]:
        def run() -> Any:
            model = ByLength(LengthConfig(large=256))
            acct = symacct.derive(model, inputs=lambda m, B, S: (torch.randn(B, S, m.config.width),))
            if fits:
                got = fit(acct, "B", hardware="H100-SXM", S=8)
                return got.value, got.next_peak_bytes
            return acct.at(B=300, S=8).flops.total

        return run

    class EinsumAttention(nn.Module):  # one head in einsum, which runs no bmm where the sizes it keeps are 1
        def __init__(self, width: int) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x: Any) -> Any:  # x (B, S, width)
            scores = torch.einsum("bsd,btd->bst", self.q(x), self.k(x)).softmax(-1)  # (B, S, S)
            return torch.einsum("bst,btd->bsd", scores, x).sum()  # (B, S, width)

    def einsum_at_one() -> Any:
        acct = symacct.derive(EinsumAttention, dims={"width": 8}, inputs=lambda m, B, S: (torch.randn(B, S, 8),))
        return acct.at(B=2, S=1).flops.total

    def by_parity() -> Any:
        return symacct.derive(ByParity, dims={"width": 8}, inputs=lambda m, B, S: (torch.randn(B, S, m.a.in_features),))

    def changed(how: Callable[[Any], Any]) -> Callable[[], Any]:
        def run() -> Any:
            model = GPT2(small)
            how(model)
            return symacct.derive(model).at(B=2, S=8).memory.peak

        return run

    return [
        ("derive an int", lambda: symacct.derive(123), Refuse("expected an nn.Module, got int")),
        (
            "derive optimizer instance",
            lambda: symacct.derive(GPT2(small), optimizer=opt),
            Refuse("optimizer= got a AdamW instance"),
        ),
        ("derive step eval", lambda: symacct.derive(GPT2(small), step="eval"), Refuse("unknown step 'eval'")),
        (
            "derive autocast fp8",
            lambda: symacct.derive(GPT2(small), autocast="fp8"),
            Refuse("autocast='fp8' is not a dtype name"),
        ),
        (
            "derive autocast fp32",
            lambda: symacct.derive(GPT2(small), autocast=torch.float32),
            Refuse("autocast=torch.float32 is no autocast"),
        ),
        (
            "derive params int8",
            lambda: symacct.derive(GPT2(small), params_dtype=torch.int8),
            Refuse("params_dtype=torch.int8 is not a floating dtype"),
        ),
        (
            "derive device cuda",
            lambda: symacct.derive(GPT2(small), device="cuda"),
            Refuse("device='cuda' needs the CUDA build of torch"),
        ),
        ("derive fixed typo", lambda: symacct.derive(GPT2(small), fixed=["n_layr"]), Refuse("fixed= names n_layr")),
        (
            "derive dims 0",
            lambda: symacct.derive(lambda D: nn.Linear(D, D), dims={"D": 0}),
            Refuse("dims={'D': 0}: a size must be a positive integer"),
        ),
        (
            "derive dims float",
            lambda: symacct.derive(lambda D: nn.Linear(D, D), dims={"D": 2.5}),
            Refuse("dims={'D': 2.5}: a size must be a positive integer"),
        ),
        (
            "derive inputs dict",
            lambda: symacct.derive(GPT2(small), inputs=lambda B, S: {"x": 1}),
            Refuse("missing a required argument: 'idx'"),
        ),
        (
            "derive loss not scalar",
            lambda: symacct.derive(GPT2(small), loss=lambda o: o * 2, inputs=ids),
            Refuse("the step's output is not a scalar loss"),
        ),
        (
            "derive embedding_flops x",
            lambda: symacct.derive(GPT2(small), embedding_flops="x"),
            Refuse("unknown embedding_flops 'x'"),
        ),
        (
            "derive unknown option",
            lambda: symacct.derive(GPT2(small), optimiser="adamw"),
            Refuse("unexpected keyword argument 'optimiser'"),
        ),
        (
            "derive compiled",
            lambda: symacct.derive(torch.compile(GPT2(small))),
            Refuse("the model is a torch.compile wrapper"),
        ),
        (
            "derive a factory's compiled model",
            lambda: symacct.derive(
                lambda L: torch.compile(GPT2(dataclasses.replace(small, n_layer=L))),
                dims={"L": 2},
                inputs=lambda m, B, S: (torch.zeros(B, S, dtype=torch.long),),
            ),
            Refuse("the model the factory builds is a torch.compile wrapper"),
        ),
        ("derive in no_grad", in_no_grad, lambda v: v == g.flops.total),
        (
            "derive mask longer",
            changed(lambda m: setattr(m.blocks[0].attn, "mask", mask32)),
            Refuse("buffer blocks.0.attn.mask is (32, 32) in the given model and (16, 16)"),
        ),
        (
            "derive unused buffer",
            changed(lambda m: m.register_buffer("extra", torch.zeros(99))),
            Refuse("the given model has a buffer extra"),
        ),
        (
            "derive heads set",
            changed(lambda m: setattr(m.blocks[1].attn, "n_head", 8)),
            Refuse("(331, 8, 15, 15) in the given model and (331, 4, 15, 15)"),
        ),
        (
            "derive hook added",
            changed(lambda m: m.blocks[0].register_forward_hook(lambda *a: None)),
            Refuse("has a forward hook on blocks.0"),
        ),
        (
            "derive layers cut",
            changed(lambda m: setattr(m, "blocks", m.blocks[:1])),
            Refuse("has 1 blocks where its config's n_layer = 2 builds 2"),
        ),
        (
            "serve two models",
            lambda: serve(prefill, wide_decode, hardware="H100-SXM", context=8),
            Refuse("not of the same model (sizes differ: L=2 and 3, D=16 and 32)"),
        ),
        ("tp one head a rank", one_head_a_rank, lambda v: v is True),
        (
            "derive fused inference path",
            lambda: symacct.derive(encoder, step="forward", inputs=tokens),
            Refuse("PyTorch's fused inference path of nn.TransformerEncoderLayer"),
        ),
        ("derive inside autocast", in_autocast, Refuse("derive was called inside torch.autocast")),
        ("derive parity branch", by_parity, Refuse("does not predict a second trace at other sizes (B = 53, S = 74")),
        ("derive length branch", by_length, Refuse("takes another path at S = 2047")),
        ("at below a short length branch", by_short_length, Refuse("S=8 breaks 33 <= S")),
        ("at below a small batch branch", by_small_batch(8), Refuse("B=8 breaks 9 <= B")),
        ("at B 1 on a B == 1 branch", by_small_batch(1), Refuse("B=1 breaks 2 <= B")),
        ("at above a large batch branch", by_large_batch(), Refuse("B=300 breaks B <= 256")),
        ("at S 1 on an einsum attention", einsum_at_one, Refuse("S=1 breaks 2 <= S")),
        ("fit B on a large batch branch", by_large_batch(fits=True), lambda v: v == (256, None)),
        ("derive in anomaly mode", in_anomaly_mode, lambda v: v == g.memory.peak),
        ("derive saved hooks disabled", hooks_disabled, Refuse("saved-tensor hooks are disabled")),
        (
            "derive inside save_on_cpu",
            in_saved_hooks,
            Refuse("derive was called inside saved-tensor hooks the caller set"),
        ),
        ("at B 10**30", lambda: g.at(B=10**30, S=8).flops.total, lambda v: v == 10**30 * g.at(B=1, S=8).flops.total),
        ("at B 0", lambda: g.at(B=0, S=8), Refuse("B=0 is not a positive integer")),
        ("at B 1.5", lambda: g.at(B=1.5, S=8), Refuse("B=1.5 is not a positive integer")),
        ("at B True", lambda: g.at(B=True, S=8), Refuse("B=True is not a positive integer")),
        ("at B nan", lambda: g.at(B=math.nan, S=8), Refuse("B=nan is not a positive integer")),
        ("at S beyond S_max", lambda: g.at(B=1, S=4096), Refuse("S=4096, S_max=16 breaks S <= S_max")),
        ("at H 5", lambda: g.at(B=1, S=8, H=5), Refuse("D=16, H=5 breaks H divides D")),
        ("at H_kv 3", lambda: llama.at(B=1, S=8, H_kv=3), Refuse("H=4, H_kv=3 breaks H_kv divides H")),
        ("at L 0", lambda: g.at(B=1, S=8, L=0), Refuse("L=0 is not a positive integer")),
        ("at field name", lambda: g.at(B=1, S=8, n_layer=4), Refuse("n_layer is the config field of L")),
        ("at unknown", lambda: g.at(B=1, S=8, Q=4), Refuse("unknown symbol(s) Q")),
        ("at numpy int", lambda: g.at(B=np.int64(2), S=8).flops.total, lambda v: v == g.at(B=2, S=8).flops.total),
        ("peak beyond S_max", lambda: g.peak(B=1, S=64), Refuse("S=64, S_max=16 breaks S <= S_max")),
        ("steady B 0", lambda: g.steady(B=0, S=8), Refuse("B=0 is not a positive integer")),
        (
            "sweep field name",
            lambda: g.sweep("flops.total", n_layer=np.array([24, 48]), B=1, S=8),
            Refuse("n_layer is the config field of L"),
        ),
        (
            "sweep B negative",
            lambda: g.sweep("flops.total", B=np.array([-1, 2]), S=8),
            Refuse("B=-1 is not a positive integer"),
        ),
        (
            "sweep B 1.5",
            lambda: g.sweep("flops.total", B=np.array([1.5]), S=8),
            Refuse("B=1.5 is not a positive integer"),
        ),
        (
            "sweep lengths",
            lambda: g.sweep("flops.total", B=np.array([1, 2]), S=np.array([2, 4, 8])),
            Refuse("the size arrays do not broadcast together (B: (2,), S: (3,))"),
        ),
        (
            "sweep S beyond",
            lambda: g.sweep("flops.total", B=1, S=np.array([8, 64])),
            Refuse("S=64, S_max=16 breaks S <= S_max"),
        ),
        ("sweep unknown name", lambda: g.sweep("flops.nope", B=1, S=8), Refuse("no formula called 'flops.nope'")),
        (
            "estimate tokens nan",
            lambda: symacct.estimate(params=1e9, tokens=math.nan, hardware="H100"),
            Refuse("tokens must be a finite positive number, got nan"),
        ),
        (
            "estimate tokens inf",
            lambda: symacct.estimate(params=1e9, tokens=math.inf, hardware="H100"),
            Refuse("tokens must be a finite positive number, got inf"),
        ),
        (
            "estimate gpus 1.5",
            lambda: symacct.estimate(params=1e9, tokens=1e9, hardware="H100", gpus=1.5),
            Refuse("gpus must be a positive whole number, got 1.5"),
        ),
        ("mfu above 1", lambda: symacct.mfu(1e18, 1.0, "H100"), Refuse("MFU would be 1.01e+03, above 1")),
        (
            "mfu seconds 0",
            lambda: symacct.mfu(1e12, 0.0, "H100"),
            Refuse("seconds must be a finite positive number, got 0.0"),
        ),
        (
            "fit gpus 0",
            lambda: symacct.fit(g, "B", hardware="H100", S=8, gpus=0),
            Refuse("gpus must be a positive whole number, got 0"),
        ),
        (
            "fit gpus -8",
            lambda: symacct.fit(g, "B", hardware="H100", S=8, gpus=-8),
            Refuse("gpus must be a positive whole number, got -8"),
        ),
        (
            "fit reserve 1",
            lambda: symacct.fit(g, "B", hardware="H100", S=8, reserve=1),
            Refuse("reserve must be in [0, 1), got 1"),
        ),
        ("fit unknown symbol", lambda: symacct.fit(g, "X", hardware="H100", S=8), Refuse("unknown symbol(s) X")),
        ("roofline hardware", lambda: symacct.roofline(g, "Z9", B=1, S=8), Refuse("unknown hardware 'Z9'")),
        (
            "max_params bpp 0",
            lambda: symacct.max_params(hardware="H100", bytes_per_param=0),
            Refuse("bytes_per_param must be a finite positive number, got 0"),
        ),
        (
            "time tokens nan",
            lambda: g.time(hardware="H100", tokens=math.nan, B=1, S=8),
            Refuse("tokens must be a finite positive number, got nan"),
        ),
        (
            "track bad path",
            lambda: symacct.track("a", "/proc/nope/log", model=GPT2(small)).__enter__(),
            Refuse("cannot write the log '/proc/nope/log'"),
        ),
    ]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "symacct.cli", *argv], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def main() -> int:
    from symacct import SymacctError

    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as d:
        for name, argv, expect in cli_cases(Path(d)):
            rc, out, err = run_cli(argv)
            if isinstance(expect, Refuse):
                one = len(err.strip().splitlines()) == 1 and "Traceback" not in err and not out
                ok = rc == 2 and one and expect in err
            else:
                ok = rc == 0 and expect in out
            rows.append(("ok" if ok else "BAD", f"cli {name}", (err.strip() or out.strip()).splitlines()[-1:][0][:110]
                         if (err.strip() or out.strip()) else f"rc={rc}"))  # fmt: skip
    for name, thunk, expect in api_cases():
        try:
            value = thunk()
            ok = not isinstance(expect, Refuse) and expect(value)
            what = f"returned {str(value)[:80]}"
        except SymacctError as e:
            ok = isinstance(expect, Refuse) and not e.internal and expect in str(e)
            what = str(e)[:110]
        except Exception as e:  # anything else is a BAD row, shown with its type
            ok = False
            what = f"{type(e).__name__}: {str(e)[:100]}"
        rows.append(("ok" if ok else "BAD", f"api {name}", what))
    for verdict, name, what in rows:
        print(f"{verdict:<4} {name:<32} {what}")
    bad = sum(v == "BAD" for v, _, _ in rows)
    print(f"{len(rows) - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
