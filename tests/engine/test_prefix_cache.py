"""The prefix cache's radix tree on its own: matching, splitting, holding, eviction, and when a
draft's cached K/V may be reused. Expected values are worked out by hand from the inserted keys."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.engine.memory.prefix_cache import DraftKV, PrefixCache  # noqa: E402


def slots(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_a_prefix_is_found_split_and_held_until_released():
    cache = PrefixCache(DraftKV.NONE)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13), 0, None)
    assert (cache.size, cache.evictable) == (4, 4)
    hit = cache.match([1, 2, 3, 9, 9], limit=10)
    assert (hit.length, hit.draft_length, hit.slots.tolist()) == (3, 0, [10, 11, 12])
    assert cache.evictable == 1, "the three held positions are not evictable; the fourth is"
    assert cache.evict(4).tolist() == [13], "a held prefix is never evicted"
    cache.release(hit.node)
    assert cache.evictable == 3
    assert cache.match([5], limit=10) is None


def test_the_limit_leaves_positions_to_prefill():
    cache = PrefixCache(DraftKV.NONE)
    cache.insert([1, 2, 3], slots(10, 11, 12), 0, None)
    hit = cache.match([1, 2, 3], limit=2)  # the caller keeps its last prompt position to compute
    assert hit.length == 2 and hit.slots.tolist() == [10, 11]


def test_an_insert_keeps_the_trees_slots_and_returns_the_callers_duplicates():
    cache = PrefixCache(DraftKV.NONE)
    cache.insert([1, 2, 3], slots(10, 11, 12), 0, None)
    node, duplicates = cache.insert([1, 2, 3, 4, 5], slots(20, 21, 22, 23, 24), 0, None)
    assert duplicates.tolist() == [20, 21, 22], "positions the tree had are the caller's to free"
    assert cache.path_slots(node).tolist() == [10, 11, 12, 23, 24]
    assert cache.size == 5
    # The caller's own slots (a request that matched them) are not duplicates.
    _, duplicates = cache.insert([1, 2, 7], slots(10, 11, 30), 0, None)
    assert duplicates.numel() == 0 and cache.size == 6


def test_eviction_takes_least_recently_used_leaves_from_their_tails():
    cache = PrefixCache(DraftKV.NONE)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13), 0, None)
    cache.insert([5, 6], slots(20, 21), 0, None)
    cache.release(cache.match([1, 2, 3, 4], limit=9).node)  # [1, 2, 3, 4] is now the more recent
    freed = cache.evict(3)
    # Least recently used first: the leaf [5, 6] (2 positions), then the tail of [1, 2, 3, 4].
    assert freed.tolist() == [20, 21, 13]
    assert (cache.size, cache.evictable, cache.evicted) == (3, 3, 3)
    assert cache.match([1, 2, 3, 4], limit=9).slots.tolist() == [10, 11, 12]


def test_a_standalone_drafts_kv_is_reused_as_far_as_it_was_valid():
    cache = PrefixCache(DraftKV.SAME)
    cache.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14), 3, None)  # draft K/V for 3 positions
    hit = cache.match([1, 2, 3, 4, 5, 6], limit=9)
    assert (hit.length, hit.draft_length) == (5, 3), "target K/V for 5 positions, draft K/V for 3"
    cache.release(hit.node)
    # The same request's slots inserted again with more draft K/V (it caught up over them).
    cache.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14), 5, None)
    assert cache.match([1, 2, 3, 4, 5, 6], limit=9).draft_length == 5


def test_a_heads_kv_is_keyed_by_the_next_token_too():
    """An EAGLE head's K/V at position p read the token at p + 1: a prompt that parts from a cached
    one at p + 1 may not reuse position p, and each branch keeps its own slot there."""
    cache = PrefixCache(DraftKV.NEXT)
    _, refused = cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13), 4, next_token=7)
    assert refused.numel() == 0 and cache.size == 4
    same_next = cache.match([1, 2, 3, 4, 7, 8], limit=9)
    assert (same_next.length, same_next.draft_length) == (4, 4)
    cache.release(same_next.node)
    other_next = cache.match([1, 2, 3, 4, 9], limit=9)
    assert (other_next.length, other_next.draft_length) == (3, 3), "position 3's head K/V read 7, not 9"
    cache.release(other_next.node)
    # A prompt that parts after position 1: its own slot for position 1 is cached beside the first's.
    _, refused = cache.insert([1, 2, 5, 6], slots(10, 40, 41, 42), 4, next_token=0)
    assert refused.tolist() == [], "position 1 under the pair (2, 5) is new, not a duplicate"
    assert cache.match([1, 2, 5, 6, 0], limit=9).slots.tolist() == [10, 40, 41, 42]
    assert cache.match([1, 2, 3, 4, 7], limit=9).slots.tolist() == [10, 11, 12, 13]
    assert cache.match([1, 2, 8], limit=9).length == 1, "position 1's head K/V read 3 or 5, never 8"


def test_a_heads_positions_are_cached_only_once_valid():
    cache = PrefixCache(DraftKV.NEXT)
    # Three positions, the last one's next token unknown: two are cacheable, the third comes back.
    _, refused = cache.insert([1, 2, 3], slots(10, 11, 12), 3, next_token=None)
    assert refused.tolist() == [12] and cache.size == 2
    # Head K/V valid for two positions of five (the head had not caught up): the rest come back.
    _, refused = cache.insert([5, 6, 7, 8, 9], slots(20, 21, 22, 23, 24), 2, next_token=1)
    assert refused.tolist() == [22, 23, 24]
    hit = cache.match([5, 6, 7, 8, 9, 1], limit=9)
    assert (hit.length, hit.draft_length) == (2, 2), "the head would need target features past position 2"
    assert cache.keyable(5, 2, 1) == 2 and cache.keyable(3, 3, None) == 2


def test_holding_counts_each_node_once_per_holder():
    cache = PrefixCache(DraftKV.NONE)
    cache.insert([1, 2, 3], slots(10, 11, 12), 0, None)
    a = cache.match([1, 2, 3, 4], limit=9)
    b = cache.match([1, 2, 3, 5], limit=2)
    assert cache.evictable == 0
    cache.release(a.node)
    assert cache.evictable == 1, "position 2 is free again; positions 0-1 are still held by b"
    cache.release(b.node)
    assert cache.evictable == 3
