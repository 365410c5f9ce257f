"""Physical routing in numpy: for every token, layer and choice, the physical slot (or
per-microbatch extra replica) its logical expert is dispatched to, splitting an expert's
tokens over its replicas as the cost model does (docs/cost-model.md, "Where
token-choices go") with one deterministic integer rule. Used until libroutepack has a C
remap (see docs/python.md)."""

from __future__ import annotations

import numpy as np

SPLIT_RULES = ("even", "locality")



def remap(ids, cu_seqlens, seq_rank, seq_microbatch, *, num_microbatches, gpus_per_node,
          ep_size, slot_begin, log2phy, logcnt, extra_replicas, shares, split="even"):
    """Physical ids for logical routing `ids` [tokens, layers, k].

    For each token-choice of expert e at layer l from a sequence packed on GPU g in
    microbatch m, the candidates are e's replicas at (m, l): its slots in ascending slot
    order, then its extra replicas of (m, l) in the plan's order. Their weights are the
    explicit shares of (m, l, e) if the plan sets them, else the split rule's: `even`,
    every replica alike; `locality`, the replicas on g itself if any, else those on g's
    node, else all. The n token-choices of one (g, m, l, e), taken in token order, are
    split by cumulative weight: the i-th goes to the replica whose interval of the
    cumulative normalised weights contains (i + 0.5) / n, so each replica gets its share
    of n within one token-choice and the result depends only on the inputs.

    Returns int32 [tokens, layers, k]: a physical slot in [0, S), S + x for the x-th
    entry of `extra_replicas`, or -1 for tokens of a sequence the plan does not pack.
    """
    if split not in SPLIT_RULES:
        raise ValueError("split must be 'even' or 'locality', got %r" % (split,))
    ids = np.asarray(ids)
    T, L, K = ids.shape
    E = logcnt.shape[1]
    M = int(num_microbatches)
    S = int(slot_begin[-1])
    out = np.full((T, L, K), -1, dtype=np.int32)
    if T == 0:
        return out
    lens = np.diff(cu_seqlens)
    seq_of_tok = np.repeat(np.arange(len(lens)), lens)
    g_tok = np.asarray(seq_rank, dtype=np.int64)[seq_of_tok]
    mb_tok = np.asarray(seq_microbatch, dtype=np.int64)[seq_of_tok]
    packed = g_tok >= 0

    e = ids.astype(np.int64, copy=False)
    layer = np.arange(L, dtype=np.int64)[None, :, None]

    # (m, l, e) keys that have levers: their tokens take the general path.
    lever_keys = set()
    extra_by_key = {}
    for x, (m, l, ex, j) in enumerate(np.asarray(extra_replicas).reshape(-1, 4).tolist()):
        key = (m * L + l) * E + ex
        lever_keys.add(key)
        extra_by_key.setdefault(key, []).append((S + x, j))
    share_by_key = {}
    for (m, l, ex), sh in shares.items():
        key = (m * L + l) * E + ex
        lever_keys.add(key)
        share_by_key[key] = np.asarray(sh, dtype=np.float64)

    cnt = logcnt[layer, e]
    simple = cnt == 1
    if lever_keys:
        mle = (mb_tok[:, None, None] * L + layer) * E + e
        simple &= ~np.isin(mle, np.fromiter(lever_keys, dtype=np.int64))
    np.copyto(out, log2phy[layer, e, 0], where=simple)
    out[~packed] = -1
    multi = ~simple & packed[:, None, None]
    idx = np.flatnonzero(multi)
    if not len(idx):
        return out

    t_m = idx // (L * K)
    l_m = (idx // K) % L
    e_m = e.reshape(-1)[idx]
    g_m = g_tok[t_m]
    mb_m = mb_tok[t_m]
    key = ((g_m * M + mb_m) * L + l_m) * E + e_m
    order = np.argsort(key, kind="stable")      # token order kept inside each key
    ukey, start, counts = np.unique(key[order], return_index=True, return_counts=True)
    U = len(ukey)
    grp = np.repeat(np.arange(U), counts)
    pos = np.arange(len(order)) - np.repeat(start, counts)

    u_e = ukey % E
    u_l = (ukey // E) % L
    u_mle = ukey % (M * L * E)
    u_g = ukey // (E * L * M)
    R = log2phy.shape[2]
    X = max((len(v) for v in extra_by_key.values()), default=0)
    cand = np.full((U, R + X), -1, dtype=np.int64)
    cand[:, :R] = log2phy[u_l, u_e, :]
    cand_rank = np.full((U, R + X), -1, dtype=np.int64)
    main = cand[:, :R]
    cand_rank[:, :R] = np.where(main >= 0,
                                np.searchsorted(slot_begin, np.maximum(main, 0), side="right") - 1,
                                -1)
    for k, lst in extra_by_key.items():
        rows = u_mle == k
        if not rows.any():
            continue
        for c, (phys, j) in enumerate(lst):
            cand[rows, R + c] = phys
            cand_rank[rows, R + c] = j
    valid = cand >= 0

    if split == "even":
        weight = valid.astype(np.float64)
    else:
        my_rank = u_g % ep_size
        group = u_g // ep_size
        my_node = u_g // gpus_per_node
        cand_node = (group[:, None] * ep_size + cand_rank) // gpus_per_node
        same_gpu = valid & (cand_rank == my_rank[:, None])
        same_node = valid & (cand_node == my_node[:, None])
        weight = np.where(same_gpu.any(axis=1)[:, None], same_gpu,
                          np.where(same_node.any(axis=1)[:, None], same_node, valid))
        weight = weight.astype(np.float64)
    for k, sh in share_by_key.items():
        rows = np.flatnonzero(u_mle == k)
        if not len(rows):
            continue
        n_main = int(valid[rows[0], :R].sum())
        w = np.zeros(R + X)
        w[:n_main] = sh[:n_main]
        rest = sh[n_main:]
        w[R:R + len(rest)] = rest
        weight[rows] = w * valid[rows]

    cw = np.cumsum(weight, axis=1)
    total = cw[:, -1:]
    cw = cw / np.where(total > 0, total, 1.0)
    u = (pos + 0.5) / counts[grp]
    col = np.sum(cw[grp] <= u[:, None], axis=1)
    col = np.minimum(col, R + X - 1)
    phys = cand[grp, col]
    out.reshape(-1)[idx[order]] = phys.astype(np.int32)
    return out


def dispatch_ranks(physical, slot_begin, extra_replicas):
    """The EP rank (within the token's own EP group) that each physical id lives on:
    slot p on the rank j with slot_begin[j] <= p < slot_begin[j+1], extra replica S + x
    on extra_replicas[x][3]; -1 stays -1."""
    physical = np.asarray(physical)
    S = int(slot_begin[-1])
    out = np.searchsorted(slot_begin, np.clip(physical, 0, max(S - 1, 0)), side="right") - 1
    out = out.astype(np.int32)
    extra = physical >= S
    if extra.any():
        ex = np.asarray(extra_replicas).reshape(-1, 4)
        out[extra] = ex[physical[extra] - S, 3]
    out[physical < 0] = -1
    return out
