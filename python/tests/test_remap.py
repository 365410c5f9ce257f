"""The numpy remap (logical expert ids -> physical slots) against a plain-loop reference of
the documented rule, and the properties a dispatcher relies on."""

import itertools

import numpy as np
import pytest

from routepack import dispatch_ranks, remap


def reference(ids, cu, seq_rank, seq_mb, *, gpus_per_node, ep_size, slot_begin, log2phy,
              logcnt, extra_replicas, shares, split):
    """The rule of routepack.remap.remap written as loops, token by token."""
    T, L, K = ids.shape
    S = int(slot_begin[-1])
    out = np.full((T, L, K), -1, dtype=np.int32)
    seq_of = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    # token-choices per (g, mb, l, e) in token order
    groups = {}
    for t in range(T):
        s = seq_of[t]
        g, m = int(seq_rank[s]), int(seq_mb[s])
        if g < 0:
            continue
        for l in range(L):
            for j in range(K):
                groups.setdefault((g, m, l, int(ids[t, l, j])), []).append((t, l, j))

    def rank_of(p):
        return int(np.searchsorted(slot_begin, p, side="right") - 1)

    for (g, m, l, e), members in groups.items():
        cands = [(int(p), rank_of(p)) for p in log2phy[l, e, :logcnt[l, e]]]
        cands += [(S + x, int(row[3])) for x, row in enumerate(extra_replicas)
                  if (row[0], row[1], row[2]) == (m, l, e)]
        if (m, l, e) in shares:
            w = list(map(float, shares[(m, l, e)]))
        elif split == "even":
            w = [1.0] * len(cands)
        else:
            q = g // ep_size
            gpu = [1.0 if j == g % ep_size else 0.0 for _, j in cands]
            node = [1.0 if (q * ep_size + j) // gpus_per_node == g // gpus_per_node else 0.0
                    for _, j in cands]
            w = gpu if any(gpu) else node if any(node) else [1.0] * len(cands)
        total = sum(w)
        cum = list(itertools.accumulate(x / total for x in w))
        n = len(members)
        for i, (t, l2, j) in enumerate(members):
            u = (i + 0.5) / n
            c = next((k for k, v in enumerate(cum) if v > u), len(cum) - 1)
            out[t, l2, j] = cands[c][0]
    return out


def random_case(rng, split):
    G, gpn, ep = 4, 2, 4
    M, L, E = 2, 3, 6
    slots = np.array([3, 2, 3, 2])
    slot_begin = np.concatenate([[0], np.cumsum(slots)]).astype(np.int32)
    S = int(slot_begin[-1])
    phy2log = np.full((L, S), -1, dtype=np.int32)
    for l in range(L):
        # every expert once, then hot experts in the spare slots (not twice on one rank)
        order = list(rng.permutation(E))
        extra = list(rng.choice(E, size=S - E - 1, replace=False))
        fill = order + extra
        for j in range(ep):
            for k in range(slots[j]):
                if fill:
                    phy2log[l, slot_begin[j] + k] = fill.pop(0)
    logcnt = np.zeros((L, E), dtype=np.int32)
    R = 4
    log2phy = np.full((L, E, R), -1, dtype=np.int32)
    for l in range(L):
        for p in range(S):
            e = phy2log[l, p]
            if e >= 0:
                log2phy[l, e, logcnt[l, e]] = p
                logcnt[l, e] += 1
    # one extra replica and one share set
    e = int(rng.integers(E))
    holders = {int(np.searchsorted(slot_begin, p, side="right") - 1) for p in log2phy[1, e, :logcnt[1, e]]}
    j = next(k for k in range(ep) if k not in holders)
    extra_replicas = np.array([[1, 1, e, j]], dtype=np.int32)
    e2 = int(np.argmax(logcnt[2]))
    sh = rng.random(logcnt[2, e2]) + 0.1
    shares = {(0, 2, e2): sh / sh.sum()}
    lens = rng.integers(0, 30, size=12)
    T = int(lens.sum())
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = np.stack([np.stack([rng.choice(E, size=2, replace=False) for _ in range(L)])
                    for _ in range(T)]).astype(np.uint8)
    seq_rank = rng.integers(0, G, size=12).astype(np.int32)
    seq_mb = rng.integers(0, M, size=12).astype(np.int32)
    seq_rank[3] = seq_mb[3] = -1                          # not packed
    kw = dict(gpus_per_node=gpn, ep_size=ep, slot_begin=slot_begin, log2phy=log2phy,
              logcnt=logcnt, extra_replicas=extra_replicas, shares=shares, split=split)
    return ids, cu, seq_rank, seq_mb, M, phy2log, kw


@pytest.mark.parametrize("split", ["even", "locality"])
@pytest.mark.parametrize("seed", range(6))
def test_matches_reference(split, seed):
    rng = np.random.default_rng(seed)
    ids, cu, seq_rank, seq_mb, M, phy2log, kw = random_case(rng, split)
    got = remap(ids, cu, seq_rank, seq_mb, num_microbatches=M, **kw)
    want = reference(ids, cu, seq_rank, seq_mb, **kw)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("split", ["even", "locality"])
def test_dispatcher_properties(split):
    rng = np.random.default_rng(11)
    ids, cu, seq_rank, seq_mb, M, phy2log, kw = random_case(rng, split)
    phys = remap(ids, cu, seq_rank, seq_mb, num_microbatches=M, **kw)
    S = int(kw["slot_begin"][-1])
    seq_of = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    unpacked = seq_rank[seq_of] < 0
    assert (phys[unpacked] == -1).all()
    assert (phys[~unpacked] >= 0).all()
    L = ids.shape[1]
    layer = np.broadcast_to(np.arange(L)[None, :, None], ids.shape)
    slot = phys < S
    packed = ~np.broadcast_to(unpacked[:, None, None], ids.shape)
    # a slot holds the logical expert the token chose
    np.testing.assert_array_equal(phy2log[layer[slot & packed], phys[slot & packed]],
                                  ids[slot & packed])
    # an extra replica id names the extra replica of that very expert
    ex = kw["extra_replicas"]
    xs = phys[(phys >= S)]
    assert (ex[xs - S, 2] == ids[phys >= S]).all()
    ranks = dispatch_ranks(phys, kw["slot_begin"], ex)
    assert (ranks[unpacked] == -1).all()
    assert ((ranks[~unpacked] >= 0) & (ranks[~unpacked] < kw["ep_size"])).all()


def test_even_split_counts_and_locality():
    # one layer, two experts; expert 0 has replicas on EP rank 0 (slot 0) and EP rank 1
    # (slot 2); 2 GPUs on 2 nodes, one EP group of 2.
    slot_begin = np.array([0, 2, 4], dtype=np.int32)
    log2phy = np.array([[[0, 2], [1, -1]]], dtype=np.int32)
    logcnt = np.array([[2, 1]], dtype=np.int32)
    ids = np.zeros((10, 1, 1), dtype=np.int32)            # every token to expert 0
    cu = np.array([0, 5, 10])
    seq_rank = np.array([0, 1], dtype=np.int32)
    seq_mb = np.array([0, 0], dtype=np.int32)
    kw = dict(num_microbatches=1, gpus_per_node=1, ep_size=2, slot_begin=slot_begin,
              log2phy=log2phy, logcnt=logcnt, extra_replicas=np.zeros((0, 4), np.int32),
              shares={})
    even = remap(ids, cu, seq_rank, seq_mb, split="even", **kw).ravel()
    # 5 token-choices from each GPU: (i + 0.5) / 5 = 0.1 0.3 | 0.5 0.7 0.9 against the
    # cumulative weights [0.5, 1.0): intervals are half-open, so the split is 2/3
    assert list(even[:5]) == [0, 0, 2, 2, 2] and list(even[5:]) == [0, 0, 2, 2, 2]
    local = remap(ids, cu, seq_rank, seq_mb, split="locality", **kw).ravel()
    assert list(local[:5]) == [0] * 5 and list(local[5:]) == [2] * 5
    shared = remap(ids, cu, seq_rank, seq_mb, split="locality",
                   **{**kw, "shares": {(0, 0, 0): np.array([0.2, 0.8])}}).ravel()
    assert list(shared[:5]) == [0, 2, 2, 2, 2]            # shares override the rule
    with pytest.raises(ValueError):
        remap(ids, cu, seq_rank, seq_mb, split="nearest", **kw)


def test_empty_step():
    out = remap(np.zeros((0, 2, 2), np.uint8), np.array([0, 0]), np.array([0]), np.array([0]),
                num_microbatches=1, gpus_per_node=1, ep_size=1,
                slot_begin=np.array([0, 2]), log2phy=np.zeros((2, 2, 1), np.int32),
                logcnt=np.ones((2, 2), np.int32), extra_replicas=np.zeros((0, 4), np.int32),
                shares={})
    assert out.shape == (0, 2, 2)
