"""A model of PyTorch's CUDA caching allocator, to predict reserved memory without a GPU.

The tracer feeds it allocations as they happen (``malloc(ident, nbytes)``, ``free(ident)``)
or ``replay`` feeds it a finished event list; ``stats`` says what is allocated and reserved
at any moment. The rules are those of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator``; each function named below is one of its methods):

- ``round_size``: a request is rounded up to 512 bytes (``kMinBlockSize``), or to the next
  of ``roundup_power2_divisions`` steps between two powers of two when that is configured;
- ``get_pool``: rounded requests up to 1 MiB (``kSmallSize``) use the small pool, others the large;
- ``get_free_block``: the smallest free block of the pool that is large enough (best fit);
  with ``max_split_size`` set, blocks of that size or more serve only requests of that size
  or more, and only when less than ``max_non_split_rounding`` (20 MiB) larger than the request;
- ``should_split``: the rest of the block becomes a free block when it is 512 bytes or more
  (small pool, or any pool with expandable segments), or more than 1 MiB for a request
  under ``max_split_size`` (large pool);
- ``get_allocation_size``: with no free block to use a segment is reserved (cudaMalloc):
  2 MiB for small requests, 20 MiB under 10 MiB, else the request rounded up to 2 MiB;
- ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours;
  segments stay reserved until the allocator needs room.

Running out (``malloc``): when the new segment would take reserved memory past
``capacity_bytes``, the allocator first frees cached memory and retries, in the C++ order:
``garbage_collect_cached_blocks`` (only with ``garbage_collection_threshold`` *and* a
``set_per_process_memory_fraction`` limit, ``allowed_bytes`` here), then
``release_available_cached_blocks`` (only with ``max_split_size`` set: the smallest whole
cached segment of at least max(request, max_split_size), else the largest oversize ones
until enough), then ``release_cached_blocks`` (every whole cached segment, and every free
page of expandable segments). Only then ``AllocatorOutOfMemory``.

With ``expandable_segments`` each pool has one segment that grows: pages (2 MiB small,
20 MiB large) are mapped where the request fits at the lowest address
(``find_expandable_block``, ``map_block``), and running out unmaps every free page
(``unmap_block``) before retrying. Pure Python, no torch: the tracer turns
``AllocatorOutOfMemory`` into ``torch.OutOfMemoryError``.

Streams: a segment belongs to the stream it was reserved on, and its blocks serve only requests
made on that stream (``BlockComparatorSize`` sorts by stream first; ``get_free_block`` takes no
block of another stream), so memory freed on one stream's blocks is reserved but out of reach of
the others (FSDP2's gradients, made on its reduce-scatter stream, stay reserved there through the
next forward). ``release_cached_blocks`` frees every stream's cached segments.

Not modelled (each changes reserved memory only in programs that use it): ``record_stream``
(cross-stream blocks wait for events), CUDA graph private pools,
``FreeMemoryCallback``s (CUDA IPC), the address space limit of an expandable segment (the
real one is 1.125x the GPU's memory; here it never runs out), and ``cudaMallocAsync``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from batchfit.trace.alloc_conf import (  # noqa: F401 - re-exported
    ENV_VARS,
    LARGE_BUFFER,
    ROUNDUP_INTERVALS,
    AllocatorConfig,
    MiB,
    parse_alloc_conf,
)

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize: largest small-pool request
SMALL_BUFFER = 2 << 20          # kSmallBuffer: small segment, and small expandable page
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge
_NO_LIMIT = 1 << 64             # SIZE_MAX: max_split_size unset
# Expandable segments live far above the plain segments' addresses; their bases and their
# (never exhausted) address space are multiples of both page sizes so pages line up.
_EXPANDABLE_SPACE = LARGE_BUFFER << 30
_EXPANDABLE_BASE = _EXPANDABLE_SPACE << 4


# --- sizes ----------------------------------------------------------------------------------
def _interval(size: int) -> int:
    """AcceleratorAllocatorConfig::roundup_power2_divisions: the 1 MiB..64 GiB interval of ``size``."""
    return min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """The next of ``divisions`` equal steps between the powers of two around ``size``."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    below = size & ~(step - 1)
    return size if below == size else below + step


def round_size(size: int, roundup_power2_divisions: tuple[int, ...] = ()) -> int:
    """Bytes a request of ``size`` takes (DeviceCachingAllocator::round_size)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = roundup_power2_divisions[_interval(size)] if roundup_power2_divisions else 0
    if divisions > 1 and size > MIN_BLOCK * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """cudaMalloc size for a request of ``size`` (already rounded) with no free block (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def format_size(nbytes: int) -> str:
    """c10's format_size, so messages read like the real allocator's."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1 << 20:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1 << 30:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / (1 << 30):.2f} GiB"


# --- configuration --------------------------------------------------------------------------
# --- the allocator --------------------------------------------------------------------------
class AllocatorOutOfMemory(Exception):
    """The modelled allocator could not find room even after freeing its cache.

    ``segment_bytes`` is what the message calls the allocation: like the real allocator,
    the size of the segment it tried to reserve (20 MiB for a 4 MiB request), not the request.
    """

    def __init__(self, *, requested_bytes: int, segment_bytes: int, reserved_bytes: int,
                 allocated_bytes: int, capacity_bytes: int) -> None:
        self.requested_bytes = requested_bytes
        self.segment_bytes = segment_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.capacity_bytes = capacity_bytes
        free_bytes = max(capacity_bytes - reserved_bytes, 0)
        super().__init__(
            f"CUDA out of memory (batchfit's allocator model). Tried to allocate {format_size(segment_bytes)} "
            f"(a request of {format_size(requested_bytes)}; {format_size(capacity_bytes)} for PyTorch; "
            f"{format_size(allocated_bytes)} already allocated; {format_size(free_bytes)} free; "
            f"{format_size(reserved_bytes)} reserved in total by PyTorch). If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        )


@dataclass(eq=False, slots=True)
class Block:
    """A piece of a segment: allocated, free (cached), or (expandable segments) not mapped."""

    addr: int
    size: int
    small: bool
    expandable: bool = False
    allocated: bool = False
    mapped: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    gc_base: int = 0  # the pool's get_free_block count when the block became free (its age's zero)
    stream: int = 0  # the stream its segment was reserved on (0: the default one)

    @property
    def whole(self) -> bool:
        """The block is its entire segment (Block::is_split is false), so cudaFree can return it."""
        return self.prev is None and self.next is None


@dataclass
class AllocatorStats:
    """torch.cuda.memory_stats' numbers for the modelled device, current and peak."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments: int = 0
    num_alloc_retries: int = 0
    """cudaMalloc retried after freeing every cached segment (torch.cuda.memory_stats' name)."""

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated, now (what the cache holds)."""
        return self.reserved_bytes - self.allocated_bytes


class CachingAllocator:
    """``malloc(ident, nbytes)`` / ``free(ident)`` as they happen; ``stats`` at any moment.

    ``capacity_bytes`` is what cudaMalloc can hand out in all (the GPU's memory less the CUDA
    context); None never runs out. ``allowed_bytes`` is the limit
    ``torch.cuda.set_per_process_memory_fraction`` sets (fraction x total memory), the only
    setting under which ``garbage_collection_threshold`` acts.
    """

    def __init__(self, capacity_bytes: int | None = None, config: AllocatorConfig | None = None, *,
                 allowed_bytes: int | None = None) -> None:
        self.config = config if config is not None else AllocatorConfig()
        self.capacity_bytes = capacity_bytes
        self.allowed_bytes = allowed_bytes
        self.stats = AllocatorStats()
        self._max_split = self.config.max_split_size_bytes or _NO_LIMIT
        self._expandable = self.config.expandable_segments
        self._gc = self.config.garbage_collection_threshold > 0 and allowed_bytes is not None
        # per pool (key: small?, stream): free mapped blocks by (size, addr); unmapped blocks by addr.
        # A block serves only requests on the stream its segment was reserved on (BlockComparatorSize
        # orders by stream first, and get_free_block takes no block of another stream).
        self._free: dict[tuple[bool, int], list[tuple[int, int, Block]]] = defaultdict(list)
        self._unmapped: dict[tuple[bool, int], list[tuple[int, Block]]] = defaultdict(list)
        self._stream = 0  # the stream of the request being served
        self._free_block_calls = {True: 0, False: 0}  # get_free_blocks_call_count, for block ages
        self._blocks: dict[int, Block] = {}
        self._next_addr = 0
        self._next_expandable = _EXPANDABLE_BASE

    # --- the two operations ----------------------------------------------------------------
    def malloc(self, ident: int, nbytes: int, stream: int = 0) -> None:
        """DeviceCachingAllocator::malloc for one tensor's storage, requested on ``stream``."""
        self._stream = stream
        size = round_size(nbytes, self.config.roundup_power2_divisions)
        small = size <= SMALL_SIZE
        alloc_size = segment_size(size)
        block = self._get_free_block(size, small)
        if block is None:
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = (self._alloc_block(size, alloc_size, small)
                     or (self._release_available_cached_blocks(size, small)
                         and self._alloc_block(size, alloc_size, small))
                     or (self._release_cached_blocks()
                         and self._alloc_block(size, alloc_size, small, retry=True)))
            if not block:
                limit = min(x for x in (self.capacity_bytes, self.allowed_bytes) if x is not None)
                raise AllocatorOutOfMemory(
                    requested_bytes=nbytes, segment_bytes=alloc_size, reserved_bytes=self.stats.reserved_bytes,
                    allocated_bytes=self.stats.allocated_bytes, capacity_bytes=limit)
        if self._should_split(block, size):
            rest = Block(block.addr + size, block.size - size, small, block.expandable, stream=block.stream)
            self._link(block, rest, block.next)
            block.size = size
            self._add_free(rest)
        block.allocated = True
        self._blocks[ident] = block
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)

    def apply(self, events: Iterable[tuple[str, int, int]], streams: Mapping[int, int] | None = None) -> None:
        """Feed ('malloc', id, nbytes) / ('free', id, 0) events, in order; ``streams`` names the
        side stream of each malloc made on one (the others are on the default stream)."""
        streams = streams or {}
        for kind, ident, nbytes in events:
            if kind == "malloc":
                self.malloc(ident, nbytes, streams.get(ident, 0))
            else:
                self.free(ident)

    def free(self, ident: int) -> None:
        """DeviceCachingAllocator::free: back to the cache, merged with free neighbours."""
        block = self._blocks.pop(ident)
        self.stats.allocated_bytes -= block.size
        block.allocated = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                self._remove_free(neighbour)
                self._merge(block, neighbour)
        self._add_free(block)

    # --- rules -----------------------------------------------------------------------------
    def _should_split(self, block: Block, size: int) -> bool:
        """should_split: with expandable segments any 512 bytes left over become a block."""
        remaining = block.size - size
        if block.small or self._expandable:
            return remaining >= MIN_BLOCK
        return size < self._max_split and remaining > SMALL_SIZE

    def _get_free_block(self, size: int, small: bool) -> Block | None:
        """get_free_block: best fit, except that oversize blocks serve only near-size oversize requests."""
        pool = self._free[small, self._stream]
        if self._gc:
            self._free_block_calls[small] += 1
        i = bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        if self._expandable:
            # A free block followed by unmapped space counts as the size it could grow to, so
            # a block that cannot grow is preferred when one is large enough.
            while i + 1 < len(pool) and _growable_size(pool[i + 1][2]) < _growable_size(pool[i][2]):
                i += 1
        block = pool[i][2]
        if size < self._max_split <= block.size:
            return None
        if size >= self._max_split and block.size >= size + self.config.max_non_split_rounding_bytes:
            return None
        del pool[i]
        return block

    # --- reserving -------------------------------------------------------------------------
    def _alloc_block(self, size: int, alloc_size: int, small: bool, retry: bool = False) -> Block | None:
        """alloc_block: a new segment (cudaMalloc), or pages mapped into the expandable one."""
        if retry:
            self.stats.num_alloc_retries += 1
        # the fraction limit is checked against alloc_size even for expandable segments
        if self.allowed_bytes is not None and self.stats.reserved_bytes + alloc_size > self.allowed_bytes:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(size, small)
        if not self._fits(alloc_size):
            return None
        block = Block(self._next_addr, alloc_size, small, stream=self._stream)
        self._next_addr += alloc_size
        self.stats.segments += 1
        self._reserve(alloc_size)
        return block

    def _fits(self, nbytes: int) -> bool:
        return self.capacity_bytes is None or self.stats.reserved_bytes + nbytes <= self.capacity_bytes

    def _reserve(self, nbytes: int) -> None:
        self.stats.reserved_bytes += nbytes
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)

    def _try_allocate_expandable_block(self, size: int, small: bool) -> Block | None:
        """try_allocate_expandable_block: map pages until a free run of ``size`` bytes exists."""
        candidate = self._find_expandable_block(size, small)
        if not candidate.mapped:
            candidate = self._map_block(candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:  # a free block followed by unmapped space
            candidate = self._map_block(candidate.next, min(size - candidate.size, candidate.next.size))
            if candidate is None:
                return None
        self._remove_free(candidate)
        return candidate

    def _find_expandable_block(self, size: int, small: bool) -> Block:
        """find_expandable_block: the lowest address where free and unmapped space add up to ``size``."""
        for _, gap in self._unmapped[small, self._stream]:
            start = gap.prev if gap.prev is not None and not gap.prev.allocated else gap
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return start
        # No segment yet (or every unmapped run is too short, which an unbounded address space never is)
        gap = Block(self._next_expandable, _EXPANDABLE_SPACE, small, expandable=True, mapped=False,
                    stream=self._stream)
        self._next_expandable += _EXPANDABLE_SPACE
        insort(self._unmapped[small, self._stream], (gap.addr, gap))
        self.stats.segments += 1
        return gap

    def _map_block(self, gap: Block, nbytes: int) -> Block | None:
        """map_block: back the start of an unmapped block with whole pages; None when they do not fit."""
        page = SMALL_BUFFER if gap.small else LARGE_BUFFER
        mapped = -(-nbytes // page) * page
        if not self._fits(mapped):  # cuMemCreate fails; the pages of this call are released
            return None
        self._remove_unmapped(gap)
        gap.mapped = True
        if mapped < gap.size:
            rest = Block(gap.addr + mapped, gap.size - mapped, gap.small, expandable=True, mapped=False,
                         stream=gap.stream)
            self._link(gap, rest, gap.next)
            insort(self._unmapped[gap.small, gap.stream], (rest.addr, rest))
            gap.size = mapped
        for neighbour in (gap.prev, gap.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                self._remove_free(neighbour)
                self._merge(gap, neighbour)
        self._add_free(gap)
        self._reserve(mapped)
        return gap

    # --- giving memory back ----------------------------------------------------------------
    def _release_block(self, block: Block) -> None:
        """release_block: cudaFree a whole cached segment."""
        self._remove_free(block)
        self.stats.reserved_bytes -= block.size
        self.stats.segments -= 1

    def _release_available_cached_blocks(self, size: int, small: bool) -> bool:
        """release_available_cached_blocks: free oversize cached segments, only enough for the request.

        Only with max_split_size set. Every free block of max_split_size or more is a whole
        segment (requests under it never get such a block, requests over it never split it),
        so each can be cudaFree'd. With expandable segments the C++ would try to cudaFree a
        piece of an expandable segment (an internal assert); the model skips this step.
        """
        if self._max_split == _NO_LIMIT or self._expandable:
            return False
        pool = self._free[small, self._stream]
        key = max(size, self._max_split)
        i = bisect_left(pool, (key, -1))
        if i < len(pool):
            self._release_block(pool[i][2])  # the smallest one that is large enough
            return True
        released = 0
        while pool and released < key and pool[-1][0] >= self._max_split:  # else largest first
            released += pool[-1][0]
            self._release_block(pool[-1][2])
        return released >= key

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks (what empty_cache does): every whole cached segment, every free page."""
        for pool in list(self._free.values()):  # every stream's
            to_unmap = []
            for _, _, block in list(pool):
                if block.expandable:
                    to_unmap.append(block)
                elif block.whole:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.whole:  # release_expandable_segment: nothing of it is mapped any more
                    self._remove_unmapped(block)
                    self.stats.segments -= 1
        return True

    def _unmap_block(self, block: Block) -> None:
        """unmap_block: return the whole pages inside a free block; slivers at its ends stay free."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        lo = -(-block.addr // page) * page
        hi = (block.addr + block.size) // page * page
        if lo >= hi:
            return
        self._remove_free(block)
        if lo > block.addr:
            before = Block(block.addr, lo - block.addr, block.small, expandable=True, stream=block.stream)
            self._link(block.prev, before, block)
            self._add_free(before)
        if hi < block.addr + block.size:
            after = Block(hi, block.addr + block.size - hi, block.small, expandable=True, stream=block.stream)
            self._link(block, after, block.next)
            self._add_free(after)
        block.addr, block.size, block.mapped = lo, hi - lo, False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                self._remove_unmapped(neighbour)
                self._merge(block, neighbour)
        insort(self._unmapped[block.small, block.stream], (block.addr, block))
        self.stats.reserved_bytes -= hi - lo

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: above threshold x allowed, free whole large segments
        that have waited in the cache at least the average age (in get_free_block calls)."""
        threshold_bytes = int(self.config.garbage_collection_threshold * self.allowed_bytes)
        if self.stats.reserved_bytes <= threshold_bytes:
            return
        target = self.stats.reserved_bytes - threshold_bytes
        now = self._free_block_calls[False]
        ages = [now - b.gc_base for b in self._large_free() if b.whole]
        total_age, count = sum(ages), len(ages)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            # frees every old enough block, not just enough of them, so GC runs seldom
            for block in self._large_free():
                if block.whole and now - block.gc_base >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= now - block.gc_base
                    count -= 1
                    self._release_block(block)

    # --- bookkeeping -----------------------------------------------------------------------
    def _large_free(self) -> list[Block]:
        """The large pool's free blocks, every stream's (a snapshot)."""
        return [block for (small, _), pool in self._free.items() if not small for _, _, block in pool]

    def _add_free(self, block: Block) -> None:
        block.gc_base = self._free_block_calls[block.small]
        insort(self._free[block.small, block.stream], (block.size, block.addr, block))

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.small, block.stream]
        del pool[bisect_left(pool, (block.size, block.addr))]

    def _remove_unmapped(self, block: Block) -> None:
        gaps = self._unmapped[block.small, block.stream]
        del gaps[bisect_left(gaps, (block.addr,))]

    @staticmethod
    def _link(before: Block | None, block: Block, after: Block | None) -> None:
        """Put ``block`` between its neighbours in the segment."""
        block.prev, block.next = before, after
        if before is not None:
            before.next = block
        if after is not None:
            after.prev = block

    @staticmethod
    def _merge(dst: Block, src: Block) -> None:
        """try_merge_blocks: ``dst`` absorbs its neighbour ``src`` (already out of its list)."""
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size


def _growable_size(block: Block) -> int:
    """get_free_block's expandable_size: the block plus the unmapped space right after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


def replay(events: Iterable[tuple[str, int, int]], *, capacity_bytes: int | None = None,
           config: AllocatorConfig | None = None, expandable_segments: bool | None = None) -> AllocatorStats:
    """Replay ('malloc', id, nbytes) / ('free', id, 0) events; return the allocator's stats.

    ``expandable_segments`` overrides ``config``'s (a shorthand for the common comparison).
    With ``capacity_bytes`` the allocator frees its cache where the real one would, and
    raises ``AllocatorOutOfMemory`` where the real one would.
    """
    config = config if config is not None else AllocatorConfig()
    if expandable_segments is not None:
        config = replace(config, expandable_segments=expandable_segments)
    allocator = CachingAllocator(capacity_bytes, config)
    allocator.apply(events)
    return allocator.stats
