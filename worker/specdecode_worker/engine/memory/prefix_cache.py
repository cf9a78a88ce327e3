"""The prefix cache: a radix tree over token prefixes whose KV slots later prompts reuse.

A request that ends (or is retracted, or has just finished its prefill) leaves its KV in the
tree, keyed by its tokens. A later request that starts with the same tokens takes those slots for
its first positions and prefills only the rest. One slot index addresses every pool of a
deployment (target, standalone draft, EAGLE head, NextN layer), so one tree caches them all; what
differs is when a draft's K/V at a cached position may be reused (``DraftKV``).

Slots in the tree are reference counted by the running requests whose rows hold them. A node no
request holds is evictable: eviction takes least recently used leaves (a leaf's tail first), and
only when the allocator is short. Slots of rejected draft tokens never enter the tree: a request
inserts its committed positions only.

Pure bookkeeping over host tensors of slot numbers: ``KVSlots`` moves slots between the tree, the
allocator and the request rows.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import Enum

import torch


class DraftKV(Enum):
    """What a draft's K/V at position p was computed from, which says when another request may reuse it."""

    NONE = "no draft pool (NONE, NGRAM)"
    SAME = "tokens 0..p, like the target's (a standalone draft model)"
    # An EAGLE head's or NextN layer's K/V at p reads the target's feature at p and the token at
    # p + 1, so the tree keys position p by the pair (token p, token p + 1): two prompts that part
    # at p + 1 each keep their own slot for p.
    NEXT = "tokens 0..p + 1 (an EAGLE head or NextN layer)"


Key = int | tuple[int, int]


@dataclass(eq=False)
class Node:
    key: list[Key]  # one per position this node covers
    slots: torch.Tensor  # their KV slots, int64 on the host
    parent: Node | None = None
    children: dict[Key, Node] = field(default_factory=dict)
    draft_valid: int = 0  # leading positions whose draft K/V is valid too (DraftKV.SAME)
    refs: int = 0  # running requests whose rows hold this node's slots
    last_used: int = 0


@dataclass(frozen=True)
class Hit:
    """The cached positions a request takes: ``length`` of them (``draft_length`` with their draft
    K/V too), held through ``node`` until the request gives them back."""

    length: int
    draft_length: int
    node: Node
    slots: torch.Tensor  # positions 0 .. length - 1


class PrefixCache:
    def __init__(self, draft_kv: DraftKV):
        self.draft_kv = draft_kv
        self.root = Node([], torch.empty(0, dtype=torch.int64), refs=1)
        self.size = 0  # positions the tree holds
        self.evictable = 0  # of them, positions no running request holds
        self.evicted = 0  # positions evicted so far
        self._clock = itertools.count(1)

    def _keys(self, tokens: list[int], next_token: int | None = None) -> list[Key]:
        """The key of each position of ``tokens`` the tree can hold (under DraftKV.NEXT the last
        one needs ``next_token``)."""
        if self.draft_kv is not DraftKV.NEXT:
            return list(tokens)
        after = tokens[1:] + ([next_token] if next_token is not None else [])
        return list(zip(tokens, after))

    def keyable(self, n: int, draft_valid: int, next_token: int | None) -> int:
        """How many of ``n`` positions an insert would cache (the rest are not reusable yet)."""
        if self.draft_kv is not DraftKV.NEXT:
            return n
        return min(draft_valid, n if next_token is not None else n - 1)

    # ---- lookups ---------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> Hit | None:
        """The longest reusable prefix of ``tokens``, at most ``limit`` positions, held for the
        caller (``release`` gives it back); None when nothing is reusable."""
        path = self._walk(self._keys(tokens)[:limit])
        length = sum(len(n.key) for n in path)
        if length <= 0:
            return None
        node = path[-1]
        self.hold(node)
        if self.draft_kv is DraftKV.NONE:
            draft = 0
        elif self.draft_kv is DraftKV.NEXT:
            draft = length  # every cached position's head K/V is valid (its next token is keyed)
        else:
            draft = 0
            for n in path:
                draft += n.draft_valid
                if n.draft_valid < len(n.key):
                    break
        return Hit(length, draft, node, torch.cat([n.slots for n in path]))

    def _walk(self, keys: list[Key]) -> list[Node]:
        """The nodes along ``keys``, the last one split where the match ends."""
        path, node, i, now = [], self.root, 0, next(self._clock)
        while i < len(keys) and (child := node.children.get(keys[i])) is not None:
            common = common_prefix(child.key, keys, i)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = now
            path.append(child)
            node, i = child, i + common
        return path

    # ---- holding -------------------------------------------------------------------------------
    def hold(self, node: Node) -> None:
        while node is not self.root:
            if node.refs == 0:
                self.evictable -= len(node.key)
            node.refs += 1
            node = node.parent

    def release(self, node: Node) -> None:
        while node is not self.root:
            node.refs -= 1
            if node.refs == 0:
                self.evictable += len(node.key)
            node = node.parent

    def shared(self, node: Node) -> int:
        """Positions from the root to the end of ``node`` that more than one request holds."""
        count = 0
        while node is not self.root:
            count += len(node.key) if node.refs > 1 else 0
            node = node.parent
        return count

    @staticmethod
    def path_slots(node: Node) -> torch.Tensor:
        """The slots of every position from the root to the end of ``node``."""
        parts = []
        while node.parent is not None:
            parts.append(node.slots)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)

    # ---- inserting -----------------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: torch.Tensor, draft_valid: int, next_token: int | None
               ) -> tuple[Node, torch.Tensor]:
        """Cache ``slots`` (host, one per token) as the KV of ``tokens``; ``draft_valid``: their
        leading positions with valid draft K/V, ``next_token``: the token after them (None: unknown).

        Returns the node that ends the cached path (not held), and the slots the caller frees:
        those of positions the tree held already under another slot, and those of positions it
        cannot cache yet (``keyable``).
        """
        n = self.keyable(len(tokens), draft_valid, next_token)
        keys = self._keys(tokens, next_token)[:n]
        if self.draft_kv is not DraftKV.SAME:
            draft_valid = n
        node, i, now, refused = self.root, 0, next(self._clock), [slots[n:]]
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                child = Node(keys[i:], slots[i:n].clone(), parent=node, last_used=now,
                             draft_valid=max(0, min(draft_valid - i, n - i)))
                node.children[keys[i]] = child
                self.size += len(child.key)
                self.evictable += len(child.key)
                node = child
                break
            common = common_prefix(child.key, keys, i)
            if common < len(child.key):
                child = self._split(child, common)
            mine = slots[i : i + common]
            same = child.slots == mine
            if bool(same.all()):  # the caller's own slots: its draft may have caught up over them
                child.draft_valid = max(child.draft_valid, min(draft_valid - i, common))
            else:
                refused.append(mine[~same])
            child.last_used = now
            node, i = child, i + common
        return node, torch.cat(refused)

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` positions; returns the new first part (the parent of the rest)."""
        head = Node(node.key[:at], node.slots[:at], parent=node.parent, refs=node.refs, last_used=node.last_used,
                    draft_valid=min(node.draft_valid, at))
        node.parent.children[node.key[0]] = head
        node.key, node.slots, node.parent = node.key[at:], node.slots[at:], head
        node.draft_valid = max(0, node.draft_valid - at)
        head.children[node.key[0]] = node
        return head

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, n: int) -> torch.Tensor:
        """Free at least ``n`` positions no request holds (as many as there are, if fewer), least
        recently used leaves first, a long leaf from its tail; returns their slots."""
        leaves = [(node.last_used, id(node), node) for node in self._nodes() if not node.children and not node.refs]
        heapq.heapify(leaves)
        freed, count = [], 0
        while count < n and leaves:
            _, _, node = heapq.heappop(leaves)
            keep = len(node.key) - (n - count)
            if keep > 0:  # only the tail is needed: ``node`` becomes it
                self._split(node, keep)
            freed.append(node.slots)
            count += len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            self.size -= len(node.key)
            self.evictable -= len(node.key)
            self.evicted += len(node.key)
            if parent is not self.root and not parent.children and not parent.refs:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def common_prefix(key: list, keys: list, start: int = 0) -> int:
    """How many leading items of ``key`` equal ``keys[start:]``."""
    n = min(len(key), len(keys) - start)
    i = 0
    while i < n and key[i] == keys[start + i]:
        i += 1
    return i
