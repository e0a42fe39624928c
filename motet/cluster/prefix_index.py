"""The router's index of what each replica holds: KV blocks by their chained hash, and adapters by uid.

Two sources feed it. Replicas report what they hold (a snapshot, or what they cached and evicted since the
last report), which is the truth as of the report. Between reports the router adds what it has just routed
to a replica (that replica is about to compute those blocks and load that adapter), so a conversation's
next turn finds its replica before the next report says so; such an entry expires after `routed_ttl_s`
unless a report confirms it. Plain synchronous code: the Ray router and the simulation both use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

REPORTED, ROUTED = 1, 2  # a holder's value: REPORTED if its reports hold the key, plus ROUTED per guess


class _Holders:
    """key -> {replica: value}: which replicas hold a key, and on whose word (a report's, routing guesses')."""

    def __init__(self):
        self.holders: dict[int, dict[Hashable, int]] = {}

    def report(self, key: int, replica: Hashable, held: bool) -> None:
        holders = self.holders.setdefault(key, {})
        value = holders.get(replica, 0)
        self._put(key, holders, replica, (value | REPORTED) if held else (value & ~REPORTED))

    def update(self, replica: Hashable, held: set[int], added: Iterable[int], removed: Iterable[int]) -> None:
        """A report of `replica`'s: it no longer holds `removed`, it now holds `added` (`held`: the keys its reports
        hold, kept in step)."""
        for key in removed:
            held.discard(key)
            self.report(key, replica, False)
        for key in added:
            held.add(key)
            self.report(key, replica, True)

    def guess(self, key: int, replica: Hashable, delta: int) -> None:
        """One more (+1) or one fewer (-1) routing guess that `replica` holds `key`."""
        holders = self.holders.setdefault(key, {})
        self._put(key, holders, replica, max(0, holders.get(replica, 0) + delta * ROUTED))

    def _put(self, key: int, holders: dict[Hashable, int], replica: Hashable, value: int) -> None:
        if value:
            holders[replica] = value
        else:
            holders.pop(replica, None)
            if not holders:
                del self.holders[key]

    def get(self, key: int) -> dict[Hashable, int]:
        return self.holders.get(key, {})


class PrefixIndex:
    def __init__(self, routed_ttl_s: float = 5.0):
        self.routed_ttl_s = routed_ttl_s
        self.blocks = _Holders()
        self.adapters = _Holders()
        self.reported_blocks: dict[Hashable, set[int]] = {}  # replica -> block hashes its reports hold
        self.reported_adapters: dict[Hashable, set[int]] = {}
        self._routed: dict[Hashable, deque[tuple[float, tuple[int, ...], int]]] = {}  # oldest first

    # -- what replicas report -------------------------------------------------------------------------
    def report_snapshot(self, replica: Hashable, blocks: Iterable[int], adapters: Iterable[int]) -> None:
        """The replica holds exactly these blocks and adapters now."""
        old_blocks = self.reported_blocks.get(replica, set())
        new_blocks = set(blocks)
        self.report_changes(replica, new_blocks - old_blocks, old_blocks - new_blocks)
        old_adapters = self.reported_adapters.get(replica, set())
        new_adapters = set(adapters)
        self.report_changes(replica, (), (), new_adapters - old_adapters, old_adapters - new_adapters)

    def report_changes(
        self,
        replica: Hashable,
        cached: Iterable[int],
        evicted: Iterable[int],
        loaded: Iterable[int] = (),
        dropped: Iterable[int] = (),
    ) -> None:
        """Since its last report the replica cached and evicted these blocks, loaded and dropped these
        adapters."""
        self.blocks.update(replica, self.reported_blocks.setdefault(replica, set()), cached, evicted)
        self.adapters.update(replica, self.reported_adapters.setdefault(replica, set()), loaded, dropped)

    def remove_replica(self, replica: Hashable) -> None:
        """The replica is gone: forget everything about it."""
        for h in self.reported_blocks.pop(replica, ()):
            self.blocks.report(h, replica, False)
        for uid in self.reported_adapters.pop(replica, ()):
            self.adapters.report(uid, replica, False)
        for entry in self._routed.pop(replica, ()):
            self._forget_guess(replica, entry)

    # -- what the router did --------------------------------------------------------------------------
    def routed(self, replica: Hashable, block_hashes: Sequence[int], adapter: int, now: float) -> None:
        """A request with these leading blocks and this adapter went to `replica`."""
        self.expire(now)
        hashes = tuple(block_hashes)
        for h in hashes:
            self.blocks.guess(h, replica, +1)
        if adapter:
            self.adapters.guess(adapter, replica, +1)
        self._routed.setdefault(replica, deque()).append((now, hashes, adapter))

    def expire(self, now: float) -> None:
        """Forget routing guesses older than the TTL: by now a report says whether they hold."""
        for replica, entries in self._routed.items():
            while entries and entries[0][0] < now - self.routed_ttl_s:
                self._forget_guess(replica, entries.popleft())

    def _forget_guess(self, replica: Hashable, entry: tuple[float, tuple[int, ...], int]) -> None:
        _, hashes, adapter = entry
        for h in hashes:
            self.blocks.guess(h, replica, -1)
        if adapter:
            self.adapters.guess(adapter, replica, -1)

    # -- questions ------------------------------------------------------------------------------------
    def cached_blocks(self, block_hashes: Sequence[int]) -> dict[Hashable, int]:
        """replica -> how many of these leading blocks it holds in a row (replicas holding none omitted).
        Costs the total length of the matches, not replicas x blocks."""
        if not block_hashes:
            return {}
        matching = set(self.blocks.get(block_hashes[0]))
        depth = dict.fromkeys(matching, 1)
        for i in range(1, len(block_hashes)):
            if not matching:
                break
            matching &= self.blocks.get(block_hashes[i]).keys()
            for r in matching:
                depth[r] = i + 1
        return depth

    def holders_of_adapter(self, adapter: int) -> set[Hashable]:
        return set(self.adapters.get(adapter)) if adapter else set()
