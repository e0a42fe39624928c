"""What an engine holds that a router can send work to, as a value: the blocks in its prefix cache and the
adapters it has loaded. Built on the engine's thread as part of its stats (`LLMEngine.stats(cache=True)`), where
those live dicts are written, so that another thread (a Ray replica's report to the routers,
motet/cluster/replica.py) reads a snapshot rather than the dicts themselves.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motet.lora.manager import AdapterRef

if TYPE_CHECKING:
    from motet.engine.core.block_manager import BlockManager
    from motet.lora.manager import AdapterManager


@dataclass(frozen=True)
class CacheContents:
    blocks: bytes  # the prefix cache's blocks: their chained hashes, packed as int64s
    adapters: tuple[
        int, ...
    ]  # uids of the adapter versions loaded (the device pool's, then the host cache's)
    adapter_slots: int  # how many adapters it keeps loaded (the pool's capacity by bytes: an estimate)
    referenced: tuple[AdapterRef, ...]  # the versions requests named by reference (AdapterManager.referenced)

    @classmethod
    def of(cls, block_manager: BlockManager, adapters: AdapterManager) -> CacheContents:
        """On the engine's thread."""
        loaded = adapters.loaded()
        return cls(
            blocks=array.array("q", block_manager.cached).tobytes(),
            adapters=loaded,
            adapter_slots=max(adapters.capacity(), len(loaded)),
            referenced=adapters.referenced(),
        )
