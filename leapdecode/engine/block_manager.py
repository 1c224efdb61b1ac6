r"""Paged KV-cache block allocation with hash-based prefix caching.

Layout. The KV pool is one preallocated tensor per layer (see ``kv_cache.py``) cut into ``num_blocks`` blocks of
``block_size`` token slots. A sequence owns an ordered *block table*; token position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``::

    sequence A tokens:  [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    A.block_table:          7          2           9
    sequence B (same 16-token prefix as A):
    B.block_table:          7          4                     <- block 7 shared, ref_count 2

    pool:  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | ...      each block = block_size slots x kv_heads x head_dim
                   A       B           A,B     A

Prefix caching. When a block is *full of computed tokens* it gets a chained hash
``h_i = hash((h_{i-1}, tokens of block i))``, so equal hashes imply equal whole prefixes. A new sequence walks its
full blocks and reuses any block whose hash is registered *and* whose stored tokens match (a hash collision can
never hand out wrong KV). Only full blocks are shared, so a sequence never writes into a block another reads.

Freeing. ``ref_count`` counts the sequences using a block. At zero, a hashed block is kept in an LRU list: it is
still a cache hit until it is reused for something else (least recently freed first); an unhashed block goes
straight back to the free list. Allocation takes the block right after the sequence's last one when it is free
(contiguous tables let attention read the cache through a view instead of a gather), else the free list, else
evicts the LRU cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from leapdecode.engine.sequence import Sequence


@dataclass
class ScratchTable:
    """The two fields of Sequence that ``allocate``/``free`` touch: a block table with no prefix-cache hashes,
    for work that borrows KV blocks briefly (step-cost calibration, scoring text)."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0 but hashed: LRU order
        self.hash_to_block: dict[int, int] = {}

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, seq: Sequence, position: int) -> int:
        return self.blocks_at(seq.block_table, position)

    def blocks_at(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ----------------------------------------------------------------------------------------- prefix cache
    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of ``seq``; returns the number of tokens reused.

        At least one token is always left to compute, since the step that computes it produces the logits the
        next token is sampled from.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent: int | None = None
        matched: list[int] = []
        for start in range(0, seq.num_tokens - bs, bs):  # full blocks, leaving >= 1 token to compute
            tokens = tuple(seq.token_ids[start : start + bs])
            h = self.chain_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            matched.append(bid)
            parent = h
        for bid in matched:
            self._take(bid)
        seq.block_table = matched
        seq.block_hashes = [self.blocks[b].block_hash for b in matched]  # type: ignore[misc]
        return len(matched) * bs

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hash of every block that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = seq.block_hashes
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(hashes), full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h in self.hash_to_block:
                continue  # an identical block is already cached; keep ours private
            block.block_hash, block.token_ids = h, tokens
            self.hash_to_block[h] = block.block_id

    # ------------------------------------------------------------------------------------------- allocation
    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            self.free_ids.pop(bid, None)
            self.cached_free.pop(bid, None)
        block.ref_count += 1

    def _allocate_one(self, after: int | None) -> int:
        if after is not None and after + 1 in self.free_ids:
            bid = after + 1
        elif self.free_ids:
            bid = next(iter(self.free_ids))
        else:
            bid = next(iter(self.cached_free))  # evict the least recently freed cached block
            block = self.blocks[bid]
            if self.hash_to_block.get(block.block_hash) == bid:  # type: ignore[arg-type]
                del self.hash_to_block[block.block_hash]  # type: ignore[arg-type]
            block.block_hash, block.token_ids = None, ()
        self._take(bid)
        return bid

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the table can grow to hold ``num_tokens`` positions."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` positions (caller checked ``can_allocate``)."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, free {self.num_free_blocks}")
        for _ in range(need):
            seq.block_table.append(self._allocate_one(seq.block_table[-1] if seq.block_table else None))

    @contextmanager
    def borrowed(self, num_tokens: int, what: str = "scratch work") -> Iterator[list[int]]:
        """A block table for ``num_tokens`` positions taken from the free pool and returned when the ``with``
        block exits. Raises ValueError saying ``what`` needed how many blocks when they are not free (callers that
        would rather skip compare ``blocks_needed(n)`` with ``num_free_blocks`` first)."""
        scratch = ScratchTable()
        if not self.can_allocate(scratch, num_tokens):  # type: ignore[arg-type]
            raise ValueError(f"{what} needs {self.blocks_needed(num_tokens)} free KV blocks, "
                             f"{self.num_free_blocks} are free")
        self.allocate(scratch, num_tokens)  # type: ignore[arg-type]
        try:
            yield scratch.block_table
        finally:
            self.free(scratch)  # type: ignore[arg-type]

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release blocks beyond those covering ``num_tokens`` (rejected draft tokens' slots)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        del seq.block_hashes[keep:]

    def free(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        seq.block_hashes = []

    def _release(self, bid: int) -> None:
        block = self.blocks[bid]
        assert block.ref_count > 0, f"double free of block {bid}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == bid:
                self.cached_free[bid] = None
            else:
                block.block_hash, block.token_ids = None, ()
                # most recently freed first: reuse keeps the touched part of the pool small and cache-warm
                self.free_ids[bid] = None
                self.free_ids.move_to_end(bid, last=False)

    def reset_prefix_cache(self) -> None:
        for bid in list(self.cached_free):
            b = self.blocks[bid]
            b.block_hash, b.token_ids = None, ()
            self.free_ids[bid] = None
        self.cached_free.clear()
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].ref_count > 0}
