"""A RoutePack plan in the forms Megatron-Core takes: per microbatch the fields of
``megatron.core.packed_seq_params.PackedSeqParams`` (THD packing), and per MoE layer the
expert placement stock ``MoELayer`` can run, which is a permutation of the experts.

Read against megatron-core 0.16.1 (PyPI; the newest for Python 3.10/3.11) and Megatron-LM
main at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (0.20.0 dev):
megatron/core/packed_seq_params.py, megatron/core/transformer/moe/moe_layer.py
(BaseMoELayer: num_local_experts = num_moe_experts // ep_size, local_expert_indices
contiguous from ep_rank * num_local_experts), token_dispatcher.py
(MoEAlltoAllTokenDispatcher: "local_expert_indices must be continuous"; tokens of expert
e go to EP rank e // num_local_experts), router_replay.py (replayed top-k indices index
the router's scores), megatron/rl/sequence_packing_utils.py (cu_seqlens actual,
cu_seqlens_padded the layout, pad_between_seqs). No Megatron code is used or needed here.

Stock Megatron holds every expert exactly once, num_experts / EP per EP rank, and sends a
token of expert e to EP rank e // num_local_experts. A RoutePack placement that is a
permutation of that (each expert once, E / EP slots per EP rank) is run by renumbering the
experts of each layer: Megatron's expert index p is the plan's physical slot p. Replicas,
spare or unequal slots, per-microbatch extra replicas and replica shares have no stock
equivalent: expert_placement refuses them, or drops them when told to (docs/adapters.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .. import errors
from . import _plan

# What PackedSeqParams needs from us; the rest (cp_group, local_cp_size, ...) is the
# trainer's. *_padded only when sequences are padded.
REQUIRED_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")
PADDED_FIELDS = ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def default_pad_multiple(res):
    """The multiple each sequence is padded to when the caller gives none: the TP size
    (sequence parallelism, which Megatron says must be used with EP and TP, splits the
    packed tokens over the TP group; verl pads to it too), and under context parallelism
    (``topology.context_parallel_size`` CP > 1) TP x CP x 2: each CP rank takes two of the
    sequence's 2 CP load-balanced causal chunks, each split over TP. The same rule as verl's
    ``preprocess_packed_seqs`` (``align_size = tp_size * cp_size * 2 if cp_size > 1 else
    tp_size``) and the padding RoutePack's cost model counts."""
    tp = int(_plan.config_value(res, "tensor_parallel_size", 1))
    cp = int(_plan.config_value(res, "context_parallel_size", 1))
    return tp * cp * 2 if cp > 1 else tp


def packed_seq_params(res, rank, *, pad_multiple=None, device=None, cls=None, allow_empty=False):
    """The THD ``PackedSeqParams`` of each microbatch DP rank ``rank`` runs in StepResult
    ``res``: a list of M entries in run order (entry k is microbatch
    ``res.microbatch_order[rank][k]``; index order for a plan without an order), each for the
    tokens of ``res.microbatches[rank][m]``'s sequences concatenated in that order (each
    padded to ``pad_multiple``), which is what ``routepack.torch.pack_microbatches(...,
    order=res.microbatch_order)`` packs.

    Each entry has ``qkv_format="thd"``; ``cu_seqlens_q`` = ``cu_seqlens_kv``: int32 [n + 1]
    torch tensors on ``device``, the sequences' cumulative true lengths; ``max_seqlen_q`` =
    ``max_seqlen_kv``: the longest (padded) sequence, an int; with ``pad_multiple`` > 1
    also ``cu_seqlens_q_padded`` = ``cu_seqlens_kv_padded`` (the cumulative padded lengths:
    where each sequence starts in the packed buffer), ``total_tokens`` (the buffer's
    length) and ``pad_between_seqs=True``, as Megatron's own RL packing sets them.

    ``pad_multiple``: None for default_pad_multiple(res) (the TP size), else >= 1.
    ``cls``: None returns dicts of those fields; a class (``PackedSeqParams``) returns
    instances made with the fields it declares (fields it lacks, e.g. ``total_tokens`` in
    megatron-core 0.16, are left out; a class lacking a required one is an
    InvalidArgumentError naming it). ``allow_empty``: a microbatch of this rank without
    sequences is an entry ``None`` (Megatron RL's convention) instead of a PlanError.

    Imports torch (ImportError with how to install it)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("routepack.adapters.megatron.packed_seq_params needs PyTorch: "
                          "pip install 'routepack[torch]' (or pip install torch)") from e
    lists = _plan.microbatches(res)
    G = len(lists)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < G:
        raise errors.InvalidArgumentError("rank must be a DP rank of the plan, 0 to %d, got %r"
                                          % (G - 1, rank))
    multiple = default_pad_multiple(res) if pad_multiple is None else pad_multiple
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise errors.InvalidArgumentError("pad_multiple must be an integer >= 1, got %r"
                                          % (pad_multiple,))
    multiple = int(multiple)
    names = None
    if cls is not None:
        names = {f.name for f in fields(cls)}
        need = REQUIRED_FIELDS + (PADDED_FIELDS if multiple > 1 else ())
        missing = [n for n in need if n not in names]
        if missing:
            raise errors.InvalidArgumentError("%s has no field %s, which the packing needs"
                                              % (cls.__name__, ", ".join(missing)))
    lens = _plan.seq_lens(res)
    out = []
    for mb in _plan.run_order(res)[rank]:
        ids = lists[rank][mb]
        if len(ids) == 0:
            if allow_empty:
                out.append(None)
                continue
            raise errors.PlanError(
                "rank %d microbatch %d holds no sequence; a THD microbatch needs one "
                "(allow_empty=True gives None for it, and the trainer must still run the "
                "microbatch's collectives)" % (rank, mb))
        true = lens[ids]
        padded = -(-true // multiple) * multiple
        cu = torch.as_tensor(np.concatenate([[0], np.cumsum(true)]), dtype=torch.int32,
                             device=device)
        kw = {"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu,
              "max_seqlen_q": int(padded.max()), "max_seqlen_kv": int(padded.max())}
        if multiple > 1:
            cu_pad = torch.as_tensor(np.concatenate([[0], np.cumsum(padded)]),
                                     dtype=torch.int32, device=device)
            kw.update(cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                      total_tokens=int(padded.sum()), pad_between_seqs=True)
        if cls is not None:
            kw = cls(**{k: v for k, v in kw.items() if k in names})
        out.append(kw)
    return out


@dataclass(frozen=True)
class Dropped:
    """What expert_placement(..., drop=True) left out of a plan: ``replicas`` (slot copies
    beyond the first of each expert, summed over layers), ``extra_replicas`` (the plan's
    per-microbatch extra replicas), ``share_sets`` (its explicit replica token shares),
    ``empty_slots`` (slots holding no expert), and ``moved`` (int [L]: experts per layer
    that had to go to an EP rank holding none of their replicas, to give every EP rank
    num_experts / EP)."""

    replicas: int
    extra_replicas: int
    share_sets: int
    empty_slots: int
    moved: np.ndarray

    @property
    def anything(self):
        return bool(self.replicas or self.extra_replicas or self.share_sets or self.empty_slots
                    or self.moved.any())


@dataclass(frozen=True)
class ExpertPlacement:
    """A plan's placement as stock Megatron-Core runs it: per MoE layer a permutation of
    the experts.

    ``expert_order``: int64 [L, E]; Megatron's expert index p of layer l is logical expert
    ``expert_order[l, p]``, held by EP rank ``p // num_local_experts`` (Megatron's EP rank
    in its EP group of ``expert_parallel_size``) as its local expert
    ``p % num_local_experts``. ``expert_index``: int64 [L, E], the inverse (logical expert
    -> Megatron index). ``dropped``: what the plan had that this placement leaves out (all
    zero unless expert_placement was told to drop).

    Run it by renumbering each layer's experts: the router's rows (``router.weight[E,
    hidden]`` and ``expert_bias``) in ``expert_order``, the replayed top-k ids through
    ``to_megatron``, and expert p's weights (and optimizer state) on its EP rank."""

    expert_order: np.ndarray
    expert_index: np.ndarray
    expert_parallel_size: int
    dropped: Dropped

    @property
    def num_layers(self):
        return self.expert_order.shape[0]

    @property
    def num_experts(self):
        return self.expert_order.shape[1]

    @property
    def num_local_experts(self):
        return self.num_experts // self.expert_parallel_size

    def local_expert_indices(self, ep_rank):
        """Megatron's ``local_expert_indices`` of EP rank ``ep_rank`` (unchanged from stock:
        contiguous), list of int."""
        n = self.num_local_experts
        return list(range(ep_rank * n, (ep_rank + 1) * n))

    def local_experts(self, layer, ep_rank):
        """The logical experts EP rank ``ep_rank`` holds at layer ``layer``, in its local
        order: int64 [num_local_experts]."""
        n = self.num_local_experts
        return self.expert_order[layer, ep_rank * n:(ep_rank + 1) * n].copy()

    def to_megatron(self, topk_ids, layer):
        """Replayed logical expert ids of layer ``layer`` (numpy or torch, any shape) as
        Megatron expert indices, of the same type, shape and device (int64)."""
        if type(topk_ids).__module__.startswith("torch"):
            import torch
            table = torch.as_tensor(self.expert_index[layer], device=topk_ids.device)
            return table[topk_ids.long()]
        return self.expert_index[layer][np.asarray(topk_ids, dtype=np.int64)]

    def permutation_from(self, previous):
        """int64 [L, E]: per layer, the index that turns a tensor of per-expert rows in
        ``previous``'s order into this placement's order: ``new = old[perm[l]]`` (router
        rows, ``expert_bias``, and the gathered expert weights)."""
        if previous.expert_order.shape != self.expert_order.shape:
            raise errors.InvalidArgumentError("the placements have shapes %s and %s"
                                              % (previous.expert_order.shape,
                                                 self.expert_order.shape))
        return np.take_along_axis(previous.expert_index, self.expert_order, axis=1)

    def moves_from(self, previous):
        """The experts that change EP rank from ``previous`` to this placement: int64
        [n, 4] rows of (layer, expert, from EP rank, to EP rank), layer-major, by expert."""
        n = self.num_local_experts
        src = previous.expert_index // n
        dst = self.expert_index // n
        layer, expert = np.nonzero(src != dst)
        return np.stack([layer, expert, src[layer, expert], dst[layer, expert]], axis=1)


def _megatron_ep(res):
    """(Megatron's EP size, EP ranks per plan rank) of the step's layout."""
    per_rank = (_plan.config_value(res, "tensor_parallel_size", 1)
                // _plan.config_value(res, "expert_tensor_parallel_size", 1))
    return int(res.ep_size) * per_rank, per_rank


def _slot_ep_ranks(res, per_rank):
    """Megatron EP rank of every physical slot (int64 [total_slots]): a plan rank's slots
    split over its TP / ETP EP ranks in order (docs/cost-model.md, "TP and ETP")."""
    begin = np.asarray(res.slot_begin, dtype=np.int64)
    out = np.empty(int(begin[-1]), dtype=np.int64)
    for j in range(len(begin) - 1):
        n = int(begin[j + 1] - begin[j])
        out[begin[j]:begin[j + 1]] = j * per_rank + np.arange(n) * per_rank // max(n, 1)
    return out


def _assign(slots_of, slot_rank, num_ranks, per_rank_experts):
    """Each expert to one EP rank, each rank exactly ``per_rank_experts`` experts,
    preferring a rank that holds one of the expert's replicas (a capacitated bipartite
    matching by augmenting paths, experts with the fewest replica ranks first). Returns
    (rank of each expert, the slot it keeps or -1 when moved)."""
    E = len(slots_of)
    cand = []
    for e in range(E):
        ranks = []
        for p in slots_of[e]:
            r = int(slot_rank[p])
            if r not in ranks:
                ranks.append(r)
        cand.append(ranks)
    holder = [[] for _ in range(num_ranks)]
    rank_of = [-1] * E

    def augment(e, seen):
        # rank-level augmenting path: a rank is visited once per search, its seats are
        # interchangeable; an expert displaced from r cannot return to r (visited)
        for r in cand[e]:
            if r in seen:
                continue
            seen.add(r)
            if len(holder[r]) < per_rank_experts:
                holder[r].append(e)
                rank_of[e] = r
                return True
            for other in list(holder[r]):
                if augment(other, seen):
                    holder[r].remove(other)
                    holder[r].append(e)
                    rank_of[e] = r
                    return True
        return False

    for e in sorted(range(E), key=lambda e: (len(cand[e]), e)):
        if cand[e]:
            augment(e, set())
    for e in range(E):   # experts no replica rank could take: the first ranks with room
        if rank_of[e] < 0:
            r = next(r for r in range(num_ranks) if len(holder[r]) < per_rank_experts)
            holder[r].append(e)
            rank_of[e] = r
    kept = [next((p for p in slots_of[e] if slot_rank[p] == rank_of[e]), -1) for e in range(E)]
    return rank_of, kept


def expert_placement(res, *, drop=False):
    """The placement of StepResult ``res`` as stock Megatron-Core runs it (ExpertPlacement).

    Megatron's EP size is the config's ``expert_parallel_size`` (= plan EP size x TP /
    ETP); each EP rank gets num_experts / EP experts. A plan that is such a permutation
    (each expert in one slot, E / EP slots on every EP rank, no extra replicas or shares)
    converts exactly: Megatron index p is physical slot p.

    Anything else raises NotSupportedError saying what stock Megatron cannot hold, unless
    ``drop=True``: then each expert keeps one of its replicas, chosen so that every EP rank
    holds exactly E / EP experts (experts that cannot stay on a rank holding them go to a
    rank with room), extra replicas and shares are left out, and ``.dropped`` counts what
    went. ``num_experts`` not a multiple of EP is refused either way (Megatron asserts it).
    A result without a placement is a PlanError."""
    if res.phy2log is None:
        raise errors.PlanError("the plan has no placement (a packing-only plan); Megatron keeps "
                               "its own contiguous placement")
    E, L = int(res.num_experts), int(res.num_layers)
    ep, per_rank = _megatron_ep(res)
    if E % ep:
        raise errors.NotSupportedError(
            "the model has %d experts, not a multiple of Megatron's EP size %d "
            "(MoELayer asserts num_moe_experts %% ep_size == 0)" % (E, ep))
    n_local = E // ep
    phy2log = np.asarray(res.phy2log, dtype=np.int64)
    logcnt = np.asarray(res.logcnt, dtype=np.int64)
    slot_rank = _slot_ep_ranks(res, per_rank)
    slots_per_rank = np.bincount(slot_rank, minlength=ep)

    reasons = []
    if (slots_per_rank != n_local).any():
        r = int(np.flatnonzero(slots_per_rank != n_local)[0])
        reasons.append("EP rank %d has %d slots per layer where Megatron has num_experts / EP "
                       "= %d (%d slots in all for %d experts)"
                       % (r, slots_per_rank[r], n_local, len(slot_rank), E))
    replicated = np.argwhere(logcnt > 1)
    if len(replicated):
        l, e = (int(x) for x in replicated[0])
        reasons.append("layer %d expert %d has %d replicas (slots %s)%s"
                       % (l, e, logcnt[l, e], ", ".join(str(int(p)) for p in np.flatnonzero(phy2log[l] == e)),
                          " and %d more experts over the layers have several" % (len(replicated) - 1)
                          if len(replicated) > 1 else ""))
    n_extra = len(res.extra_replicas)
    if n_extra:
        reasons.append("%d per-microbatch extra replicas" % n_extra)
    if res.shares:
        reasons.append("%d replica token-share sets" % len(res.shares))
    empty = int((phy2log < 0).sum())
    if reasons and not drop:
        raise errors.NotSupportedError(
            "stock Megatron-Core cannot run this plan's placement: %s. Its MoELayer holds "
            "each expert exactly once, num_experts / EP = %d contiguous local experts per EP "
            "rank, and no per-microbatch replicas or shares. Pass drop=True to keep one "
            "replica of each expert (expert_placement(...).dropped says what went), or run "
            "the plan with routepack.torch.MoELayer" % ("; ".join(reasons), n_local))

    order = np.empty((L, E), dtype=np.int64)
    moved = np.zeros(L, dtype=np.int64)
    for l in range(L):
        if not reasons:
            order[l] = phy2log[l]
            continue
        slots_of = [[] for _ in range(E)]
        for p, e in enumerate(phy2log[l]):
            if e >= 0:
                slots_of[e].append(p)
        rank_of, kept = _assign(slots_of, slot_rank, ep, n_local)
        moved[l] = sum(1 for k in kept if k < 0)
        for r in range(ep):
            mine = [e for e in range(E) if rank_of[e] == r]
            # stay in slot order where the plan put them; moved experts after, by id
            mine.sort(key=lambda e: (kept[e] < 0, kept[e], e))
            order[l, r * n_local:(r + 1) * n_local] = mine
    index = np.empty_like(order)
    np.put_along_axis(index, order, np.arange(E, dtype=np.int64)[None, :].repeat(L, 0), axis=1)
    dropped = Dropped(replicas=int((logcnt - 1).clip(min=0).sum()) if reasons else 0,
                      extra_replicas=n_extra if reasons else 0,
                      share_sets=len(res.shares) if reasons else 0,
                      empty_slots=empty if reasons else 0, moved=moved)
    return ExpertPlacement(expert_order=order, expert_index=index, expert_parallel_size=ep,
                           dropped=dropped)
