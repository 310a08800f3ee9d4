"""The caching allocator model against hand-worked sequences and PyTorch's documented rules."""

from __future__ import annotations

from batchfit.trace.allocator import CachingAllocator, replay, round_size, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 4097)] == [512, 512, 1024, 4608]
    assert segment_size(512) == 2 * MiB           # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB       # 1 MiB is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB  # large, under 10 MiB: 20 MiB segments
    assert segment_size(10 * MiB) == 10 * MiB      # 10 MiB and up: rounded to 2 MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_one_2mib_segment():
    a = CachingAllocator()
    for i in range(4):
        a.malloc(i, 1000)  # 1024 bytes each, split from the same segment
    assert (a.stats.reserved_bytes, a.stats.segments, a.stats.allocated_bytes) == (2 * MiB, 1, 4096)


def test_a_freed_block_is_reused():
    stats = replay([("malloc", 1, 4 * MiB), ("free", 1, 0), ("malloc", 2, 3 * MiB)])
    assert stats.reserved_bytes == 20 * MiB and stats.segments == 1


def test_a_split_leaves_the_rest_free_for_the_next_request():
    a = CachingAllocator()
    a.malloc(1, 12 * MiB)      # its own 12 MiB segment
    a.free(1)
    a.malloc(2, 4 * MiB)       # best fit: the 12 MiB block, split (8 MiB left > 1 MiB)
    a.malloc(3, 8 * MiB)       # the rest serves this one
    assert (a.stats.reserved_bytes, a.stats.segments) == (12 * MiB, 1)


def test_no_split_when_the_rest_is_too_small_for_the_large_pool():
    a = CachingAllocator()
    a.malloc(1, 12 * MiB)
    a.free(1)
    a.malloc(2, 11 * MiB + 512)  # the rest (512 KiB) is not worth a block in the large pool
    assert a.stats.allocated_bytes == 12 * MiB  # the whole block is handed out


def test_a_new_segment_when_nothing_free_fits_and_fragmentation_shows():
    a = CachingAllocator()
    a.malloc(1, 12 * MiB)
    a.malloc(2, 12 * MiB)
    a.free(1)                  # 12 MiB free, but cached
    a.malloc(3, 14 * MiB)      # does not fit: a third segment
    assert a.stats.reserved_bytes == 38 * MiB and a.stats.segments == 3
    assert a.stats.fragmentation_bytes == 12 * MiB


def test_freed_neighbours_merge():
    a = CachingAllocator()
    a.malloc(1, 4 * MiB)
    a.malloc(2, 4 * MiB)       # both from one 20 MiB segment
    a.free(1)
    a.free(2)                  # merge back into one 20 MiB free block
    a.malloc(3, 18 * MiB)
    assert (a.stats.reserved_bytes, a.stats.segments) == (20 * MiB, 1)


def test_max_split_size_keeps_big_blocks_whole():
    a = CachingAllocator(max_split_size=16 * MiB)
    a.malloc(1, 40 * MiB)
    a.free(1)
    a.malloc(2, 4 * MiB)       # may not use (or split) the 40 MiB oversize block
    assert a.stats.reserved_bytes == 60 * MiB


def test_expandable_segments_grow_instead_of_fragmenting():
    events = [("malloc", 1, 12 * MiB), ("malloc", 2, 12 * MiB), ("free", 1, 0), ("malloc", 3, 14 * MiB)]
    assert replay(events).peak_reserved_bytes == 38 * MiB
    assert replay(events, expandable_segments=True).peak_reserved_bytes == 40 * MiB  # two 20 MiB pages
    churn = [("malloc", i, (10 + i % 7) * MiB) for i in range(50)] + [("free", i, 0) for i in range(50)]
    churn += [("malloc", 100, 600 * MiB)]
    assert replay(churn, expandable_segments=True).peak_reserved_bytes < replay(churn).peak_reserved_bytes
