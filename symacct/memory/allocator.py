"""A model of PyTorch's CUDA caching allocator: what ``torch.cuda.max_memory_reserved()`` reports.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (the native backend) with
``PYTORCH_CUDA_ALLOC_CONF`` unset, on one stream:

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; 512 at the least);
  a request of 0 bytes allocates nothing;
- a rounded size up to 1 MiB (``kSmallSize``) is served from the *small* pool, a larger one from the
  *large* pool; a free block of one pool never serves the other;
- a request takes the smallest free block of its pool that holds it (best fit; among equal sizes the
  lowest address);
- when none does, a new segment is reserved (``cudaMalloc``): 2 MiB for a small request
  (``kSmallBuffer``), 20 MiB for a large one under 10 MiB (``kLargeBuffer``, ``kMinLargeAlloc``), else
  the request rounded up to a multiple of 2 MiB (``kRoundLarge``);
- the block found is split when what is left is worth keeping: at least 512 bytes in the small pool,
  more than 1 MiB in the large pool; the request takes the front, the rest stays free. A block not
  split is handed out whole, and ``memory_allocated`` counts all of it;
- a freed block merges with its free neighbours of the same segment; segments are never given back
  (no ``empty_cache``), so the reserved bytes only grow.

Assumptions of the model (each a place where a real run can differ): new segments get increasing
addresses (``cudaMalloc`` chooses them; they only break ties between free blocks of equal size); memory
never runs out (near the device's capacity the real allocator frees cached segments and retries);
one stream (a block freed on another stream waits for its events); no ``max_split_size_mb``,
``roundup_power2_divisions``, ``expandable_segments`` or garbage-collection threshold.

``allocated`` here is ``torch.cuda.memory_allocated`` (block sizes), ``reserved``
``torch.cuda.memory_reserved`` (segment sizes), ``requested`` the bytes asked for.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are the request rounded up to this


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` takes: a multiple of 512, at least 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def is_small(size: int) -> bool:
    """Whether a rounded size is served from the small pool."""
    return size <= SMALL_SIZE


def segment_size(size: int) -> int:
    """The segment reserved for a rounded size no free block holds."""
    if is_small(size):
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def should_split(block_size: int, size: int, small: bool) -> bool:
    """Whether a free block of ``block_size`` handing out ``size`` keeps the rest as a block of its own."""
    remaining = block_size - size
    return remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE


@dataclass(eq=False)
class Block:
    """A piece of one segment: ``[address, address + size)``."""

    address: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


@dataclass
class Stats:
    """Current and peak bytes, as ``torch.cuda.memory_stats`` names them, and the segments reserved."""

    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0
    segments: list[int] = field(default_factory=list)  # the size of each segment, in the order reserved


class CachingAllocator:
    """The caching allocator's block pools, replayed request by request (see the module docstring)."""

    def __init__(self) -> None:
        self.stats = Stats()
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # pool -> sorted (size, address)
        self._at: dict[int, Block] = {}  # address -> free block
        self._end = 0  # where the next segment's addresses start

    def malloc(self, nbytes: int) -> Block | None:
        """Hand out a block for ``nbytes`` (None for 0 bytes, which allocates nothing)."""
        if nbytes == 0:
            return None
        size = round_size(nbytes)
        small = is_small(size)
        block = self._take(size, small)
        if block is None:
            seg = segment_size(size)
            block = Block(self._end, seg, small)
            self._end += seg
            self.stats.reserved += seg
            self.stats.segments.append(seg)
        if should_split(block.size, size, small):
            rest = Block(block.address + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated, block.requested = True, nbytes
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        s.peak_requested = max(s.peak_requested, s.requested)
        return block

    def free(self, block: Block | None) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        if block is None:
            return
        if not block.allocated:
            raise ValueError(f"block at {block.address} freed twice")
        block.allocated = False
        self.stats.allocated -= block.size
        self.stats.requested -= block.requested
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove(other)
                if other is block.prev:
                    block.address, block.prev = other.address, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert(block)

    def _take(self, size: int, small: bool) -> Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _, address = pool.pop(i)
        return self._at.pop(address)

    def _insert(self, block: Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address))
        self._at[block.address] = block

    def _remove(self, block: Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]
        del self._at[block.address]


Event = tuple[str, Hashable, int]  # ('alloc', key, nbytes) or ('free', key, 0)


def replay(events: Iterable[Event], allocator: CachingAllocator | None = None) -> CachingAllocator:
    """Run a sequence of allocations and frees (each key allocated once before it is freed) through a
    caching allocator; returns it, with its stats."""
    alloc = allocator or CachingAllocator()
    held: dict[Hashable, Block | None] = {}
    for kind, key, nbytes in events:
        if kind == "alloc":
            if key in held:
                raise ValueError(f"{key!r} allocated twice")
            held[key] = alloc.malloc(nbytes)
        elif kind == "free":
            alloc.free(held.pop(key))
        else:
            raise ValueError(f"unknown event {kind!r}")
    return alloc
