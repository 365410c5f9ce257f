"""The distributed step from Python (routepack.distributed, docs/distributed.md): a rank's
statistics as bytes, the merge of the ranks' parts equal to the whole batch's bytes,
step_from_stats equal to step, merge errors, one rank's remap equal to the whole remap,
and a Comm over Python callables with ranks simulated by threads: one rank's failing
policy leaves every rank on the same plan, and an exception in a callback is a
TransportError on every rank, never a crash or a hang."""

import threading

import numpy as np
import pytest

import routepack
from conftest import SMALL_CONFIG, random_step

L, K, E = 16, 8, 64   # config-small's model


def split_ranks(rng, n, P):
    """Global ids dealt to P ranks after a shuffle (ranks in random amounts)."""
    perm = rng.permutation(n).astype(np.int32)
    cuts = np.sort(rng.integers(0, n + 1, size=P - 1))
    return np.split(perm, cuts)


def part_of(lens, ids, gids):
    """(lengths, routing) of the sequences gids, as the rank holding them has them."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    parts = [ids[cu[s]:cu[s + 1]] for s in gids]
    routing = np.concatenate(parts) if parts else np.zeros((0, L, K), dtype=ids.dtype)
    return lens[gids], routing


@pytest.fixture(scope="module")
def sched():
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1) as s:
        yield s


@pytest.mark.parametrize("P", [2, 3, 4])
def test_merged_parts_equal_the_whole_batch(sched, P):
    rng = np.random.default_rng(P)
    lens, ids = random_step(rng, 37, L, K, E, max_len=400, dtype=np.uint8)
    whole = sched.compute_stats(lens, ids).to_bytes()
    groups = split_ranks(rng, 37, P)
    parts = []
    for g in groups:
        plens, prouting = part_of(lens, ids, g)
        parts.append(sched.compute_stats(plens, prouting).to_bytes())
    merged = sched.merge_stats(parts, groups)
    assert merged.num_seqs == 37 and merged.num_tokens == int(lens.sum())
    assert merged.to_bytes() == whole
    # as numpy uint8 arrays too (what a torch tensor's .numpy() gives)
    again = sched.merge_stats([np.frombuffer(p, dtype=np.uint8) for p in parts], groups)
    assert again.to_bytes() == whole
    assert np.array_equal(merged.expert_load(), sched.stats_from_bytes(whole).expert_load())


def test_merge_reusing_the_last_merge(sched):
    """merge_stats(..., reuse=last): the same bytes as a fresh merge, step after step of
    other shapes; the reused Stats are gone, and kept when the merge fails."""
    rng = np.random.default_rng(11)
    last = None
    for n in (37, 12, 64):
        lens, ids = random_step(rng, n, L, K, E, max_len=300, dtype=np.uint8)
        groups = split_ranks(rng, n, 3)
        parts = [sched.compute_stats(*part_of(lens, ids, g)).to_bytes() for g in groups]
        fresh = sched.merge_stats(parts, groups)
        merged = sched.merge_stats(parts, groups, reuse=last)
        assert merged.to_bytes() == fresh.to_bytes() == sched.compute_stats(lens, ids).to_bytes()
        if last is not None:
            with pytest.raises(routepack.InvalidArgumentError, match="the statistics were freed"):
                last.to_bytes()
        fresh.close()
        last = merged
    # a failing merge leaves the statistics to reuse as they were
    before = last.to_bytes()
    with pytest.raises(routepack.InvalidArgumentError, match="is in no part"):
        sched.merge_stats(parts, groups, num_seqs=65, reuse=last)
    assert last.to_bytes() == before
    with routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1) as other:
        with pytest.raises(routepack.InvalidArgumentError, match="same context"):
            other.merge_stats(parts, groups, reuse=last)
    with pytest.raises(routepack.InvalidArgumentError, match="same context"):
        sched.merge_stats(parts, groups, reuse=b"not statistics")
    last.close()


def test_step_from_stats_taking():
    """step_from_stats(take=True): the same plans as step(); the Stats are taken (gone),
    the step before's come back from take_spare_stats() and the next merge reuses them;
    refused statistics stay the caller's; bytes and another context's Stats are refused."""
    rng = np.random.default_rng(11)
    a = routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1)
    b = routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1)
    spare = None
    for t in range(4):
        lens, ids = random_step(rng, 48, L, K, E, max_len=300, dtype=np.uint8)
        ra = a.step(lens, ids)
        gids = split_ranks(rng, 48, 3)
        parts = [b.compute_stats(*part_of(lens, ids, g)).to_bytes() for g in gids]
        merged = b.merge_stats(parts, gids, reuse=spare)
        if spare is not None:
            with pytest.raises(routepack.InvalidArgumentError, match="freed"):
                spare.handle  # its storage went into this merge
        rb = b.step_from_stats(lens, merged, take=True)
        assert rb.plan_hash == ra.plan_hash and rb.step_time_s == ra.step_time_s
        with pytest.raises(routepack.InvalidArgumentError, match="freed"):
            merged.handle  # taken
        spare = b.take_spare_stats()
        assert (spare is None) == (t == 0)
        assert b.take_spare_stats() is None  # given once
        if spare is not None:
            assert spare.num_seqs == 48
    lens, ids = random_step(rng, 20, L, K, E, dtype=np.uint8)
    other_lens, _ = random_step(rng, 20, L, K, E, dtype=np.uint8)
    mine = b.compute_stats(lens, ids)
    before = b.last.plan_hash
    with pytest.raises(routepack.InvalidArgumentError, match="the batch"):
        b.step_from_stats(other_lens, mine, take=True)
    assert b.last.plan_hash == before and mine.num_seqs == 20 and mine.handle  # still the caller's
    with pytest.raises(routepack.InvalidArgumentError, match="bytes"):
        b.step_from_stats(lens, mine.to_bytes(), take=True)
    with pytest.raises(routepack.InvalidArgumentError, match="context"):
        b.step_from_stats(lens, a.compute_stats(lens, ids), take=True)
    mine.close()
    if spare is not None:
        spare.close()
    a.close()
    b.close()


def test_step_from_stats_equals_step():
    rng = np.random.default_rng(7)
    a = routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1)
    b = routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1)
    for t in range(3):
        lens, ids = random_step(rng, 48, L, K, E, max_len=300, dtype=np.uint8)
        groups = np.repeat(np.arange(12, dtype=np.int32), 4)
        ra = a.step(lens, ids, group_ids=groups)
        parts, gids = [], split_ranks(rng, 48, 3)
        for g in gids:
            plens, prouting = part_of(lens, ids, g)
            parts.append(b.compute_stats(plens, prouting).to_bytes())
        rb = b.step_from_stats(lens, b.merge_stats(parts, gids), group_ids=groups)
        assert rb.plan_hash == ra.plan_hash
        assert rb.step_time_s == ra.step_time_s
        assert rb.step == ra.step == t
        assert rb.ranks_fell_back == 0 and rb.plan_from_rank == 0
    # bytes of the whole step work as well as a Stats
    lens, ids = random_step(rng, 20, L, K, E, dtype=np.uint8)
    ra = a.step(lens, ids)
    rb = b.step_from_stats(lens, b.compute_stats(lens, ids).to_bytes())
    assert rb.plan_hash == ra.plan_hash
    # statistics of another batch are refused, and the plan stays
    other_lens, other_ids = random_step(rng, 20, L, K, E, dtype=np.uint8)
    before = b.last.plan_hash
    with pytest.raises(routepack.InvalidArgumentError, match="the batch"):
        b.step_from_stats(other_lens, b.compute_stats(lens, ids))
    assert b.last.plan_hash == before
    a.close()
    b.close()


def test_merge_errors(sched):
    rng = np.random.default_rng(3)
    lens, ids = random_step(rng, 6, L, K, E, dtype=np.uint8)
    pa = sched.compute_stats(*part_of(lens, ids, np.array([0, 2, 4]))).to_bytes()
    pb = sched.compute_stats(*part_of(lens, ids, np.array([1, 3, 5]))).to_bytes()
    with pytest.raises(routepack.InvalidArgumentError, match="global sequence id 2 is in parts 0 and 1") as e:
        sched.merge_stats([pa, pb], [[0, 2, 4], [1, 2, 5]])
    assert e.value.sequence == 2
    with pytest.raises(routepack.InvalidArgumentError, match="global sequence id 6 is in no part"):
        sched.merge_stats([pa, pb], [[0, 2, 4], [1, 3, 5]], num_seqs=7)
    bad = bytearray(pb)
    bad[70] ^= 1
    with pytest.raises(routepack.ChecksumError, match="part 1: statistics"):
        sched.merge_stats([pa, bytes(bad)], [[0, 2, 4], [1, 3, 5]])
    with pytest.raises(routepack.FormatError, match="truncated"):
        sched.stats_from_bytes(pa[:40])
    with pytest.raises(routepack.InvalidArgumentError):
        sched.merge_stats([pa], [[0, 1], [2]])


def test_remap_rank_equals_remap():
    rng = np.random.default_rng(11)
    with routepack.Scheduler(SMALL_CONFIG, num_threads=1) as s:   # the routepack policy: replicas, shares
        lens, ids = random_step(rng, 64, L, K, E, max_len=500, dtype=np.uint8)
        res = s.step(lens, ids)
        whole, counts = res.remap(ids, slot_tokens=True)
        cu = res.cu_seqlens
        Q = res.num_gpus // res.ep_size
        for mb in range(res.num_microbatches):
            total = np.zeros_like(counts[mb])
            for g in range(res.num_gpus):
                seqs = res.microbatches[g][mb]
                _, mine = part_of(lens, ids, seqs)
                got, c = res.remap_rank(g, mb, mine, slot_tokens=True)
                want = (np.concatenate([whole[cu[q]:cu[q + 1]] for q in seqs]) if len(seqs)
                        else np.zeros((0, L, K), np.int32))
                assert np.array_equal(got, want)
                total[:, g // res.ep_size, :] += c
            assert np.array_equal(total, counts[mb]), "mb %d (Q=%d)" % (mb, Q)


# ---- ranks on threads over a Python comm -------------------------------------------------

class Hub:
    """Collectives between threads: every call is a barrier phase (with a timeout, so a
    rank that skips one breaks the hub instead of hanging the test)."""

    def __init__(self, size, timeout=10.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots = [None] * size
        self.calls = 0

    def comm(self, rank, fail_on_call=None):
        count = [0]

        def allgather(data):
            count[0] += 1
            if fail_on_call is not None and count[0] == fail_on_call:
                raise RuntimeError("injected failure on rank %d" % rank)
            self.slots[rank] = data
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        def bcast(data, root):
            count[0] += 1
            if rank == root:
                self.slots[root] = data
            self.barrier.wait()
            out = self.slots[root]
            self.barrier.wait()
            return out

        return routepack.Comm(allgather, bcast, rank, self.size)


def run_ranks(P, make_sched, steps):
    """Run `steps` steps on P threads; per rank a list of results or exceptions."""
    rng = np.random.default_rng(5)
    batches = [random_step(rng, 24, L, K, E, dtype=np.uint8) for _ in range(steps)]
    out = [[] for _ in range(P)]

    def main(rank):
        s = make_sched(rank)
        try:
            for lens, ids in batches:
                try:
                    out[rank].append(s.step(lens, ids))
                except routepack.Error as e:
                    out[rank].append(e)
                    break
        finally:
            s.close()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_a_policy_failing_on_one_rank_leaves_every_rank_on_one_plan():
    hub = Hub(3)
    out = run_ranks(3, lambda r: routepack.Scheduler(
        SMALL_CONFIG, policy="token_kk+eplb", num_threads=1, comm=hub.comm(r),
        max_instructions=100 if r == 1 else 0), steps=3)
    for t in range(3):
        hashes = {out[r][t].plan_hash for r in range(3)}
        assert len(hashes) == 1
        for r in range(3):
            res = out[r][t]
            assert res.ranks_fell_back == 1 and res.plan_from_rank == 0 and res.ranks_disagreed
            assert res.fallback == (r == 1)
            assert res.step_time_s == out[0][t].step_time_s


def test_an_exception_in_a_callback_is_a_transport_error_on_every_rank():
    hub = Hub(3, timeout=2.0)
    out = run_ranks(3, lambda r: routepack.Scheduler(
        SMALL_CONFIG, policy="token_kk+eplb", num_threads=1,
        comm=hub.comm(r, fail_on_call=3 if r == 2 else None)), steps=3)
    # step 0 ran everywhere; at step 1 rank 2's callback raised: every rank's step failed
    for r in range(3):
        assert isinstance(out[r][0], routepack.StepResult)
        assert isinstance(out[r][1], routepack.TransportError), out[r][1]
    assert "injected failure on rank 2" in str(out[2][1])
    assert isinstance(out[2][1].__cause__, RuntimeError)


def test_comm_checks_its_arguments():
    with pytest.raises(routepack.InvalidArgumentError):
        routepack.Comm(lambda d: [d], lambda d, r: d, 1, 1)
    with pytest.raises(routepack.InvalidArgumentError):
        routepack.Comm(None, lambda d, r: d, 0, 1)
    with pytest.raises(routepack.InvalidArgumentError, match="routepack.Comm"):
        routepack.Scheduler(SMALL_CONFIG, comm=object())


def test_a_callback_returning_the_wrong_size_is_a_transport_error():
    c = routepack.Comm(lambda d: [d, b"x"], lambda d, r: d, 0, 2)
    other = routepack.Comm(lambda d: [d, d], lambda d, r: d, 1, 2)
    s = routepack.Scheduler(SMALL_CONFIG, policy="token_kk+eplb", num_threads=1, comm=c)
    rng = np.random.default_rng(1)
    lens, ids = random_step(rng, 8, L, K, E, dtype=np.uint8)
    with pytest.raises(routepack.TransportError, match="rank 1's part has 1 bytes"):
        s.step(lens, ids)
    s.close()
    del other
