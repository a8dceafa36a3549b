"""Bad and edge inputs through the CLI and the API, as a hostile but realistic user would type them.

Each case must end in one of two ways: a right answer (the case says what it must be), or a refusal
(a SymacctError from the API; on the CLI exit code 2 with one line on stderr and nothing on stdout).
Anything else is a BAD row: a traceback, another exception type, a wrong exit code, or a figure where a
refusal was due. Run on demand: ``python scripts/hostile.py`` (a minute or two: each CLI case is a
process); it prints one row per case and exits 1 if any row is BAD.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REFUSE = "refuse"


def cli_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv, expect): expect is REFUSE, or a substring the output must hold with exit 0."""
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
        ("batch 0", [*d, "--batch", "0"], REFUSE),
        ("batch -1", [*d, "--batch", "-1"], REFUSE),
        ("batch 1.5", [*d, "--batch", "1.5"], REFUSE),
        ("seq beyond S_max", [*d, "--seq", "2048"], REFUSE),
        ("seq 0", [*d, "--seq", "0"], REFUSE),
        ("config abc", ["derive", "gpt2", "--config", "n_layer=abc"], REFUSE),
        ("config 2.5", ["derive", "gpt2", "--config", "n_layer=2.5"], REFUSE),
        ("config 0 layers", ["derive", "gpt2", "--config", "n_layer=0"], REFUSE),
        ("config -1 layers", ["derive", "gpt2", "--config", "n_layer=-1"], REFUSE),
        ("config 1e3", ["derive", "gpt2", "--config", "n_embd=1e3"], REFUSE),
        ("config dropout abc", ["derive", "gpt2", "--config", "dropout=abc"], REFUSE),
        ("config n_head 5", ["derive", "gpt2", "--config", "n_head=5"], REFUSE),
        ("config no value", ["derive", "gpt2", "--config", "n_layer="], REFUSE),
        ("config unknown", ["derive", "gpt2", "--config", "n_layers=2"], REFUSE),
        ("config tie no", [*d, "--config", "tie_weights=no", "--json"], '"params"'),
        ("config tie maybe", [*d, "--config", "tie_weights=maybe"], REFUSE),
        ("model unknown", ["derive", "gtp2"], REFUSE),
        ("model import", ["derive", "nosuch.mod:make"], REFUSE),
        ("factory needs args", ["derive", "json:loads"], REFUSE),
        ("factory not a module", ["derive", "os:getcwd"], REFUSE),
        ("optimizer unknown", [*d, "--optimizer", "adamx"], REFUSE),
        ("estimate params nan", ["estimate", "--params", "nan", "--tokens", "1e12", "--hardware", "H100"], REFUSE),
        ("estimate params inf", ["estimate", "--params", "inf", "--tokens", "1e12", "--hardware", "H100"], REFUSE),
        ("estimate inf json", ["estimate", "--params", "inf", "--tokens", "1", "--hardware", "H100", "--json"], REFUSE),
        ("estimate tokens -1", ["estimate", "--params", "7e9", "--tokens", "-1", "--hardware", "H100"], REFUSE),
        ("estimate gpus 0", [*e, "--gpus", "0"], REFUSE),
        ("estimate gpus 1.5", [*e, "--gpus", "1.5"], REFUSE),
        ("estimate gpus -8", [*e, "--gpus", "-8"], REFUSE),
        ("estimate mfu 2", [*e, "--mfu", "2"], REFUSE),
        ("estimate mfu 0", [*e, "--mfu", "0"], REFUSE),
        ("estimate hardware", ["estimate", "--params", "7e9", "--tokens", "1e12", "--hardware", "Z9"], REFUSE),
        ("estimate dtype fp64", [*e, "--dtype", "fp64"], REFUSE),
        (
            "estimate fp8 on A100",
            ["estimate", "--params", "7e9", "--tokens", "1", "--hardware", "A100", "--dtype", "fp8"],
            REFUSE,
        ),  # fmt: skip
        ("estimate no params", ["estimate", "--tokens", "1e12", "--hardware", "H100"], REFUSE),
        (
            "estimate model seq",
            ["estimate", "gpt2", *small, "--tokens", "1e9", "--hardware", "H100", "--seq", "4096"],
            REFUSE,
        ),  # fmt: skip
        ("fit gpus 0", ["fit", "--hardware", "H100", "--gpus", "0"], REFUSE),
        ("fit reserve 1", ["fit", "--hardware", "H100", "--reserve", "1"], REFUSE),
        ("fit optimizer", ["fit", "--hardware", "H100", "--optimizer", "nosuch"], REFUSE),
        (
            "fit layout nothing fits",
            ["fit", "gpt2", *small, "--hardware", "H100", "--seq", "16", "--pp", "2", "--reserve", "0.9999999"],
            REFUSE,
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
        ("sheet batch 0", ["sheet", "gpt2", "--batch", "0"], REFUSE),
        ("sheet mfu 0", ["sheet", "gpt2", "--mfu", "0"], REFUSE),
        ("sheet out unwritable", ["sheet", "cruncher", "--out", str(binary / "x")], REFUSE),
        ("verify steps 0", ["verify", "cruncher", "--steps", "0"], REFUSE),
        ("diff binary", ["diff", str(binary), str(good)], REFUSE),
        ("diff utf16", ["diff", str(utf16), str(good)], REFUSE),
        ("diff empty", ["diff", str(empty), str(good)], REFUSE),
        ("diff missing", ["diff", str(tmp / "missing"), str(good)], REFUSE),
    ]


def api_cases() -> list[tuple[str, Callable[[], Any], Any]]:
    """(name, thunk, expect): expect is REFUSE, or a predicate on the result."""
    import numpy as np
    import torch
    from torch import nn

    import symacct
    from symacct.models import GPT2, GPT2Config, Llama, LlamaConfig

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

    def by_parity() -> Any:
        return symacct.derive(ByParity, dims={"width": 8}, inputs=lambda m, B, S: (torch.randn(B, S, m.a.in_features),))

    def changed(how: Callable[[Any], Any]) -> Callable[[], Any]:
        def run() -> Any:
            model = GPT2(small)
            how(model)
            return symacct.derive(model).at(B=2, S=8).memory.peak

        return run

    return [
        ("derive an int", lambda: symacct.derive(123), REFUSE),
        ("derive optimizer instance", lambda: symacct.derive(GPT2(small), optimizer=opt), REFUSE),
        ("derive step eval", lambda: symacct.derive(GPT2(small), step="eval"), REFUSE),
        ("derive autocast fp8", lambda: symacct.derive(GPT2(small), autocast="fp8"), REFUSE),
        ("derive autocast fp32", lambda: symacct.derive(GPT2(small), autocast=torch.float32), REFUSE),
        ("derive params int8", lambda: symacct.derive(GPT2(small), params_dtype=torch.int8), REFUSE),
        ("derive device cuda", lambda: symacct.derive(GPT2(small), device="cuda"), REFUSE),
        ("derive fixed typo", lambda: symacct.derive(GPT2(small), fixed=["n_layr"]), REFUSE),
        ("derive dims 0", lambda: symacct.derive(lambda D: nn.Linear(D, D), dims={"D": 0}), REFUSE),
        ("derive dims float", lambda: symacct.derive(lambda D: nn.Linear(D, D), dims={"D": 2.5}), REFUSE),
        ("derive inputs dict", lambda: symacct.derive(GPT2(small), inputs=lambda B, S: {"x": 1}), REFUSE),
        ("derive loss not scalar", lambda: symacct.derive(GPT2(small), loss=lambda o: o * 2, inputs=ids), REFUSE),
        ("derive embedding_flops x", lambda: symacct.derive(GPT2(small), embedding_flops="x"), REFUSE),
        ("derive unknown option", lambda: symacct.derive(GPT2(small), optimiser="adamw"), REFUSE),
        ("derive compiled", lambda: symacct.derive(torch.compile(GPT2(small))), REFUSE),
        ("derive in no_grad", in_no_grad, lambda v: v == g.flops.total),
        ("derive mask longer", changed(lambda m: setattr(m.blocks[0].attn, "mask", mask32)), REFUSE),
        ("derive unused buffer", changed(lambda m: m.register_buffer("extra", torch.zeros(99))), REFUSE),
        ("derive heads set", changed(lambda m: setattr(m.blocks[1].attn, "n_head", 8)), REFUSE),
        ("derive hook added", changed(lambda m: m.blocks[0].register_forward_hook(lambda *a: None)), REFUSE),
        ("derive layers cut", changed(lambda m: setattr(m, "blocks", m.blocks[:1])), REFUSE),
        ("serve two models", lambda: serve(prefill, wide_decode, hardware="H100-SXM", context=8), REFUSE),
        ("tp one head a rank", one_head_a_rank, lambda v: v is True),
        ("derive fused inference path", lambda: symacct.derive(encoder, step="forward", inputs=tokens), REFUSE),
        ("derive inside autocast", in_autocast, REFUSE),
        ("derive parity branch", by_parity, REFUSE),
        ("derive in anomaly mode", in_anomaly_mode, lambda v: v == g.memory.peak),
        ("derive saved hooks disabled", hooks_disabled, REFUSE),
        ("derive inside save_on_cpu", in_saved_hooks, REFUSE),
        ("at B 10**30", lambda: g.at(B=10**30, S=8).flops.total, lambda v: v == 10**30 * g.at(B=1, S=8).flops.total),
        ("at B 0", lambda: g.at(B=0, S=8), REFUSE),
        ("at B 1.5", lambda: g.at(B=1.5, S=8), REFUSE),
        ("at B True", lambda: g.at(B=True, S=8), REFUSE),
        ("at B nan", lambda: g.at(B=math.nan, S=8), REFUSE),
        ("at S beyond S_max", lambda: g.at(B=1, S=4096), REFUSE),
        ("at H 5", lambda: g.at(B=1, S=8, H=5), REFUSE),
        ("at H_kv 3", lambda: llama.at(B=1, S=8, H_kv=3), REFUSE),
        ("at L 0", lambda: g.at(B=1, S=8, L=0), REFUSE),
        ("at field name", lambda: g.at(B=1, S=8, n_layer=4), REFUSE),
        ("at unknown", lambda: g.at(B=1, S=8, Q=4), REFUSE),
        ("at numpy int", lambda: g.at(B=np.int64(2), S=8).flops.total, lambda v: v == g.at(B=2, S=8).flops.total),
        ("peak beyond S_max", lambda: g.peak(B=1, S=64), REFUSE),
        ("steady B 0", lambda: g.steady(B=0, S=8), REFUSE),
        ("sweep field name", lambda: g.sweep("flops.total", n_layer=np.array([24, 48]), B=1, S=8), REFUSE),
        ("sweep B negative", lambda: g.sweep("flops.total", B=np.array([-1, 2]), S=8), REFUSE),
        ("sweep B 1.5", lambda: g.sweep("flops.total", B=np.array([1.5]), S=8), REFUSE),
        ("sweep lengths", lambda: g.sweep("flops.total", B=np.array([1, 2]), S=np.array([2, 4, 8])), REFUSE),
        ("sweep S beyond", lambda: g.sweep("flops.total", B=1, S=np.array([8, 64])), REFUSE),
        ("sweep unknown name", lambda: g.sweep("flops.nope", B=1, S=8), REFUSE),
        ("estimate tokens nan", lambda: symacct.estimate(params=1e9, tokens=math.nan, hardware="H100"), REFUSE),
        ("estimate tokens inf", lambda: symacct.estimate(params=1e9, tokens=math.inf, hardware="H100"), REFUSE),
        ("estimate gpus 1.5", lambda: symacct.estimate(params=1e9, tokens=1e9, hardware="H100", gpus=1.5), REFUSE),
        ("mfu above 1", lambda: symacct.mfu(1e18, 1.0, "H100"), REFUSE),
        ("mfu seconds 0", lambda: symacct.mfu(1e12, 0.0, "H100"), REFUSE),
        ("fit gpus 0", lambda: symacct.fit(g, "B", hardware="H100", S=8, gpus=0), REFUSE),
        ("fit gpus -8", lambda: symacct.fit(g, "B", hardware="H100", S=8, gpus=-8), REFUSE),
        ("fit reserve 1", lambda: symacct.fit(g, "B", hardware="H100", S=8, reserve=1), REFUSE),
        ("fit unknown symbol", lambda: symacct.fit(g, "X", hardware="H100", S=8), REFUSE),
        ("roofline hardware", lambda: symacct.roofline(g, "Z9", B=1, S=8), REFUSE),
        ("max_params bpp 0", lambda: symacct.max_params(hardware="H100", bytes_per_param=0), REFUSE),
        ("time tokens nan", lambda: g.time(hardware="H100", tokens=math.nan, B=1, S=8), REFUSE),
        ("track bad path", lambda: symacct.track("a", "/proc/nope/log", model=GPT2(small)).__enter__(), REFUSE),
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
            if expect == REFUSE:
                ok = rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err and not out
            else:
                ok = rc == 0 and expect in out
            rows.append(("ok" if ok else "BAD", f"cli {name}", (err.strip() or out.strip()).splitlines()[-1:][0][:110]
                         if (err.strip() or out.strip()) else f"rc={rc}"))  # fmt: skip
    for name, thunk, expect in api_cases():
        try:
            value = thunk()
            ok = expect != REFUSE and expect(value)
            what = f"returned {str(value)[:80]}"
        except SymacctError as e:
            ok = expect == REFUSE and not e.internal
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
