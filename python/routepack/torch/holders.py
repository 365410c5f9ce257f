"""Replica gradients summed among the ranks that hold an expert: each rank sums its own
copies of every replicated expert it holds and sends that sum to every other holder of the
expert that needs the total (MoELayer: those keeping it in a slot), in one batched
point-to-point call; ranks without a copy of any replicated expert
only take part in the call (NCCL needs every rank of the group in it). Every holder adds
the copies in EP-rank order, so all replicas get the same bits. What the cost model's
``replica_grad_reduce`` "holders" prices (docs/cost-model.md, "Executor profiles").

The exchange itself is one piece for both users: ``exchange_plan`` (who shares which
expert with whom), ``start_sums`` (the batch started, from each layer's rows of own sums)
and ``finish_sums`` (waited for, the sums added in rank order). routepack.torch.MoELayer
feeds it its slots plus its extra replicas and starts it as its backward ends;
``sum_among_holders`` feeds it slot gradients for a layer whose experts live in slots
(Megatron-Core's MoELayer under RoutePack's placement, routepack.adapters.megatron_layer),
all layers in one call."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ._p2p import ring_padding


def row_holders(row, size):
    """{expert: sorted EP ranks holding a copy} for every expert with more than one copy in
    one layer's slots ``row`` (the EP group's, [size * n] logical ids, -1 none)."""
    n = len(row) // size
    counts = np.bincount(row[row >= 0], minlength=1)
    holders = {}
    for p, e in enumerate(row):
        if e >= 0 and counts[e] > 1:
            holders.setdefault(int(e), set()).add(p // n)
    return {e: sorted(r) for e, r in holders.items()}


def exchange_plan(holders, rank):
    """For ``holders`` ({expert: its holder ranks}, experts with several copies): the
    replicated experts this rank holds (``shared``, in id order: the rows of its own sums),
    per peer rank the rows it shares with that peer (``peers``, in peer order), and whether
    any replicated expert spans ranks (``spans``, the same answer on every rank). Every
    holder sends to and receives from every other (exchange_plan_to with every holder a
    receiver)."""
    shared, sends, _, spans = exchange_plan_to(holders, holders, rank)
    return shared, sends, spans


def exchange_plan_to(holders, receivers, rank):
    """exchange_plan where only some holders need the sum: ``receivers`` {expert: the
    holder ranks that need it} (MoELayer: those keeping the expert in a slot; a rank
    whose copies are all extra replicas drops them after the step). Every holder sends
    its rows to each receiver of the expert; a receiver receives from every other holder.
    Returns (shared, sends {peer: rows sent to it}, recvs {peer: rows received from it},
    spans), peers in rank order."""
    spans = any(len(r) > 1 for r in holders.values())
    shared = [e for e in sorted(holders) if rank in holders[e]]
    index = {e: i for i, e in enumerate(shared)}
    sends, recvs = {}, {}
    for e in shared:
        to = receivers.get(e, ())
        for q in to:
            if q != rank:
                sends.setdefault(q, []).append(index[e])
        if rank in to:
            for q in holders[e]:
                if q != rank:
                    recvs.setdefault(q, []).append(index[e])
    return shared, dict(sorted(sends.items())), dict(sorted(recvs.items())), spans


def peer_rows(peers, shared, device):
    """exchange_plan's peers as start_sums takes them: each peer's rows as None where the
    peer shares every one of the ``shared`` rows, a slice where they are a run (what is
    sent is then the rows as they are, a view, not a copy), else an int64 index tensor on
    ``device``."""
    out = {}
    for q, v in peers.items():
        v = [int(i) for i in v]
        if v == list(range(shared)):
            out[q] = None
        elif v == list(range(v[0], v[0] + len(v))):
            out[q] = slice(v[0], v[0] + len(v))
        else:
            out[q] = torch.as_tensor(v, dtype=torch.int64, device=device)
    return out


class Sums:
    """An exchange of own sums in flight (start_sums): ``sent`` and ``received`` bytes of
    this rank; finish_sums waits for it."""

    def __init__(self, works, layers, rank, size, sent, received):
        self.works, self.layers, self.rank, self.size = works, layers, rank, size
        self.sent, self.received = sent, received


def _take(piece, rows):
    """The rows of ``piece`` a peer gets: the piece itself, a slice of it (views) or the
    indexed rows."""
    return piece if rows is None else piece[rows]


def _count(piece, rows):
    if rows is None:
        return piece.shape[0]
    if isinstance(rows, slice):
        return rows.stop - rows.start
    return rows.numel()


def start_sums(layers, rank, size, group=None, spans=True, pad_like=None):
    """Start the exchange of each layer's own sums: ``layers`` a list of (own, peers) or
    (own, sends, recvs); own this rank's sum of its copies of each expert it shares
    (exchange_plan's rows): a tensor [shared, n], or a tuple of pieces [shared, n_i] (the
    parts of an expert's gradient, each its own message: nothing copies them together);
    peers (both ways), sends (to) and recvs (from) {rank: int64 index tensor of the rows
    shared with it, a slice of them, or None for every row (the pieces themselves, or a
    view of them, are sent: no copy)}. Sends own's rows to each peer of sends and
    receives each peer of recvs' rows, all layers in one batch_isend_irecv over
    ``group``; ``spans`` (exchange_plan's, any layer's): every rank adds the ring padding
    so that it takes part, made like ``pad_like`` (a tensor on the group's device).
    Collective over the group. own must not change until finish_sums."""

    def to_global(r):
        return dist.get_global_rank(group, r) if group is not None else r

    ops, pending, sent, received = [], [], 0, 0
    for entry in layers:
        own, sends = entry[0], entry[1]
        recvs = entry[2] if len(entry) > 2 else sends
        for q, rows in sends.items():
            for piece in _pieces(own):
                out = _take(piece, rows)
                ops.append(dist.P2POp(dist.isend, out, to_global(q), group))
                sent += out.numel() * out.element_size()
        recv = {}
        for q, rows in recvs.items():
            recv[q] = []
            for piece in _pieces(own):
                buf = piece.new_empty((_count(piece, rows),) + tuple(piece.shape[1:]))
                recv[q].append(buf)
                ops.append(dist.P2POp(dist.irecv, buf, to_global(q), group))
                received += buf.numel() * buf.element_size()
        pending.append((own, recvs, recv))
    if spans:   # the same on every rank: then every rank takes part
        ops += ring_padding(rank, size, pad_like, to_global, group)
    return Sums(dist.batch_isend_irecv(ops) if ops else [], pending, rank, size, sent, received)


def _pieces(own):
    return own if isinstance(own, tuple) else (own,)


def finish_sums(sums, want=None, in_place=False):
    """Wait for start_sums' exchange; per layer the total of every holder's copies (shaped
    as its own: a tensor or a tuple of pieces), added in EP-rank order (the same values
    on every holder that receives: start_sums' recvs). ``want``: per layer, whether its
    total is needed (False: None in its place, nothing added: a rank whose copies are
    dropped after the step only sends, and receives nothing);
    ``in_place``: where own comes first in rank order, the total is added up in own's
    tensors (returned as they are), else it starts from the first holder's rows when they
    are every row (a received buffer), or zeros."""
    for w in sums.works:
        w.wait()
    totals = []
    with torch.no_grad():
        for i, (own, recvs, recv) in enumerate(sums.layers):
            if want is not None and not want[i]:
                totals.append(None)
                continue
            # rank order: every holder adds the same terms in the same order
            terms = [(None, _pieces(own)) if q == sums.rank else (recvs[q], recv[q])
                     for q in range(sums.size) if q == sums.rank or q in recv]
            rows, first = terms[0]
            if rows is None and (first is not _pieces(own) or in_place):
                total, terms = list(first), terms[1:]
            else:
                total = [torch.zeros_like(p) for p in _pieces(own)]
            for rows, parts in terms:
                for t, x in zip(total, parts):
                    if rows is None:
                        t += x
                    elif isinstance(rows, slice):
                        t[rows] += x
                    else:
                        t.index_add_(0, rows, x)
            totals.append(tuple(total) if isinstance(own, tuple) else total[0])
    return totals


def sum_among_holders(rows, slot_grads, group=None, device=None):
    """Give every slot holding a replicated expert the sum of that expert's gradients over
    all its slots in the EP group ``group`` (default: the world). ``rows``: per layer, the
    EP group's slots' logical experts (int [size * slots], rank r's slots at r * slots);
    ``slot_grads``: per layer, this rank's slots, each a list of gradient tensors (the
    slot's pieces, in the same order and shapes on every slot; written in place).
    Collective over ``group``: every rank calls it with the same ``rows``; ``device``: where
    a rank that holds no replicated expert makes its zero-byte padding (the group's
    device: CUDA under NCCL). Returns the bytes this rank sent (it receives as many)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layers, mine_of, spans_any, like = [], [], False, None
    for row, slots in zip(rows, slot_grads):
        row = np.asarray(row, dtype=np.int64)
        n = len(row) // size
        shared, peers, spans = exchange_plan(row_holders(row, size), rank)
        spans_any = spans_any or spans
        index = {e: i for i, e in enumerate(shared)}
        mine = [(i, index[int(row[rank * n + i])]) for i in range(n) if int(row[rank * n + i]) in index]
        if not mine:
            continue
        first = slots[mine[0][0]]
        like = first[0]
        own = first[0].new_zeros((len(shared), sum(g.numel() for g in first)))
        with torch.no_grad():
            for i, r in mine:
                own[r] += torch.cat([g.reshape(-1) for g in slots[i]])
        layers.append((own, peer_rows(peers, len(shared), own.device)))
        mine_of.append((mine, slots))
    pad = like if like is not None else torch.empty(0, device=device)
    sums = start_sums(layers, rank, size, group, spans_any and size > 1, pad)
    totals = finish_sums(sums, in_place=True)
    with torch.no_grad():
        for total, (mine, slots) in zip(totals, mine_of):
            for i, r in mine:
                at = 0
                for g in slots[i]:
                    g.copy_(total[r, at:at + g.numel()].view(g.shape))
                    at += g.numel()
    return sums.sent
