"""The pool of physical KV blocks: reference counts, an LRU queue of free blocks, and the prefix-cache map.

A block with ``ref_cnt == 0`` is free. If it also carries a content hash, its K/V are still valid and a
later request with the same prefix may revive it; it is only overwritten when the LRU queue hands it out
as a fresh block (eviction). All operations are O(1) per block.
"""
from __future__ import annotations

from collections import OrderedDict

from .kv_events import KVEventLog


class NoFreeBlocksError(RuntimeError):
    pass


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None       # set once full and committed to the prefix cache
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept with the hash: a lookup compares tokens too

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog | None = None):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, eviction order first: uncached ones in front, cached ones by last use
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        self.events = events   # told of every commit and eviction (a router's view of this cache)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def is_free(self, block: Block) -> bool:
        return block.block_id in self._free

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: Block) -> None:
        """Take one more reference to a block already holding wanted content (prefix hit or fork)."""
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def release(self, block: Block) -> None:
        if block.ref_cnt <= 0:
            raise AssertionError(f"double free of {block!r}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block.block_id] = block
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)  # nothing worth keeping: reuse first

    def lookup(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def commit(self, block: Block, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> None:
        """Register a full block's content; a duplicate of already-cached content stays uncached."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash)

    def _uncache(self, block: Block) -> None:
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = block.parent_hash = block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only while no block is in use (a running sequence's blocks would
        otherwise lose their hashes mid-commit). False, changing nothing, if some block is referenced."""
        if any(b.ref_cnt for b in self.blocks):
            return False
        for block in self._cached.values():
            block.block_hash = block.parent_hash = block.token_ids = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def cached_blocks(self) -> dict[bytes, Block]:
        return dict(self._cached)
