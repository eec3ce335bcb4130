"""Block accounting under random arrivals, lengths, budgets and aborts, checked after every step."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .sim import Sim

request = st.tuples(
    st.integers(1, 120),   # prompt length
    st.integers(1, 40),    # max tokens
    st.integers(0, 6),     # arrival step
    st.booleans(),         # aborted?
    st.integers(0, 30),    # abort step (relative to arrival)
    st.integers(0, 3),     # prompt family: shared prefixes exercise the prefix cache
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=14),
    block_size=st.sampled_from([1, 8, 16]),
    extra_blocks=st.integers(0, 40),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 300),
    prefix_caching=st.booleans(),
)
def test_blocks_are_never_lost_or_double_used(requests, block_size, extra_blocks, max_num_seqs, budget,
                                              prefix_caching):
    # enough blocks for the longest request alone (the engine enforces this at admission)
    longest = max(p + m for p, m, *_ in requests)
    num_blocks = -(-longest // block_size) + extra_blocks
    sim = Sim(num_blocks, block_size, max_num_seqs, budget, prefix_caching)
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    aborts: dict[int, str] = {}
    step = 0
    while pending or sim.groups:
        while pending and pending[0][1][2] <= step:
            i, (plen, mt, _, abort, abort_after, family) = pending.pop(0)
            prompt = [family * 1000 + (t % 7 if t < 64 else t) for t in range(plen)]
            sim.add(f"r{i}", prompt, mt)
            if abort:
                aborts.setdefault(step + abort_after, f"r{i}")
        if step in aborts:
            sim.abort(aborts.pop(step))
        sim.step()
        sim.bm.check_invariants()
        for g in sim.groups.values():  # every live block table covers exactly what was computed or scheduled
            for seq in g.unfinished_seqs():
                if sim.bm.has_table(seq):
                    assert len(sim.bm.block_ids(seq)) * block_size >= seq.num_computed_tokens
        step += 1
        assert step < 5000, "no progress: scheduler livelock"
    assert sim.bm.num_free_blocks == num_blocks
    assert not sim.bm.tables
