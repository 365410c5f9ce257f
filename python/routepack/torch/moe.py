"""MoELayer: a mixture-of-experts layer that executes a RoutePack plan: each token-choice
goes to the physical replica the plan assigns it (log2phy with the per-microbatch replica
shares and extra replicas, resolved into physical ids by rp_remap), tokens move with one
all_to_all_single each way, every local expert runs on its rows, and the replicas of an
expert get the sum of all their gradients so they stay identical. Placement changes where
the work runs, never what is computed: the output and the gradients equal those of the
same experts held once each (tests/torch check this against a dense reference).

The structure follows Megatron-Core's alltoall token dispatcher, so each piece maps onto
one there: ``_dispatch_layout`` is its preprocess (counts per rank and local expert, the
layer's one device-to-host synchronisation, as its cuda_sync_point), ``all_to_all`` its
_AllToAll, ``_expert_compute`` its GroupedMLP, ``reduce_replica_grads`` the extra
reduction a replicated expert needs next to the usual expert-data-parallel one.

What a forward costs the host: placement tables live on the device (made once per
placement, by prepare or at its first fetch_replicas), the counts cross to the host once, the expert weights are the slot
parameter and the step's extra-replica buffer as they are (two grouped GEMMs, no copy of
weights per forward, a backward linear in the slots)."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..placement import ExpertPlacement  # noqa: F401 (routepack.torch.ExpertPlacement)
from . import holders, kernels
from ._p2p import ring_padding

DISPATCH_DEDUP = ("gpu", "choice")   # execution.dispatch_dedup values the layer runs


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (input_splits, output_splits)
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad, input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x, output_splits, input_splits, group=None):
    """Rows of ``x`` [n, ...]: input_splits[r] rows go to rank r; returns the rows received,
    output_splits[r] from rank r, in rank order. Differentiable."""
    return _AllToAll.apply(x, list(map(int, output_splits)), list(map(int, input_splits)), group)


class _BackwardEnd(torch.autograd.Function):
    """Identity on the layer's input whose backward runs once the layer's whole backward
    has (every other gradient of the layer is computed before its input's): it tells the
    layer, which can then start reducing replica gradients while earlier layers run."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.layer._backward_ended()
        return grad, None


def to_host(t):
    """The one way the layer reads a device tensor on the host (numpy): where a CUDA
    tensor makes the host wait. Tests count calls through torch.Tensor.numpy."""
    return t.cpu().numpy()


class _PlacementTables:
    """Everything a forward needs from a placement, made once per placement
    (MoELayer.prepare; the same ExpertPlacement object again reuses them): per
    microbatch the destination key (EP rank x max_local + local expert) of every physical
    id, on the layer's device; the lowest slot of each expert (default routing)."""

    def __init__(self, placement, device):
        W = placement.ep_size
        S = placement.num_slots
        step = placement.step_extras()
        self.local_extras = [int(np.sum(step[:, 1] == r)) for r in range(W)]
        self.num_local = [placement.local_slots(r) + self.local_extras[r] for r in range(W)]
        self.max_local = max(max(self.num_local), 1)
        slot_rank = placement.slot_rank()
        self.keys = []
        for m in range(placement.num_microbatches):
            _, rank, local = placement.physical(m)
            self.keys.append(torch.as_tensor(rank * self.max_local + local, dtype=torch.int64).to(device))
        first = placement.first_replica()
        self.first_key = torch.as_tensor(np.where(first >= 0, slot_rank[np.maximum(first, 0)] * self.max_local
                                                  + (first - placement.slot_begin[slot_rank[np.maximum(first, 0)]]),
                                                  -1), dtype=torch.int64).to(device)


class MoELayer(nn.Module):
    """A top-k MoE layer with experts in slots spread over an EP group.

    Parameters (this rank's): ``router.weight`` [E, hidden] (dense: the trainer reduces its
    gradient over data parallel ranks, as for attention), ``w_in`` [num_slots, hidden, ffn]
    and ``w_out`` [num_slots, ffn, hidden]: slot s holds the expert the placement puts in
    this rank's slot s (expert(x) = silu(x @ w_in) @ w_out). ``gated=True``: SwiGLU experts,
    ``w_in`` [num_slots, hidden, 2 ffn] (gate, then up) and expert(x) = (silu(x @ w_gate) *
    (x @ w_up)) @ w_out. ``expert_kernel``: None (default) chooses once, at the first
    forward, with kernels.choose_expert_kernel for the weights' device, dtype and shape
    (GROUPED where it matches the loop there; ``expert_kernel_reason`` says why);
    kernels.GROUPED or kernels.LOOP force one. ``dispatch_dedup``: the config's ``execution.dispatch_dedup``, the setting
    the cost model prices: "gpu" (default) sends one copy of a token to each EP rank
    that runs any of its choices and sums its gated expert outputs there (DeepEP's
    dispatch and combine), "choice" sends one copy per token-choice and sums at the
    source (Megatron's alltoall dispatcher); "node" is refused (fan-out over NVLink is
    the dispatcher's, not this layer's). ``ep_group``: the EP group's process group (None:
    the world); its rank r is EP rank r of the plan.

    Per step: fetch_replicas(placement) (collective: fetches the weights of this step's
    extra replicas into a buffer kept for the step), then per microbatch forward(x,
    routing, physical, microbatch) on every rank of the group in lockstep (even with no
    tokens), backward; the replica-gradient exchange starts by itself when the layer's
    backward of the step's last microbatch ends, and reduce_replica_grads() (collective)
    finishes it before the optimizer step (or does it all, if it did not start)."""

    PREPARED = 16   # placements whose tables a layer keeps (prepare): a step's per-forward ones

    def __init__(self, hidden_size, ffn_size, num_experts, top_k, num_slots, *, ep_group=None,
                 dtype=torch.float32, device=None, gated=False, expert_kernel=None, dispatch_dedup="gpu",
                 fetch_group=None):
        super().__init__()
        # the extra replicas' prefetch runs on a group of its own (the same ranks as
        # ep_group) so that under NCCL it does not queue ahead of the dispatch on one
        # communicator; None: ep_group
        self.fetch_group = fetch_group
        self.hidden_size, self.ffn_size = int(hidden_size), int(ffn_size)
        self.num_experts, self.top_k, self.num_slots = int(num_experts), int(top_k), int(num_slots)
        self.ep_group = ep_group
        self.ep_rank = dist.get_rank(ep_group)
        self.ep_size = dist.get_world_size(ep_group)
        if dispatch_dedup not in DISPATCH_DEDUP:
            raise ValueError("dispatch_dedup %r: MoELayer runs %s (execution.dispatch_dedup \"node\" fans copies "
                             "out over NVLink, which is the dispatcher's, not this layer's)"
                             % (dispatch_dedup, " and ".join('"%s"' % d for d in DISPATCH_DEDUP)))
        self.dispatch_dedup = dispatch_dedup
        self.router = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.gated = bool(gated)
        self.expert_kernel = expert_kernel
        self.expert_kernel_reason = "given" if expert_kernel is not None else None
        self._kernel_for = None   # (device, dtype) the kernel was chosen for
        in_width = 2 * ffn_size if gated else ffn_size
        self.w_in = nn.Parameter(torch.empty(num_slots, hidden_size, in_width, dtype=dtype, device=device))
        self.w_out = nn.Parameter(torch.empty(num_slots, ffn_size, hidden_size, dtype=dtype, device=device))
        self.placement = None
        self.last_routing = None
        # This step's extra replicas held here ([n, hidden, in_width], [n, ffn, hidden],
        # leaves whose .grad sums every microbatch's): placement.step_extras() rows of this
        # rank, in that order. Not parameters: the optimizer never sees them.
        self.extra_w_in = None
        self.extra_w_out = None
        self._fetch = None   # the prefetch's works still in flight (fetch_replicas)
        self._tables = None
        self._gplan = None
        # placements whose tables are made (prepare): id -> (placement, device, tables,
        # gradient plan); the placement is kept so that its id stays its own
        self._prepared = collections.OrderedDict()
        self._backwards = 0
        self._grad_exchange = None
        self.replica_grad_bytes = {"sent": 0, "received": 0}   # the last reduction's

    # ---- weights ----

    def load_experts(self, w_in, w_out, placement):
        """Fill this rank's slots from logical expert weights w_in [E, hidden, ffn],
        w_out [E, ffn, hidden] (the same on every rank) under ``placement``."""
        b = int(placement.slot_begin[self.ep_rank])
        ids = placement.phy2log[b:b + self.num_slots]
        with torch.no_grad():
            for s, e in enumerate(ids):   # an empty slot (-1) is zeroed
                self.w_in[s].copy_(w_in[e] if e >= 0 else torch.zeros_like(self.w_in[s]))
                self.w_out[s].copy_(w_out[e] if e >= 0 else torch.zeros_like(self.w_out[s]))

    def gather_experts(self, placement):
        """Logical expert weights (w_in [E, hidden, ffn], w_out [E, ffn, hidden]), each
        from its lowest slot, on every rank (collective: all_gather over the EP group)."""
        w_in = [torch.empty_like(self.w_in) for _ in range(self.ep_size)]
        w_out = [torch.empty_like(self.w_out) for _ in range(self.ep_size)]
        dist.all_gather(w_in, self.w_in.detach().contiguous(), group=self.ep_group)
        dist.all_gather(w_out, self.w_out.detach().contiguous(), group=self.ep_group)
        every_in, every_out = torch.cat(w_in), torch.cat(w_out)   # [S, ...] slot order
        first = torch.as_tensor(placement.first_replica(), device=every_in.device)
        return every_in[first], every_out[first]

    def extra_replica_bytes(self):
        """Bytes this layer holds for the step's extra replicas: their weights and, once
        a backward ran, their gradients (what rp_memory_gpu counts as extra_replica_bytes
        for this layer on this rank)."""
        n = 0
        for t in (self.extra_w_in, self.extra_w_out):
            if t is not None:
                n += t.numel() * t.element_size()
                if t.grad is not None:
                    n += t.grad.numel() * t.grad.element_size()
        return n

    # ---- per step ----

    def _global(self, r):
        return r if self.ep_group is None else dist.get_global_rank(self.ep_group, r)

    def set_placement(self, placement, prefetch=True):
        """The former name of fetch_replicas (FutureWarning)."""
        warnings.warn("MoELayer.set_placement(placement) is fetch_replicas(placement), a collective",
                      FutureWarning, stacklevel=2)
        self.fetch_replicas(placement, prefetch)

    def fetch_replicas(self, placement, prefetch=True):
        """Collective over the EP group: use ``placement`` (ExpertPlacement, this step's:
        StepResult.placement(layer)) from now on, and fetch the weights of every extra
        replica this rank holds in some microbatch of the step from the lowest slot
        holding that expert, into the step's extra-replica buffers (one
        batch_isend_irecv over fetch_group, else the EP group: every rank calls it and
        takes part in it). ``prefetch`` (the default): the fetch is started
        and left in flight, and the layer waits for it at its first forward, so a trainer
        that sets every layer's placement at the step's start fetches layer l's extras
        while the layers before it compute (the cost model's execution.extras_ahead);
        False: it is finished before this returns. The slots must hold the placement's
        experts already (migration executed). A replica-gradient exchange or a prefetch
        still in flight is finished first."""
        self._wait_fetch()
        if placement.ep_size != self.ep_size or placement.local_slots(self.ep_rank) != self.num_slots:
            raise ValueError("the placement has %d EP ranks and %d slots on rank %d; this layer has %d "
                             "ranks and %d slots" % (placement.ep_size, placement.local_slots(self.ep_rank),
                                                     self.ep_rank, self.ep_size, self.num_slots))
        if self._grad_exchange is not None:
            self.reduce_replica_grads()
        self._tables, self._gplan = self.prepare(placement)
        self.placement = placement
        self._backwards = 0
        pairs = placement.step_extras()
        mine = pairs[pairs[:, 1] == self.ep_rank]
        n = len(mine)
        if self.extra_w_in is None or self.extra_w_in.shape[0] != n:
            self.extra_w_in = self.w_in.new_empty((n,) + tuple(self.w_in.shape[1:]))
            self.extra_w_out = self.w_out.new_empty((n,) + tuple(self.w_out.shape[1:]))
        self.extra_w_in.grad = None
        self.extra_w_out.grad = None
        if len(pairs) == 0:
            return
        first = placement.first_replica()
        slot_rank = placement.slot_rank()
        ops, remote, j = [], False, 0
        group = self.fetch_group if self.fetch_group is not None else self.ep_group
        w_in, w_out = self.w_in.detach(), self.w_out.detach()
        with torch.no_grad():
            for e, r in pairs:   # every rank walks the same list in the same order
                src_slot = int(first[e])
                src = int(slot_rank[src_slot])
                local = src_slot - int(placement.slot_begin[src])
                remote |= src != r
                if r == self.ep_rank:
                    if src == self.ep_rank:
                        self.extra_w_in[j].copy_(w_in[local])
                        self.extra_w_out[j].copy_(w_out[local])
                    else:
                        ops += [dist.P2POp(dist.irecv, self.extra_w_in[j], self._global(src), group),
                                dist.P2POp(dist.irecv, self.extra_w_out[j], self._global(src), group)]
                    j += 1
                elif src == self.ep_rank:
                    ops += [dist.P2POp(dist.isend, w_in[local], self._global(r), group),
                            dist.P2POp(dist.isend, w_out[local], self._global(r), group)]
        if remote:   # the same on every rank: then every rank takes part
            ops += ring_padding(self.ep_rank, self.ep_size, w_in, self._global, group)
            self._fetch = dist.batch_isend_irecv(ops)
            if not prefetch:
                self._wait_fetch()
            return
        self.extra_w_in.requires_grad_()
        self.extra_w_out.requires_grad_()

    def prepare(self, placement):
        """Make what a forward and the replica-gradient exchange need from ``placement``
        (ExpertPlacement): the destination keys of every physical id per microbatch and the
        exchange's plan: host work, no communication. fetch_replicas prepares a placement
        it has not seen; a trainer that knows its placements before the step (a plan is
        made before the step starts; a per-forward balancer's placements, planned ahead)
        prepares them first, so the step does none of it. The layer keeps the last
        PREPARED placements (by object: the same ExpertPlacement object again reuses its
        tables). Returns (tables, gradient plan)."""
        key, dev = id(placement), self.w_in.device
        hit = self._prepared.get(key)
        if hit is not None and hit[0] is placement and hit[1] == dev:
            self._prepared.move_to_end(key)
            return hit[2], hit[3]
        tables, gplan = _PlacementTables(placement, dev), self._grad_plan(placement)
        self._prepared[key] = (placement, dev, tables, gplan)
        while len(self._prepared) > self.PREPARED:
            self._prepared.popitem(last=False)
        return tables, gplan

    def _wait_fetch(self):
        """Finish the extra replicas' fetch fetch_replicas left in flight (if any)."""
        if self._fetch is None:
            return
        for w in self._fetch:
            w.wait()
        self._fetch = None
        self.extra_w_in.requires_grad_()
        self.extra_w_out.requires_grad_()

    # ---- replica gradients ----

    @staticmethod
    def _grad_of(p):
        """Where a trainer keeps p's gradient: Megatron DDP's main_grad (with .grad None),
        else .grad (created as zeros when missing)."""
        g = getattr(p, "main_grad", None)
        if g is not None:
            return g
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def _backward_ended(self):
        if self._backwards is None:   # this step's replica gradients are reduced already
            return
        self._backwards += 1
        if self._backwards == self.placement.num_microbatches and self._grad_exchange is None:
            self._start_grad_exchange()

    def _grad_plan(self, placement):
        """What this rank's replica-gradient exchange moves, fixed per placement
        (holders.exchange_plan over the slots and the step's extra replicas): the
        replicated experts it holds (``shared``: the rows of its own sums), which rows its
        slots and its extra replicas fill, per peer holder the rows they share (None:
        every row), and how the own sums are made (``own``): "slots" or "extras" where
        every row has one copy here and those copies are a run of the slots or the extra
        replicas in row order (the own sums are then the gradients as they are, a view),
        "gather" with one copy a row otherwise, "sum" where a row has several."""
        every = placement.replica_holders(self.num_experts)
        # only the holders keeping an expert in a slot need its total: a rank whose copies
        # are all extra replicas (dropped after the step) sends and receives nothing
        slot_rank = placement.slot_rank()
        in_slots = {e: sorted(set(slot_rank[placement.phy2log == e].tolist())) for e in every}
        shared, sends, recvs, spans = holders.exchange_plan_to(every, in_slots, self.ep_rank)
        index = {e: i for i, e in enumerate(shared)}
        dev = self.w_in.device
        b = int(placement.slot_begin[self.ep_rank])
        slot_rows = [(index[int(e)], s) for s, e in enumerate(placement.phy2log[b:b + self.num_slots])
                     if int(e) in index]
        step = placement.step_extras()
        extra_rows = [index[int(e)] for e in step[step[:, 1] == self.ep_rank, 0]]
        rows = [i for i, _ in slot_rows]
        slots = [s for _, s in slot_rows]
        n = len(shared)
        run = list(range(n))
        one_copy = sorted(rows + extra_rows) == run
        own = "sum"
        if n and one_copy and rows == run and slots == list(range(slots[0], slots[0] + n)) and not extra_rows:
            own = "slots"
        elif n and one_copy and not rows and extra_rows == run:   # every extra replica held here, in order
            own = "extras"
        elif one_copy:
            own = "gather"

        def ids(v):
            return torch.as_tensor(v, dtype=torch.int64).to(dev)
        # where the totals go: a run of slots in row order (a view), else an index_copy
        slot_run = slots[0] if rows and rows == list(range(len(rows))) and \
            slots == list(range(slots[0], slots[0] + len(rows))) else None
        return dict(shared=n, exchange=spans, own=own, slot_run=slot_run,
                    rows=ids(rows), slots=ids(slots), extra_rows=ids(extra_rows),
                    sends=holders.peer_rows(sends, n, dev), recvs=holders.peer_rows(recvs, n, dev))

    def _own_sums(self, plan):
        """This rank's sum of its copies of each shared expert, as two pieces ([shared,
        w_in's params], [shared, w_out's]) in the gradients' dtype; views of the
        gradients themselves where plan["own"] allows."""
        g = (self._grad_of(self.w_in), self._grad_of(self.w_out))
        S, n = self.num_slots, plan["shared"]
        flat = tuple(t.view(S, -1) if t.is_contiguous() else t.reshape(S, -1) for t in g)
        extras = None
        if plan["extra_rows"].numel():
            ex = (self.extra_w_in, self.extra_w_out)
            extras = tuple(e.grad.reshape(e.shape[0], -1).to(t.dtype) if e.grad is not None
                           else t.new_zeros((e.shape[0], t[0].numel())) for e, t in zip(ex, g))
        if plan["own"] == "slots" and all(t.is_contiguous() for t in g):
            a = plan["slot_run"]
            return tuple(f[a:a + n] for f in flat)
        if plan["own"] == "extras":
            return extras
        with torch.no_grad():
            if plan["own"] == "sum":
                own = tuple(f.new_zeros((n, f.shape[1])) for f in flat)
                for o, f in zip(own, flat):
                    if plan["rows"].numel():
                        o.index_add_(0, plan["rows"], f[plan["slots"]])
                for o, x in zip(own, extras or ()):
                    o.index_add_(0, plan["extra_rows"], x)
                return own
            own = tuple(f.new_empty((n, f.shape[1])) for f in flat)   # "gather": one copy a row
            for o, f in zip(own, flat):
                if plan["rows"].numel():
                    o.index_copy_(0, plan["rows"], f[plan["slots"]])
            for o, x in zip(own, extras or ()):
                o.index_copy_(0, plan["extra_rows"], x)
            return own

    def _start_grad_exchange(self):
        """Each rank sums its own copies of every replicated expert it holds (slots and
        extra replicas) in the gradient's dtype, and sends that sum to every other holder
        of the expert that keeps it in a slot (holders.start_sums: per peer the experts it
        shares with that peer, by id, as two messages, w_in's and w_out's); a slot holder
        receives every other holder's; nothing goes to ranks without a slot copy (a rank
        whose copies are all extra replicas only sends). Every rank calls this (its list may be empty) and takes part
        in the one batch_isend_irecv. Where its copies allow, what is sent is the
        gradients themselves (no sum buffer, no gather copy)."""
        plan = self._gplan
        own = self._own_sums(plan)
        sums = holders.start_sums([(own, plan["sends"], plan["recvs"])], self.ep_rank, self.ep_size,
                                  self.ep_group, plan["exchange"], own[0])
        self.replica_grad_bytes = {"sent": sums.sent, "received": sums.received}
        self._grad_exchange = (sums, own)

    def reduce_replica_grads(self):
        """Give every replica of an expert (slots and this step's extra replicas) the sum of
        all their gradients, so replicas stay identical after the optimizer step. The
        exchange runs among the ranks holding copies only (replica_holders): started
        when the layer's backward of the step's last microbatch ends, or here; this call
        waits for it and writes each sum, added in EP-rank order on every holder (the
        same values everywhere), into this rank's slots' gradients (main_grad where the
        trainer keeps one, else .grad); a rank whose copies of an expert are all extra
        replicas (dropped after the step) only sends, to the slot holders, and receives
        nothing for it. Collective over the EP group (every
        rank calls it). Call after the step's last backward, before the data parallel
        reduction reads the expert gradients, and leave the expert gradients alone
        between the end of that backward and this call (the exchange may be sending
        them as they are); reducing over expert-data-parallel groups (several EP
        groups) stays the trainer's, as without RoutePack."""
        if self.placement is None:
            return
        self._wait_fetch()
        if self._grad_exchange is None:
            self._start_grad_exchange()
        sums, own = self._grad_exchange
        self._grad_exchange = None
        self._backwards = None   # one exchange a step: a late backward does not start another
        plan = self._gplan
        wanted = bool(plan["rows"].numel())
        total = holders.finish_sums(sums, want=[wanted], in_place=True)[0]
        if not wanted:
            return
        with torch.no_grad():
            g = (self._grad_of(self.w_in), self._grad_of(self.w_out))
            for t, x, o in zip(g, total, own):
                if x is o and plan["own"] == "slots":
                    continue   # added up in the slots' gradients themselves
                flat = t.view(self.num_slots, -1)
                a = plan["slot_run"]
                if a is not None:
                    flat[a:a + plan["rows"].numel()].copy_(x[:plan["rows"].numel()])
                else:
                    flat.index_copy_(0, plan["slots"], x[plan["rows"]])

    # ---- forward ----

    def gates(self, x, routing=None):
        """(routing [T, k] int64, gates [T, k] fp32): the router's softmax at the replayed
        experts (``routing`` given: R3) or at its top-k, renormalised over the k."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        if routing is None:
            g, routing = probs.topk(self.top_k, dim=-1)
        else:
            routing = routing.to(device=x.device, dtype=torch.int64)
            g = probs.gather(1, routing)
        return routing, g / g.sum(dim=-1, keepdim=True)

    def _dispatch_layout(self, key, T):
        """Counts for the dispatch of choices with destination keys ``key`` [T*k] (EP rank
        x max_local + local expert): choices per (rank, local expert), and with "gpu"
        dedup the token copies per rank, exchanged with one all_to_all_single and read
        on the host once (the layer's one synchronisation). Returns host arrays
        (choices sent [W, max_local], choices received [W, max_local], copies sent [W],
        copies received [W])."""
        W, ML = self.ep_size, self._tables.max_local
        dev = key.device
        counts = torch.zeros(W, ML + 1, dtype=torch.int64, device=dev)
        # index_add, not bincount: bincount on CUDA reads the largest id on the host
        flat = torch.zeros(W * ML, dtype=torch.int64, device=dev).index_add_(0, key, torch.ones_like(key))
        counts[:, :ML] = flat.view(W, ML)
        if self.dispatch_dedup == "gpu" and key.numel():
            dest = key // ML
            per_token = torch.zeros(T, W, dtype=torch.int64, device=dev)
            per_token.view(-1).index_fill_(0, torch.arange(T, device=dev).repeat_interleave(self.top_k) * W + dest, 1)
            counts[:, ML] = per_token.sum(0)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.ep_group)
        host = to_host(torch.stack([counts, recv]))
        return host[0, :, :ML], host[1, :, :ML], host[0, :, ML], host[1, :, ML]

    def _choose_kernel(self):
        """The expert kernel for the weights' device and dtype, checked once (at the first
        forward, and again only if the module moved to another device or dtype)."""
        where = (self.w_in.device, self.w_in.dtype)
        if self._kernel_for != where and self.expert_kernel_reason != "given":
            self.expert_kernel, self.expert_kernel_reason = kernels.choose_expert_kernel(
                self.w_in.device, self.w_in.dtype, self.hidden_size, self.ffn_size, self.gated)
        self._kernel_for = where

    def _expert_compute(self, rows, per_expert):
        """Each local expert on its rows (rows grouped by local expert, per_expert[j] rows
        for local expert j: the slots, then the step's extra replicas held here): the
        slots' rows through the slot parameters and the extras' through the step's
        buffer, each kernels.expert_mlp with this layer's expert_kernel (Megatron's
        GroupedMLP), on the weights as they are."""
        n_slot_rows = int(sum(per_expert[:self.num_slots]))
        n_extra = self.extra_w_in.shape[0] if self.extra_w_in is not None else 0
        if rows.shape[0] == n_slot_rows:
            return kernels.expert_mlp(rows, per_expert[:self.num_slots], self.w_in, self.w_out, self.expert_kernel)
        # split, not two slices: its backward joins the two gradients (a slice's backward
        # fills a zero tensor of all the rows, for each slice)
        mine, extra = rows.split([n_slot_rows, rows.shape[0] - n_slot_rows])
        out = kernels.expert_mlp(mine, per_expert[:self.num_slots], self.w_in, self.w_out, self.expert_kernel)
        extra = kernels.expert_mlp(extra, per_expert[self.num_slots:self.num_slots + n_extra],
                                   self.extra_w_in, self.extra_w_out, self.expert_kernel)
        return torch.cat([out, extra])

    def forward(self, x, routing=None, physical=None, microbatch=0):
        """``x`` [T, hidden]; ``routing`` [T, k] int: the replayed experts (None: the
        router's top-k); ``physical`` [T, k] int: each choice's physical id under this
        microbatch's placement (rp_remap's ids for this layer; None: the lowest slot of
        each expert). Returns [T, hidden]. Collective over the EP group: every rank calls
        it for every microbatch, with or without tokens."""
        self._wait_fetch()
        if torch.is_grad_enabled() and x.requires_grad:
            x = _BackwardEnd.apply(x, self)
        T, k = x.shape[0], self.top_k
        routing, gates = self.gates(x, routing)
        self.last_routing = routing.detach()   # what a rollout records for replay (R3)
        tables = self._tables
        if self._kernel_for is None or self._kernel_for[0] != self.w_in.device:
            self._choose_kernel()
        if physical is None:
            key = tables.first_key[routing.reshape(-1)]
        else:
            key = tables.keys[microbatch][physical.to(device=x.device, dtype=torch.int64).reshape(-1)]
        sent_c, recv_c, sent_t, recv_t = self._dispatch_layout(key, T)
        ML = tables.max_local
        per_expert = recv_c.sum(0)[:tables.num_local[self.ep_rank]].tolist()
        n_recv = int(recv_c.sum())
        if self.dispatch_dedup == "choice":
            order = torch.argsort(key, stable=True)
            sent = x[order // k]                                     # [T*k, hidden], by destination
            received = all_to_all(sent, recv_c.sum(1), sent_c.sum(1), self.ep_group)
            # received is source-rank-major, each source's rows by local expert: regroup
            # by local expert for the compute, then back.
            by_expert = self._by_expert(received.device, recv_c, n_recv)
            computed = self._expert_compute(received[by_expert], per_expert)
            back = torch.empty_like(computed).index_copy(0, by_expert, computed)
            returned = all_to_all(back, sent_c.sum(1), recv_c.sum(1), self.ep_group)
            out = torch.empty_like(returned).index_copy(0, order, returned).view(T, k, self.hidden_size)
            return (out * gates.to(out.dtype).unsqueeze(-1)).sum(dim=1)
        # "gpu": one copy of a token per destination rank; its choices there travel as
        # (local expert, gate) pairs beside it (-1: a choice that runs elsewhere)
        dest = key // ML
        token_key = dest * max(T, 1) + torch.arange(T * k, device=x.device) // k
        order = torch.argsort(token_key, stable=True)               # by rank, then token
        sorted_key = token_key[order]
        new = torch.ones_like(sorted_key, dtype=torch.bool)
        new[1:] = sorted_key[1:] != sorted_key[:-1]
        copy_of = torch.cumsum(new.to(torch.int64), 0) - 1            # each sorted choice's copy
        U = int(sent_t.sum())
        token = torch.zeros(U, dtype=torch.int64, device=x.device).index_copy(
            0, copy_of, (order // k)) if U else torch.zeros(0, dtype=torch.int64, device=x.device)
        slot = copy_of * k + order % k
        local = torch.full((U * k,), -1, dtype=torch.int64, device=x.device).index_copy(0, slot, key[order] % ML)
        gate = gates.reshape(-1).new_zeros(U * k).index_copy(0, slot, gates.reshape(-1)[order])
        meta = torch.cat([gate.view(U, k).double(), local.view(U, k).double()], dim=1)
        rows = all_to_all(x[token], recv_t, sent_t, self.ep_group)                  # [U_r, hidden]
        meta_r = all_to_all(meta, recv_t, sent_t, self.ep_group)                    # [U_r, 2k]
        local_r = meta_r[:, k:].detach().reshape(-1).to(torch.int64)
        gate_r = meta_r[:, :k].reshape(-1).float()
        choice_order = torch.argsort(torch.where(local_r >= 0, local_r, ML), stable=True)[:n_recv]
        row_of = choice_order // k
        computed = self._expert_compute(rows[row_of], per_expert)
        weighted = computed * gate_r[choice_order].to(computed.dtype).unsqueeze(-1)
        back = rows.new_zeros(rows.shape).index_add(0, row_of, weighted)
        returned = all_to_all(back, sent_t, recv_t, self.ep_group)
        return x.new_zeros((T, self.hidden_size)).index_add(0, token, returned)

    def _by_expert(self, device, recv_c, n_recv):
        """Order of received rows (source-rank-major, each source's by local expert) that
        groups them by local expert, stable; computed on the device from the counts."""
        W, ML = recv_c.shape
        counts = torch.as_tensor(recv_c.reshape(-1), device=device)
        expert_of_row = torch.arange(ML, device=device).repeat(W).repeat_interleave(counts, output_size=n_recv)
        return torch.argsort(expert_of_row, stable=True)
