"""The caching allocator model against hand-worked sequences and the rules of CUDACachingAllocator.cpp.

Checked against batchfit's own model of CUDACachingAllocator.cpp on hand-worked sequences (checks the model's rules,
not its fidelity to a GPU: test_gpu_timelines.py checks that)."""

from __future__ import annotations

import pytest

from batchfit.errors import OptionError
from batchfit.trace.allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocator,
    parse_alloc_conf,
    replay,
    round_size,
    segment_size,
)

MiB = 1 << 20
GiB = 1 << 30


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 4097)] == [512, 512, 1024, 4608]
    assert segment_size(512) == 2 * MiB           # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB       # 1 MiB is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB  # large, under 10 MiB: 20 MiB segments
    assert segment_size(10 * MiB) == 10 * MiB      # 10 MiB and up: rounded to 2 MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB


def test_roundup_power2_divisions():
    four = (4,) * 16  # 1 MiB..2 MiB in steps of 256 KiB, 2..4 MiB in steps of 512 KiB, ...
    assert round_size(1 * MiB + 1, four) == 1 * MiB + 256 * 1024
    assert round_size(3 * MiB, four) == 3 * MiB           # already on a step
    assert round_size(3 * MiB + 1, four) == 3 * MiB + 512 * 1024
    assert round_size(4 * MiB, four) == 4 * MiB           # powers of two stay
    assert round_size(1000, four) == 1024                 # under 512 x divisions: plain 512 rounding
    a = CachingAllocator(config=AllocatorConfig(roundup_power2_divisions=four))
    a.malloc(1, 1 * MiB + 1)
    assert a.stats.allocated_bytes == 1 * MiB + 256 * 1024


def test_small_requests_share_one_2mib_segment():
    a = CachingAllocator()
    for i in range(4):
        a.malloc(i, 1000)  # 1024 bytes each, split from the same segment
    assert (a.stats.reserved_bytes, a.stats.segments, a.stats.allocated_bytes) == (2 * MiB, 1, 4096)
    b = CachingAllocator()
    b.malloc(1, 1 * MiB)   # small pool: the 1 MiB left (>= 512 bytes) is split off ...
    b.malloc(2, 1 * MiB)   # ... and serves the next one
    assert (b.stats.reserved_bytes, b.stats.allocated_bytes) == (2 * MiB, 2 * MiB)


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


def test_large_pool_splits_only_when_more_than_1mib_is_left():
    a = CachingAllocator()
    a.malloc(1, 12 * MiB)
    a.free(1)
    a.malloc(2, 11 * MiB)            # exactly 1 MiB left: not more than 1 MiB, no split
    assert a.stats.allocated_bytes == 12 * MiB
    b = CachingAllocator()
    b.malloc(1, 12 * MiB)
    b.free(1)
    b.malloc(2, 11 * MiB - 512)      # 1 MiB + 512 bytes left: split
    assert b.stats.allocated_bytes == 11 * MiB - 512


def test_expandable_segments_split_any_rest_of_512_bytes():
    # should_split: with expandable segments the large pool splits like the small pool
    plain = CachingAllocator()
    plain.malloc(1, 20 * MiB - 512 * 1024)   # a 20 MiB segment (2 MiB rounding), 512 KiB left: kept whole
    plain.malloc(2, 2 * MiB)                 # a new 20 MiB segment, split
    assert (plain.stats.allocated_bytes, plain.stats.reserved_bytes) == (22 * MiB, 40 * MiB)
    grown = CachingAllocator(config=AllocatorConfig(expandable_segments=True))
    grown.malloc(1, 20 * MiB - 512 * 1024)   # one 20 MiB page; the 512 KiB rest becomes a free block
    grown.malloc(2, 2 * MiB)                 # that block plus the next page serve this one
    assert (grown.stats.allocated_bytes, grown.stats.reserved_bytes) == (21 * MiB + 512 * 1024, 40 * MiB)
    exact = CachingAllocator(config=AllocatorConfig(expandable_segments=True))
    exact.malloc(1, 20 * MiB - 512)          # 512 bytes left: still split
    assert exact.stats.allocated_bytes == 20 * MiB - 512


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
    config = AllocatorConfig(max_split_size_bytes=32 * MiB)
    a = CachingAllocator(config=config)
    a.malloc(1, 40 * MiB)
    a.free(1)
    a.malloc(2, 4 * MiB)       # may not use (or split) the 40 MiB oversize block: a 20 MiB segment
    assert a.stats.reserved_bytes == 60 * MiB
    a.malloc(3, 36 * MiB)      # oversize request, block less than 20 MiB larger: taken whole
    assert (a.stats.reserved_bytes, a.stats.allocated_bytes) == (60 * MiB, 4 * MiB + 40 * MiB)


def test_max_non_split_rounding_bounds_how_much_larger_an_oversize_block_may_be():
    events = [("malloc", 1, 60 * MiB), ("free", 1, 0), ("malloc", 2, 38 * MiB)]
    default = AllocatorConfig(max_split_size_bytes=32 * MiB)   # 60 >= 38 + 20: a new 38 MiB segment
    assert replay(events, config=default).reserved_bytes == 98 * MiB
    wider = parse_alloc_conf("max_split_size_mb:32,max_non_split_rounding_mb:64")  # 60 < 38 + 64
    assert replay(events, config=wider).reserved_bytes == 60 * MiB


def _three_400s_free_the_middle(a: CachingAllocator) -> None:
    for i in range(3):
        a.malloc(i, 400 * MiB)
    a.free(1)


def test_fragmentation_grows_reserved_without_a_capacity():
    a = CachingAllocator()
    _three_400s_free_the_middle(a)
    a.malloc(9, 500 * MiB)     # the free 400 MiB block is too small: a fourth segment
    assert (a.stats.reserved_bytes, a.stats.allocated_bytes) == (1700 * MiB, 1300 * MiB)


def test_near_capacity_the_cached_segment_is_freed_and_the_retry_succeeds():
    a = CachingAllocator(capacity_bytes=1600 * MiB)
    _three_400s_free_the_middle(a)
    a.malloc(9, 500 * MiB)     # 1200 + 500 > 1600: cudaFree the cached 400 MiB, then 800 + 500 fits
    assert (a.stats.reserved_bytes, a.stats.peak_reserved_bytes) == (1300 * MiB, 1300 * MiB)
    assert (a.stats.segments, a.stats.num_alloc_retries) == (3, 1)


def test_out_of_memory_after_freeing_the_cache_carries_the_numbers():
    a = CachingAllocator(capacity_bytes=1250 * MiB)
    _three_400s_free_the_middle(a)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        a.malloc(9, 500 * MiB)  # 800 + 500 > 1250 even with the cache empty
    oom = caught.value
    assert (oom.requested_bytes, oom.segment_bytes, oom.capacity_bytes) == (500 * MiB, 500 * MiB, 1250 * MiB)
    assert (oom.reserved_bytes, oom.allocated_bytes) == (800 * MiB, 800 * MiB)  # the cache was freed first
    assert "Tried to allocate 500.00 MiB" in str(oom) and "800.00 MiB reserved in total by PyTorch" in str(oom)


def test_out_of_memory_names_the_segment_like_the_real_message():
    a = CachingAllocator(capacity_bytes=10 * MiB)
    with pytest.raises(AllocatorOutOfMemory, match="Tried to allocate 20.00 MiB") as caught:
        a.malloc(1, 4 * MiB)    # a 4 MiB request wants a 20 MiB segment
    assert caught.value.requested_bytes == 4 * MiB


def test_max_split_size_frees_only_enough_oversize_segments():
    config = AllocatorConfig(max_split_size_bytes=256 * MiB)
    a = CachingAllocator(2200 * MiB, config)
    for i, size in enumerate((600, 700, 800)):
        a.malloc(i, size * MiB)
    for i in range(3):
        a.free(i)
    a.malloc(9, 550 * MiB)     # 600 >= 550 + 20: not reused; 2100 + 550 > 2200
    # release_available_cached_blocks: the smallest cached segment >= 550 MiB (600) only
    assert (a.stats.reserved_bytes, a.stats.num_alloc_retries) == (2050 * MiB, 0)
    b = CachingAllocator(2200 * MiB)  # without max_split_size: an 850 MiB request frees every cached segment
    c = CachingAllocator(2200 * MiB, config)  # with it: the largest ones, 800 + 700 >= 850
    for allocator in (b, c):
        for i, size in enumerate((600, 700, 800)):
            allocator.malloc(i, size * MiB)
        for i in range(3):
            allocator.free(i)
        allocator.malloc(9, 850 * MiB)
    assert (b.stats.reserved_bytes, b.stats.num_alloc_retries) == (850 * MiB, 1)
    assert (c.stats.reserved_bytes, c.stats.num_alloc_retries) == (1450 * MiB, 0)


def test_max_split_size_frees_the_largest_oversize_segments_first():
    a = CachingAllocator(1600 * MiB, AllocatorConfig(max_split_size_bytes=256 * MiB))
    for i in range(3):
        a.malloc(i, 400 * MiB)
    a.free(0)
    a.free(1)
    a.malloc(9, 500 * MiB)     # none >= 500 cached: free 400 + 400 >= 500, then 400 + 500 fits
    assert (a.stats.reserved_bytes, a.stats.num_alloc_retries) == (900 * MiB, 0)


def test_a_75gib_step_is_not_reported_as_102gib_on_an_80gib_gpu():
    # 27 x 1 GiB of activations freed (cached), then 25 x 3 GiB that cannot reuse them
    events = [("malloc", i, GiB) for i in range(27)] + [("free", i, 0) for i in range(27)]
    events += [("malloc", 100 + i, 3 * GiB) for i in range(25)]
    assert replay(events).peak_reserved_bytes == 102 * GiB
    stats = replay(events, capacity_bytes=80 * GiB)
    # the 18th 3 GiB request finds 27 + 51 = 78 GiB reserved and 81 > 80: the cache is freed
    assert (stats.peak_reserved_bytes, stats.reserved_bytes) == (78 * GiB, 75 * GiB)
    assert (stats.peak_allocated_bytes, stats.num_alloc_retries) == (75 * GiB, 1)


def test_expandable_segments_grow_instead_of_fragmenting():
    events = [("malloc", 1, 12 * MiB), ("malloc", 2, 12 * MiB), ("free", 1, 0), ("malloc", 3, 14 * MiB)]
    assert replay(events).peak_reserved_bytes == 38 * MiB
    assert replay(events, expandable_segments=True).peak_reserved_bytes == 40 * MiB  # two 20 MiB pages
    churn = [("malloc", i, (10 + i % 7) * MiB) for i in range(50)] + [("free", i, 0) for i in range(50)]
    churn += [("malloc", 100, 600 * MiB)]
    assert replay(churn, expandable_segments=True).peak_reserved_bytes < replay(churn).peak_reserved_bytes


def _expandable_hole(capacity_bytes: int) -> CachingAllocator:
    a = CachingAllocator(capacity_bytes, AllocatorConfig(expandable_segments=True))
    a.malloc(1, 40 * MiB)      # pages 0-1
    a.malloc(2, 40 * MiB)      # pages 2-3: 80 MiB mapped
    a.free(1)                  # 40 MiB free at the start, too small for the next request
    return a


def test_expandable_segments_unmap_free_pages_before_giving_up():
    a = _expandable_hole(100 * MiB)
    a.malloc(3, 60 * MiB)      # 80 + 60 > 100: unmap the free 40 MiB, then map 60 MiB at the end
    assert (a.stats.reserved_bytes, a.stats.peak_reserved_bytes, a.stats.num_alloc_retries) == (
        100 * MiB, 100 * MiB, 1)
    a.free(3)
    a.malloc(4, 40 * MiB)      # the freed 60 MiB block is reused and split: nothing mapped
    assert (a.stats.reserved_bytes, a.stats.allocated_bytes) == (100 * MiB, 80 * MiB)
    b = _expandable_hole(90 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        b.malloc(3, 60 * MiB)  # 40 + 60 > 90 even with the free pages unmapped
    assert (caught.value.reserved_bytes, caught.value.allocated_bytes) == (40 * MiB, 40 * MiB)


def test_garbage_collection_frees_old_cached_segments_before_cudamalloc():
    events = [("malloc", 1, 30 * MiB), ("free", 1, 0),  # cached at get_free_block call 1
              ("malloc", 2, 40 * MiB), ("malloc", 3, 50 * MiB), ("free", 3, 0),  # 120 MiB; cached at call 3
              ("malloc", 4, 60 * MiB)]  # call 4: 120 > 0.5 x 200; ages 3 and 1, mean 2: free the 30 only
    config = AllocatorConfig(garbage_collection_threshold=0.5)
    a = CachingAllocator(config=config, allowed_bytes=200 * MiB)  # set_per_process_memory_fraction
    for kind, ident, nbytes in events:
        a.malloc(ident, nbytes) if kind == "malloc" else a.free(ident)
    assert (a.stats.reserved_bytes, a.stats.fragmentation_bytes) == (150 * MiB, 50 * MiB)
    assert a.stats.num_alloc_retries == 0
    # with no fraction set, the threshold does nothing: both cached segments stay
    assert replay(events, config=config).reserved_bytes == 180 * MiB


def test_parse_alloc_conf():
    config = parse_alloc_conf("max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6")
    assert (config.max_split_size_bytes, config.expandable_segments, config.garbage_collection_threshold) == (
        128 * MiB, True, 0.6)
    assert parse_alloc_conf("") == AllocatorConfig()
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    # 256 MB is interval 8 ([256 MiB, 512 MiB)); the first bound also covers the smaller ones
    divisions = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]").roundup_power2_divisions
    assert divisions == (1,) * 9 + (2,) + (4,) * 6
    # keys for pinned host memory are accepted and change nothing on the device
    assert parse_alloc_conf("pinned_use_background_threads:True,expandable_segments:False") == AllocatorConfig()


@pytest.mark.parametrize(("text", "hint"), [
    ("max_split_size_mb:10", "max_split_size_mb must be >= 20, e.g. max_split_size_mb:128"),
    ("max_split_size_mb:big", "whole number"),
    ("expandable_segments:true", "e.g. expandable_segments:True"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold:0.6"),
    ("roundup_power2_divisions:3", "powers of two"),
    ("max_split_size_mb=128", "unknown key"),
    ("max_split_size_mb:128 expandable_segments:True", "whole number"),
    ("backend:cudaMalloc", "backend:native"),
])
def test_parse_alloc_conf_says_what_to_write(text, hint):
    with pytest.raises(OptionError, match=hint):
        parse_alloc_conf(text)


def test_from_env_prefers_pytorch_alloc_conf():
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    assert AllocatorConfig.from_env(both) == AllocatorConfig(expandable_segments=True)
    old = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    assert AllocatorConfig.from_env(old) == AllocatorConfig(max_split_size_bytes=64 * MiB)
    assert AllocatorConfig.from_env({}) == AllocatorConfig()


def test_config_validates_like_the_parser():
    with pytest.raises(OptionError, match="max_split_size_mb:128"):
        AllocatorConfig(max_split_size_bytes=16 * MiB)


def _check_bookkeeping(a: CachingAllocator) -> None:
    """Every block reachable from the lists, walked segment by segment, adds up to the stats."""
    blocks = list(a._blocks.values())
    for pool in a._free.values():  # keyed (small?, stream)
        blocks += [b for _, _, b in pool]
    for gaps in a._unmapped.values():
        blocks += [b for _, b in gaps]
    heads = set()
    for block in blocks:
        while block.prev is not None:
            assert block.prev.next is block and block.prev.addr + block.prev.size == block.addr
            block = block.prev
        heads.add(block)
    mapped = allocated = 0
    for head in heads:
        block = head
        while block is not None:
            mapped += block.size if block.mapped else 0
            allocated += block.size if block.allocated else 0
            block = block.next
    assert (mapped, allocated) == (a.stats.reserved_bytes, a.stats.allocated_bytes)
    assert a.capacity_bytes is None or a.stats.peak_reserved_bytes <= a.capacity_bytes


@pytest.mark.parametrize("expandable, streams", [(False, 1), (True, 1), (False, 3), (True, 3)])
def test_bookkeeping_survives_random_traffic_and_running_out(expandable, streams):
    import random

    rng = random.Random(7)
    a = CachingAllocator(600 * MiB, AllocatorConfig(expandable_segments=expandable, max_split_size_bytes=64 * MiB))
    live: list[int] = []
    ooms = 0
    for i in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                a.malloc(i, rng.choice([300, 5000, 1 << 20, 3 << 20, rng.randrange(1, 90 << 20)]),
                         rng.randrange(streams))
                live.append(i)
            except AllocatorOutOfMemory:
                ooms += 1
        if i % 100 == 0:
            _check_bookkeeping(a)
    _check_bookkeeping(a)
    assert ooms > 0  # the capacity was reached, so the free-and-retry paths ran


@pytest.mark.parametrize("expandable", [False, True])
def test_a_block_freed_on_one_stream_serves_only_that_stream(expandable):
    """CUDACachingAllocator's pools sort by stream first and get_free_block takes no block of
    another stream: 100 MiB freed on a side stream (FSDP2's gradients, made on its reduce-scatter
    stream and freed by zero_grad) stay reserved while the default stream reserves 100 MiB more;
    the side stream's next 100 MiB reuses them. Running out frees every stream's cache."""
    a = CachingAllocator(None, AllocatorConfig(expandable_segments=expandable))
    a.apply([("malloc", 1, 100 * MiB), ("free", 1, 0), ("malloc", 2, 100 * MiB)], streams={1: 1})
    assert (a.stats.reserved_bytes, a.stats.allocated_bytes) == (200 * MiB, 100 * MiB)
    a.malloc(3, 100 * MiB, stream=1)
    assert a.stats.reserved_bytes == 200 * MiB  # the side stream's own cached block
    a.free(3)
    b = CachingAllocator(220 * MiB, AllocatorConfig(expandable_segments=expandable))
    b.apply([("malloc", 1, 100 * MiB), ("free", 1, 0), ("malloc", 2, 100 * MiB), ("malloc", 3, 100 * MiB)],
            streams={1: 1})  # the side stream's cached 100 MiB is released for the third
    assert (b.stats.reserved_bytes, b.stats.num_alloc_retries) == (200 * MiB, 1)
