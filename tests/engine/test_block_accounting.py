"""Block accounting under random arrivals, lengths, budgets, forks, swaps and aborts, checked after every
step against a replay of what the KV cache holds."""
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
    st.sampled_from([1, 1, 2, 3]),  # n: forked samples share blocks copy-on-write
)


def run(requests, block_size, extra_blocks, max_num_seqs, budget, prefix_caching, cpu_blocks, mode) -> Sim:
    # enough blocks for the largest request alone (the engine enforces this at admission)
    need = max(n * -(-(p + m) // block_size) for p, m, *_, n in requests)
    num_blocks = need + extra_blocks
    sim = Sim(num_blocks, block_size, max_num_seqs, budget, prefix_caching, num_cpu_blocks=cpu_blocks,
              preemption_mode=mode)
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    aborts: dict[int, str] = {}
    step = 0
    while pending or sim.groups:
        while pending and pending[0][1][2] <= step:
            i, (plen, mt, _, abort, abort_after, family, n) = pending.pop(0)
            prompt = [family * 1000 + (t % 7 if t < 64 else t) for t in range(plen)]
            sim.add(f"r{i}", prompt, mt, n=n)
            if abort:
                aborts.setdefault(step + abort_after, f"r{i}")
        if step in aborts:
            sim.abort(aborts.pop(step))
        sim.step()
        sim.check()
        step += 1
        assert step < 5000, "no progress: scheduler livelock"
    assert sim.bm.num_free_blocks == num_blocks
    assert not sim.bm.tables and not sim.bm.cpu_tables
    if sim.bm.cpu_pool is not None:
        assert sim.bm.cpu_pool.num_free == cpu_blocks
    return sim


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=14),
    block_size=st.sampled_from([1, 8, 16]),
    extra_blocks=st.integers(0, 40),
    max_num_seqs=st.integers(3, 8),
    budget=st.integers(1, 300),
    prefix_caching=st.booleans(),
    cpu_blocks=st.sampled_from([0, 4, 64]),
    mode=st.sampled_from([None, "swap", "recompute"]),
)
def test_blocks_are_never_lost_or_double_used(requests, block_size, extra_blocks, max_num_seqs, budget,
                                              prefix_caching, cpu_blocks, mode):
    run(requests, block_size, extra_blocks, max_num_seqs, budget, prefix_caching, cpu_blocks, mode)


def test_swap_and_fork_paths_are_exercised():
    """The property test above is only meaningful if its runs reach swaps, forks, CoW and prefix-cache
    eviction: show one does."""
    reqs = [(40, 30, 0, False, 0, 0, 3), (50, 30, 0, False, 0, 1, 3), (30, 30, 1, False, 0, 0, 1)]
    sim = run(reqs, 8, 2, 8, 256, True, 64, None)
    assert sim.forks >= 4 and sim.swapped_out >= 1 and sim.swapped_in >= 1
    assert sim.bm.pool.num_evictions > 0 and sim.bm.prefix_hits > 0
