"""A model of PyTorch's CUDA caching allocator, to predict reserved memory without a GPU.

Replays a sequence of allocations and frees (from the tracer) with the rules of
``c10/cuda/CUDACachingAllocator.cpp``:

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones from the large;
- a request is served by the smallest free block of its pool that is large enough (best fit);
  with ``max_split_size`` set, blocks of that size or more serve only requests of that size
  or more, and then only blocks less than 20 MiB larger than the request;
- the block is split when the rest is worth keeping: 512 bytes or more in the small pool,
  more than 1 MiB in the large pool (and only for requests under ``max_split_size``);
- with no free block to use, a new segment is reserved (cudaMalloc): 2 MiB for small
  requests, 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- a freed block merges with free neighbours in its segment; segments stay reserved
  (until ``empty_cache()``, which a training step does not call).

With ``expandable_segments`` each pool has one segment that grows at its end, mapping
memory in pages (2 MiB small, 20 MiB large) only when the free space at its end is too
short, so freed memory is reused and fragmentation between segments disappears.
Pure Python, no torch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """cudaMalloc size for a request of ``size`` (already rounded) with no free block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    size: int
    small: bool
    free: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    serial: int = 0

    def key(self) -> tuple[int, int]:
        return (self.size, self.serial)


@dataclass
class AllocatorStats:
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments: int = 0

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated, at the reserved peak's end state (what the cache holds)."""
        return self.reserved_bytes - self.allocated_bytes


class CachingAllocator:
    """Replay ``malloc(id, size)`` / ``free(id)`` and read the reserved memory."""

    def __init__(self, *, max_split_size: int | None = None, expandable_segments: bool = False) -> None:
        self.max_split = max_split_size or (1 << 62)
        self.expandable = expandable_segments
        self.stats = AllocatorStats()
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}
        self._blocks: dict[int, Block] = {}
        self._serial = 0
        self._tail: dict[bool, Block | None] = {True: None, False: None}  # expandable: last block per pool

    # --- free lists ------------------------------------------------------------------------
    def _add_free(self, block: Block) -> None:
        block.free = True
        insort(self._free[block.small], (block.size, block.serial, block))

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.small]
        del pool[bisect_left(pool, (block.size, block.serial))]

    def _new_block(self, size: int, small: bool) -> Block:
        self._serial += 1
        return Block(size, small, serial=self._serial)

    def _best_fit(self, size: int, small: bool) -> Block | None:
        pool = self._free[small]
        i = bisect_left(pool, (size, -1))
        while i < len(pool):
            block = pool[i][2]
            if size < self.max_split <= block.size:
                return None  # oversize blocks serve only oversize requests
            if size >= self.max_split and block.size >= size + LARGE_BUFFER:
                return None
            return block
        return None

    # --- the two operations ----------------------------------------------------------------
    def malloc(self, ident: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is not None:
            self._remove_free(block)
        elif self.expandable:
            block = self._grow(size, small)
        else:
            block = self._new_block(segment_size(size), small)
            self._reserve(block.size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else (remaining > SMALL_SIZE and size < self.max_split):
            rest = self._new_block(remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, size
            if self._tail[small] is block:
                self._tail[small] = rest
            self._add_free(rest)
        block.free = False
        self._blocks[ident] = block
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)

    def free(self, ident: int) -> None:
        block = self._blocks.pop(ident)
        self.stats.allocated_bytes -= block.size
        if block.next is not None and block.next.free:
            self._remove_free(block.next)
            self._absorb(block, block.next)
        if block.prev is not None and block.prev.free:
            self._remove_free(block.prev)
            block = self._absorb(block.prev, block)
        self._add_free(block)

    # --- segments --------------------------------------------------------------------------
    def _reserve(self, size: int) -> None:
        self.stats.reserved_bytes += size
        self.stats.segments += 1
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)

    def _absorb(self, left: Block, right: Block) -> Block:
        """Merge ``right`` into its neighbour ``left`` in the same segment."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        if self._tail[left.small] is right:
            self._tail[left.small] = left
        return left

    def _grow(self, size: int, small: bool) -> Block:
        """Expandable segments: map pages at the pool's end until the request fits there."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tail[small]
        at_end = tail.size if tail is not None and tail.free else 0
        extra = -(-(size - at_end) // page) * page
        self.stats.reserved_bytes += extra
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        if at_end:
            self._remove_free(tail)
            tail.size += extra
            return tail
        block = self._new_block(extra, small)
        if tail is not None:
            block.prev, tail.next = tail, block
        else:
            self.stats.segments += 1
        self._tail[small] = block
        return block


def replay(events: list[tuple[str, int, int]], **config) -> AllocatorStats:
    """Replay ('malloc', id, nbytes) / ('free', id, 0) events; return the allocator's stats."""
    allocator = CachingAllocator(**config)
    for kind, ident, nbytes in events:
        if kind == "malloc":
            allocator.malloc(ident, nbytes)
        else:
            allocator.free(ident)
    return allocator.stats
