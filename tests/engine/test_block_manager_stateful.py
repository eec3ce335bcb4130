"""A hypothesis state machine driving the BlockManager directly: allocate, append, fork, copy-on-write,
free, swap out/in, prefix hits and eviction, in any interleaving. A per-slot record of what the KV
cache would hold is updated exactly as the model runner would, so after every rule we can check that
ref counts equal block-table references, no block is both free and referenced, every cached block
holds exactly the tokens it is filed under, and every sequence reads back its own tokens."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedmodel.server.engine.block_manager import BlockManager
from pagedmodel.server.engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 24
NUM_CPU_BLOCKS = 12


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans())
    def setup(self, caching):
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=caching, watermark=0.0,
                               num_cpu_blocks=NUM_CPU_BLOCKS)
        self.device = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.cpu = [[None] * BS for _ in range(NUM_CPU_BLOCKS)]
        self.resident: list[Sequence] = []
        self.swapped: list[Sequence] = []

    def _compute(self, seq: Sequence, upto: int) -> None:
        """What a step does: run pending copies, write tokens [computed, upto) to their slots, commit."""
        for s, d in self.bm.take_pending_copies():
            self.device[d] = list(self.device[s])
        table = self.bm.block_ids(seq)
        for p in range(seq.num_computed_tokens, upto):
            self.device[table[p // BS]][p % BS] = seq.token_ids[p]
        seq.num_computed_tokens = upto
        self.bm.commit(seq)

    @rule(family=st.integers(0, 2), length=st.integers(1, 14))
    def add(self, family, length):
        tokens = [family * 100 + i for i in range(length)]
        seq = Sequence(tokens, len(tokens))
        cached = self.bm.match_prefix(seq)
        if not self.bm.allocate(seq, seq.num_tokens, cached):
            return
        seq.num_computed_tokens = len(cached) * BS
        self._compute(seq, seq.num_tokens)
        self.resident.append(seq)

    @precondition(lambda self: self.resident)
    @rule(data=st.data(), token=st.integers(0, 999))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.resident))
        seq.token_ids.append(token)
        if self.bm.allocate(seq, seq.num_tokens):   # may copy-on-write a shared block
            self._compute(seq, seq.num_tokens)
        else:
            seq.token_ids.pop()
            self.bm.take_pending_copies()

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident))
        child = parent.fork(1)
        self.bm.fork(parent, child)
        self.resident.append(child)

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.resident))
        self.resident.remove(seq)
        self.bm.free(seq)

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.resident))
        if not self.bm.can_swap_out([seq]):
            return
        for d, c in self.bm.swap_out([seq]):
            self.cpu[c] = list(self.device[d])
        self.resident.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        if not self.bm.can_swap_in([seq], watermark=False):
            return
        for c, d in self.bm.swap_in([seq]):
            self.device[d] = list(self.cpu[c])
        self.swapped.remove(seq)
        self.resident.append(seq)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for seq in self.resident:
            table = self.bm.block_ids(seq)
            for p in range(seq.num_computed_tokens):
                assert self.device[table[p // BS]][p % BS] == seq.token_ids[p]
        for seq in self.swapped:
            table = [b.block_id for b in self.bm.cpu_tables[seq.seq_id]]
            for p in range(seq.num_computed_tokens):
                assert self.cpu[table[p // BS]][p % BS] == seq.token_ids[p]
        for block in self.bm.pool.cached_blocks().values():
            assert tuple(self.device[block.block_id]) == block.token_ids

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.resident + self.swapped:
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == NUM_BLOCKS   # everything free or merely cached
        assert self.bm.cpu_pool.num_free == NUM_CPU_BLOCKS


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
