"""Eviction order of the CPU tier: LRU, and ARC (Megiddo and Modha's adaptive replacement cache).

A policy orders the keys the manager holds and picks victims; the manager (manager.py) owns slots,
readiness and load references and tells the policy which keys may go. `evict` either returns
exactly `count` victims and forgets them, or returns None and changes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from itertools import islice

Key = Hashable


class EvictionPolicy(ABC):
    @abstractmethod
    def insert(self, key: Key) -> None:
        """A new key (being stored) joins as most recent."""

    @abstractmethod
    def touch(self, key: Key, ready: bool) -> None:
        """A request used `key` (held or not: ARC learns from keys it evicted)."""

    @abstractmethod
    def evict(self, count: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        """`count` victims among the evictable keys, least valuable first, or None (no change)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget a held key without remembering it (a store that failed)."""

    @abstractmethod
    def order(self) -> list[Key]:
        """Held keys, first to be evicted first (for tests and reports)."""


def _first(keys: Iterable[Key], count: int, evictable: Callable[[Key], bool]) -> list[Key]:
    return list(islice((k for k in keys if evictable(k)), count))


class LRUPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self.keys: OrderedDict[Key, None] = OrderedDict()  # least recent first

    def insert(self, key: Key) -> None:
        self.keys[key] = None

    def touch(self, key: Key, ready: bool) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)

    def evict(self, count: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        victims = _first(self.keys, count, evictable)
        if len(victims) < count:
            return None
        for key in victims:
            del self.keys[key]
        return victims

    def remove(self, key: Key) -> None:
        self.keys.pop(key, None)

    def order(self) -> list[Key]:
        return list(self.keys)


class ARCPolicy(EvictionPolicy):
    """T1: keys seen once, T2: keys used again; B1/B2: ghosts of keys evicted from T1/T2 (no data).
    A ghost hit in B1 says T1 was too small: its target grows by max(1, |B2|/|B1|); a B2 hit
    shrinks it by max(1, |B1|/|B2|). Eviction takes T1's least recent key while |T1| >= target,
    else T2's (the other list when the chosen one has nothing evictable); a stored ghost returns
    to T2. Each ghost list is trimmed to the capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        if key in self.b1 or key in self.b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None

    def touch(self, key: Key, ready: bool) -> None:
        if key in self.t1:
            del self.t1[key]
            # A key still being stored was only just inserted: that is not a second use.
            (self.t2 if ready else self.t1)[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            self.b2.move_to_end(key)

    def evict(self, count: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        # Plan first (nothing changes unless all `count` victims are found).
        from_t1 = _first(self.t1, count, evictable)
        from_t2 = _first(self.t2, count, evictable)
        t1_size, i1, i2 = len(self.t1), 0, 0
        plan: list[tuple[Key, bool]] = []  # (key, came from T1)
        for _ in range(count):
            prefer_t1 = t1_size >= self.target_t1
            if i1 < len(from_t1) and (prefer_t1 or i2 >= len(from_t2)):
                plan.append((from_t1[i1], True))
                i1, t1_size = i1 + 1, t1_size - 1
            elif i2 < len(from_t2):
                plan.append((from_t2[i2], False))
                i2 += 1
            else:
                return None
        for key, was_t1 in plan:
            if was_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [key for key, _ in plan]

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def order(self) -> list[Key]:
        return [*self.t1, *self.t2]


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r} (valid: 'lru', 'arc')")
