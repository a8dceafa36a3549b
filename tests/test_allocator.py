"""The caching-allocator model against PyTorch's documented rules, on synthetic allocation sequences.

Every expected figure is worked out by hand from the rules in the comment above it (the 512-byte
rounding, the 1 MiB pool boundary, the 2 MiB / 20 MiB / rounded-to-2 MiB segments, best fit, when a
block is split, merging on free), not read from the code under test.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from symacct.memory.allocator import CachingAllocator, replay

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("nbytes", "allocated"),
    [(1, 512), (4, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (3 * MiB + 1, 3 * MiB + 512)],
)
def test_requests_round_up_to_512_bytes(nbytes: int, allocated: int) -> None:
    a = CachingAllocator()
    a.malloc(nbytes)
    assert a.stats.allocated == allocated
    assert a.stats.requested == nbytes


def test_zero_bytes_allocate_nothing() -> None:
    a = CachingAllocator()
    assert a.malloc(0) is None
    a.free(None)
    assert (a.stats.allocated, a.stats.reserved) == (0, 0)


@pytest.mark.parametrize(
    ("nbytes", "segment"),
    [
        (4, 2 * MiB),  # small pool: a 2 MiB segment
        (MiB, 2 * MiB),  # exactly 1 MiB is still small
        (MiB + 1, 20 * MiB),  # large, under 10 MiB: 20 MiB
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),  # 10 MiB and more: rounded up to 2 MiB
        (10 * MiB + 1, 12 * MiB),
        (25 * MiB, 26 * MiB),
    ],
)
def test_segment_sizes(nbytes: int, segment: int) -> None:
    a = CachingAllocator()
    a.malloc(nbytes)
    assert a.stats.segments == [segment]
    assert a.stats.reserved == segment


def test_small_blocks_pack_into_2_mib_segments() -> None:
    # 4096 blocks of 512 bytes fill one 2 MiB segment; the next needs a second segment
    a = CachingAllocator()
    for _ in range(4096):
        a.malloc(100)
    assert a.stats.reserved == 2 * MiB and a.stats.allocated == 2 * MiB
    a.malloc(100)
    assert a.stats.reserved == 4 * MiB


def test_a_large_segment_serves_several_requests() -> None:
    # 1.5 MiB takes the front of a 20 MiB segment; the 18.5 MiB left (> 1 MiB) stays free and serves the
    # next 1.5 MiB; 12 of them take 18 MiB, the 13th the 2 MiB left, whole (0.5 MiB is not split off),
    # so 20 MiB are allocated for 19.5 MiB asked; the 14th needs a new segment
    a = CachingAllocator()
    for _ in range(13):
        a.malloc(3 * MiB // 2)
    assert a.stats.segments == [20 * MiB]
    assert (a.stats.allocated, a.stats.requested) == (20 * MiB, 13 * 3 * MiB // 2)
    a.malloc(3 * MiB // 2)
    assert a.stats.segments == [20 * MiB, 20 * MiB]


def test_a_remainder_of_1_mib_or_less_is_not_split_off() -> None:
    # 13.5 MiB -> a 14 MiB segment; the 0.5 MiB left is not split off (large pool: only > 1 MiB is),
    # so the block handed out, and memory_allocated, is the whole 14 MiB
    a = CachingAllocator()
    a.malloc(27 * MiB // 2)
    assert (a.stats.allocated, a.stats.reserved, a.stats.requested) == (14 * MiB, 14 * MiB, 27 * MiB // 2)
    # 12.5 MiB -> 14 MiB segment; 1.5 MiB left is split off and stays free
    b = CachingAllocator()
    b.malloc(25 * MiB // 2)
    assert b.stats.allocated == 25 * MiB // 2


def test_best_fit_merge_and_exactly_1_mib_left() -> None:
    a = CachingAllocator()
    x = a.malloc(4 * MiB)  # 20 MiB segment: x = [0, 4), free [4, 20)
    a.malloc(4 * MiB)  # y = [4, 8), free [8, 20)
    a.free(x)  # free: [0, 4) and [8, 20)
    z = a.malloc(3 * MiB)  # best fit is [0, 4) (4 MiB < 12 MiB); 1 MiB left is not > 1 MiB: not split
    assert z is not None and z.address == 0 and z.size == 4 * MiB
    assert a.stats.allocated == 8 * MiB
    w = a.malloc(12 * MiB)  # [8, 20) exactly: no new segment
    assert w is not None and w.address == 8 * MiB
    assert a.stats.reserved == 20 * MiB


def test_freed_neighbours_merge_back_into_one_block() -> None:
    a = CachingAllocator()
    blocks = [a.malloc(5 * MiB) for _ in range(4)]  # [0,5) [5,10) [10,15) [15,20): no remainder left
    for b in (blocks[1], blocks[3], blocks[2], blocks[0]):
        a.free(b)
    assert a.stats.allocated == 0
    big = a.malloc(20 * MiB)  # the four merged into the whole segment again
    assert big is not None and big.address == 0 and a.stats.reserved == 20 * MiB
    a.free(big)
    a.malloc(21 * MiB)  # 21 MiB: larger than any free block, a new 22 MiB segment
    assert a.stats.segments == [20 * MiB, 22 * MiB]


def test_pools_do_not_serve_each_other() -> None:
    # a free 20 MiB large block does not serve a 4-byte request, nor a free small segment a 1.5 MiB one
    a = CachingAllocator()
    a.free(a.malloc(2 * MiB))
    a.malloc(4)
    assert a.stats.segments == [20 * MiB, 2 * MiB]
    b = CachingAllocator()
    b.free(b.malloc(MiB))
    b.malloc(MiB + 512)
    assert b.stats.segments == [2 * MiB, 20 * MiB]


def test_fragmentation_reserves_more_than_the_live_peak() -> None:
    # eight 2.5 MiB blocks fill a 20 MiB segment; freeing every other one leaves four 2.5 MiB holes
    # (10 MiB free, none adjacent), so a 5 MiB request needs a new segment: reserved 40 MiB while
    # at most 20 MiB was ever live
    a = CachingAllocator()
    blocks = [a.malloc(5 * MiB // 2) for _ in range(8)]
    assert a.stats.segments == [20 * MiB]
    for b in blocks[::2]:
        a.free(b)
    a.malloc(5 * MiB)
    assert a.stats.segments == [20 * MiB, 20 * MiB]
    assert a.stats.peak_allocated == 20 * MiB
    assert a.stats.peak_reserved == 40 * MiB


def test_replay_events_and_peaks() -> None:
    events = [("alloc", "a", 6 * MiB), ("alloc", "b", 6 * MiB), ("free", "a", 0), ("alloc", "c", 2 * MiB)]
    alloc = replay(events)
    s = alloc.stats
    # a = [0, 6), b = [6, 12), free [12, 20); after a is freed, c (2 MiB) takes the best fit [0, 6): the
    # 4 MiB left (> 1 MiB) is split off
    assert (s.allocated, s.peak_allocated, s.reserved) == (8 * MiB, 12 * MiB, 20 * MiB)
    with pytest.raises(ValueError, match="twice"):
        replay([("alloc", "a", 1), ("alloc", "a", 1)])


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30 * MiB)), max_size=60), st.integers(0, 2**16))
def test_invariants_on_random_sequences(ops: list[tuple[bool, int]], seed: int) -> None:
    """Whatever the sequence: allocated never exceeds reserved, reserved never shrinks, every byte of every
    segment belongs to exactly one block, and freeing everything leaves each segment one free block."""
    rng = random.Random(seed)
    a = CachingAllocator()
    live = []
    last_reserved = 0
    for do_alloc, n in ops:
        if do_alloc or not live:
            b = a.malloc(n)
            if b is not None:
                live.append(b)
        else:
            a.free(live.pop(rng.randrange(len(live))))
        assert a.stats.allocated <= a.stats.reserved
        assert a.stats.reserved >= last_reserved
        last_reserved = a.stats.reserved
        assert a.stats.allocated == sum(b.size for b in live)
    for b in live:
        a.free(b)
    assert a.stats.allocated == 0 and a.stats.requested == 0
    free_sizes = sorted(size for pool in a._free.values() for size, _ in pool)
    assert free_sizes == sorted(a.stats.segments)


# --- the derived timeline replayed (Accounting.reserved) ---------------------------------------------


@pytest.fixture(scope="module")
def gpt2_adamw():
    import symacct
    from symacct.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, block_size=32))
    return symacct.derive(model, optimizer="adamw")


@pytest.mark.parametrize("L", [2, 4, 5, 7])
def test_the_replayed_timeline_is_the_derived_liveness(gpt2_adamw, L: int) -> None:
    """The bytes asked for at their largest, over a trace with L blocks replayed event by event, are the peak
    the liveness pass factors from 4 and 5 blocks: the first step's, then the later steps' (states alive)."""
    acct = gpt2_adamw
    sizes = {"B": 3, "S": 16, "L": L, "D": 48}
    assert acct.reserved(**sizes).requested_peak == acct.peak(**sizes)
    later = acct.reserved(steps=3, **sizes)
    assert later.requested_peak == max(acct.peak(**sizes), acct.steady(**sizes)["peak"])
    assert later.reserved_peak >= later.allocated_peak >= later.requested_peak


def test_allocated_peak_in_the_small_pool_is_the_rounded_live_bytes(gpt2_adamw) -> None:
    """Where every storage is at most 1 MiB, all blocks come from the small pool, which splits off any
    remainder of 512 bytes or more: each block is its request rounded up to 512, so the allocated peak is
    the largest sum of rounded live storages at an op (counted here from the intervals, not replayed)."""
    acct = gpt2_adamw
    sizes = {"B": 2, "S": 8, "L": 3}
    values = acct.values_at(**sizes)
    iv = acct.timelines(3).intervals
    nbytes = {st: int(e.subs({s: values[s.name] for s in e.free_symbols})) for st, e in iv.nbytes.items()}
    assert max(nbytes.values()) <= MiB
    rounded = [sum(-(-nbytes[st] // 512) * 512 for st in iv.alive_at(t) if nbytes[st]) for t in range(-1, iv.n)]
    r = acct.reserved(**sizes)
    assert r.allocated_peak == max(rounded)
    assert r.reserved_peak == 2 * MiB * len(r.segments)


def test_the_cublas_workspace_takes_its_segment(gpt2_adamw) -> None:
    """With every tensor in the small pool, the workspace alone is in the large pool: 32 MiB on Hopper
    (>= 10 MiB: a segment of its size), 8 MiB + 128 KiB on an A100 (under 10 MiB: a 20 MiB segment)."""
    from symacct.errors import SymacctError

    acct = gpt2_adamw
    sizes = {"B": 2, "S": 8}
    bare = acct.reserved(**sizes).reserved_peak
    assert acct.reserved(hardware="H100", **sizes).reserved_peak - bare == 32 * MiB
    assert acct.reserved(hardware="A100", **sizes).reserved_peak - bare == 20 * MiB
    with pytest.raises(SymacctError, match="cuBLAS workspace"):
        acct.reserved(hardware="TPU-v5e", **sizes)
    with pytest.raises(SymacctError, match="steps"):
        acct.reserved(steps=0, **sizes)


@pytest.mark.slow  # a CLI process or a derivation more: in CI's slow pass (the default run's 20 minutes)
def test_cli_derive_reserved(capsys) -> None:
    """``symacct derive --reserved``: the replay's figures in the JSON report are Accounting.reserved's."""
    import json

    import symacct
    from symacct.cli import main
    from symacct.models import GPT2, GPT2Config

    argv = ["derive", "gpt2", "--config", "n_layer=2", "--config", "n_embd=32", "--config", "n_head=4"]
    argv += ["--config", "vocab_size=64", "--config", "block_size=32", "--batch", "2", "--seq", "16"]
    assert main([*argv, "--reserved", "2", "--hardware", "H100", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["reserved"]
    acct = symacct.derive(
        GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32)), optimizer="adamw"
    )
    want = acct.reserved(steps=2, hardware="H100", B=2, S=16)
    assert (got["reserved_peak"], got["allocated_peak"], got["requested_peak"]) == (
        want.reserved_peak,
        want.allocated_peak,
        want.requested_peak,
    )
    assert got["workspace"] == 32 * MiB and sum(s["bytes"] * s["count"] for s in got["segments"]) == want.reserved_peak
    assert main([*argv, "--reserved"]) == 0
    assert "torch.cuda.max_memory_reserved" in capsys.readouterr().out
    assert main([*argv, "--reserved", "--hardware", "TPU-v5e"]) == 2
    assert "cuBLAS workspace" in capsys.readouterr().err


def test_the_docs_example_is_what_the_command_prints(capsys) -> None:
    """docs/memory.md quotes ``derive --reserved`` output: those lines are what it prints."""
    import re
    from pathlib import Path

    from symacct.cli import main

    doc = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    block = re.search(r"```\n(symacct derive [^\n]*--reserved[^\n]*)\n\n(.*?)```", doc, re.S)
    assert block is not None
    assert main(block.group(1).split()[1:]) == 0
    out = capsys.readouterr().out
    for line in block.group(2).strip().splitlines():
        assert line in out, line


def test_fit_by_the_allocator_is_no_larger_than_by_the_live_peak(gpt2_adamw, capsys) -> None:
    """Reserved bytes are at least the allocated ones, which are at least the live bytes, over both steps:
    the largest batch that fits what the allocator reserves is never above the one that fits the live peak,
    and it fits while the next batch does not."""
    import json

    import symacct
    from symacct.cli import main
    from symacct.time.hardware import Accelerator

    small = Accelerator("tiny", {"fp32": 1.0}, 0.12, 1.0, 1.0, "a made-up 120 MB device", cublas_workspace=32 * MiB)
    plain = symacct.fit(gpt2_adamw, "B", hardware=small, S=32, reserve=0.0)
    by_alloc = symacct.fit(gpt2_adamw, "B", hardware=small, S=32, reserve=0.0, allocator=True)
    assert by_alloc.value <= plain.value
    assert by_alloc.peak_bytes <= by_alloc.budget_bytes < by_alloc.next_peak_bytes
    assert by_alloc.peak_bytes == gpt2_adamw.reserved(steps=2, hardware=small, B=by_alloc.value, S=32).reserved_peak
    assert "caching allocator" in by_alloc.formula
    argv = ["fit", "gpt2", "--config", "n_layer=2", "--config", "n_embd=32", "--config", "n_head=4"]
    argv += ["--config", "vocab_size=64", "--hardware", "H100", "--seq", "32", "--solve", "batch", "--json"]
    assert main([*argv, "--allocator"]) == 0
    assert "caching allocator" in json.loads(capsys.readouterr().out)["formula"]
    assert main(["fit", "--hardware", "H100", "--allocator"]) == 2
    assert "--allocator needs a model" in capsys.readouterr().err


def test_the_cuda_context_is_a_row_beside_the_allocator(gpt2_adamw, capsys) -> None:
    """The CUDA context is device memory outside the allocator: every CUDA entry of the catalog has a figure
    and its source, ``Reserved.device_peak`` adds it to the reserved peak, the CLI prints it as its own row and
    an allocator fit counts it. The catalog's figure is PyTorch PR #86509's reading (287,047,680 B in use after
    one 6.4 MB tensor) less that tensor's segment: a request between 1 MiB and 10 MiB gets a 20 MiB one."""
    import json

    import symacct
    from symacct.cli import main
    from symacct.memory.allocator import CachingAllocator, replay
    from symacct.time.hardware import CATALOG, Accelerator

    one = replay([("alloc", "t", 6_400_000)], CachingAllocator()).stats
    assert one.peak_reserved == 20 * MiB
    cuda = [a for a in CATALOG.values() if a.compute_capability is not None]
    assert cuda and all(a.cuda_context == 287_047_680 - one.peak_reserved for a in cuda)
    assert all("#86509" in a.cuda_context_source for a in cuda)
    assert all(a.cuda_context is None for a in CATALOG.values() if a.compute_capability is None)

    sizes = {"B": 2, "S": 8}
    with_gpu, bare = gpt2_adamw.reserved(hardware="H100", **sizes), gpt2_adamw.reserved(**sizes)
    assert (with_gpu.context, bare.context) == (CATALOG["H100-SXM"].cuda_context, 0)
    assert with_gpu.device_peak == with_gpu.reserved_peak + with_gpu.context and bare.device_peak == bare.reserved_peak

    argv = ["derive", "gpt2", "--config", "n_layer=2", "--config", "n_embd=32", "--config", "n_head=4"]
    argv += ["--config", "vocab_size=64", "--config", "block_size=32", "--batch", "2", "--seq", "16", "--reserved"]
    assert main([*argv, "--hardware", "H100", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["reserved"]
    assert got["device_peak"] == got["reserved_peak"] + got["cuda_context"] and "#86509" in got["cuda_context_source"]
    assert main(argv) == 0
    assert "CUDA context" not in capsys.readouterr().out  # no GPU named: no context to add

    ctx = Accelerator(
        "tiny+ctx", {"fp32": 1.0}, 0.12, 1.0, 1.0, "made up", cublas_workspace=32 * MiB,
        cuda_context=8 * MiB, cuda_context_source="made up",
    )  # fmt: skip
    fit = symacct.fit(gpt2_adamw, "B", hardware=ctx, S=32, reserve=0.0, allocator=True)
    r = gpt2_adamw.reserved(steps=2, hardware=ctx, B=fit.value, S=32)
    assert fit.peak_bytes == r.reserved_peak + 8 * MiB <= fit.budget_bytes < fit.next_peak_bytes
