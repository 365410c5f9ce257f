"""MigrationExecutor: a step's expert migration executed on this rank's expert slot tensors
(weights, optimizer state, master copies) by the C executor (rp_migration_execute) over
torch.distributed, all-or-nothing per round on every rank."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from ..executor import CallbackTransport, Registry, execute
from .messenger import TorchMessenger


def slot_tensors(params, optimizer=None, extra=()):
    """The tensors that make up the experts of one MoE layer, in one fixed order: each
    parameter of ``params`` (stacked slot-major: [num_slots, ...]), then each tensor of
    the optimizer's state of that parameter whose shape equals the parameter's (Adam's
    exp_avg and exp_avg_sq, SGD's momentum_buffer; scalars such as Adam's step are
    shared by the slots and do not move), then ``extra`` (e.g. fp32 master copies of the
    same [num_slots, ...] shape). Every rank must get the same list: create the
    optimizer state first (init_optimizer_state)."""
    out = []
    params = list(params)
    for p in params:
        out.append(p)
    if optimizer is not None:
        for p in params:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if torch.is_tensor(v) and v.shape == p.shape:
                    out.append(v)
    out.extend(extra)
    return out


def init_optimizer_state(optimizer):
    """Create the per-parameter state an optimizer would create at its first step, as
    that step would (zeros), so expert state exists (and can be registered and moved)
    before it: Adam, AdamW (with amsgrad), and SGD with momentum (its buffer then starts
    at zero, which gives the same first step when dampening is 0). Other optimizers:
    NotSupportedError; register their state after their first step instead."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                fused = group.get("fused") or group.get("capturable")
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif isinstance(optimizer, torch.optim.SGD):
                if group.get("momentum", 0) and group.get("dampening", 0) == 0:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                raise errors.NotSupportedError(
                    "init_optimizer_state knows Adam, AdamW and SGD, not %s: register the "
                    "expert state after the optimizer's first step" % type(optimizer).__name__)


class MigrationExecutor:
    """Moves expert weights and their optimizer state when a step's placement changes.

    ``scheduler``: the routepack.Scheduler (or DistributedScheduler) whose steps plan the
    migrations (its config, initial_placement() and set_migration_options() are read). ``group``: the ranks of the migration (plan GPU g = rank g of the group;
    None: the world). Creating the executor is collective over ``group``: it makes a
    private process group (dist.new_group) so migration traffic never mixes with the
    trainer's, and a transport failure cannot leave the trainer's group out of step.
    ``timeout_s`` bounds every wait; ``staging_budget_bytes`` caps the staging memory
    per rank (0: no cap, one round; None: the config's execution.staging_budget_bytes,
    which the memory check counts); the plan splits into rounds of whole layers.
    ``placement``: phy2log [layers, slots] the slots hold when the executor is made
    (default: Scheduler.initial_placement(), where the trainer loads its experts); the
    C executor then tracks each slot's identity and refuses a migration whose starting
    placement differs from what the slots hold. ``torch_checksum``: the expert
    checksums computed with torch ops on the tensors' device (TorchMessenger's; None:
    for CUDA tensors where libroutepack's checksum kernel cannot run; True: also on CPU).

    register(layer, tensors) (or register_slots(layer, slots) for experts that are not
    stacked) for every MoE layer, then sync() (collective-free; tells
    the scheduler the expert bytes and budget for the migrations of later steps). After
    each step: execute(res) on every rank, with the step's result."""

    def __init__(self, scheduler, group=None, *, placement=None, timeout_s=60.0,
                 staging_budget_bytes=None, device=None, torch_checksum=None):
        self.scheduler = scheduler
        # What the slots hold now (the registry's slot identities): by default the
        # placement the scheduler starts from, where the trainer loads its experts.
        self.placement = np.asarray(self.scheduler.initial_placement() if placement is None else placement)
        self.ranks = list(range(dist.get_world_size())) if group is None else \
            dist.get_process_group_ranks(group)
        # Two private groups: messages, and the exchanges that decide each round (which
        # must survive a failed message: see TorchMessenger).
        self.group = self._new_group()
        self.control_group = self._new_group()
        self.messenger = TorchMessenger(self.group, device=device, control_group=self.control_group,
                                        torch_checksum=torch_checksum)
        self.messenger.join()
        self.timeout_s = float(timeout_s)
        # None: the config's execution.staging_budget_bytes (what the memory check counts)
        self.staging_budget_bytes = None if staging_budget_bytes is None else int(staging_budget_bytes)
        self._layers = {}
        self._staging = None   # uint8 staging kept across calls (grown to the largest round)
        self._registry = None
        self._transport = None
        self.last = None

    def _new_group(self):
        return dist.new_group(ranks=self.ranks, use_local_synchronization=True)

    def register(self, layer, tensors):
        """The expert tensors of MoE layer ``layer`` on this rank: a list of contiguous
        tensors [num_slots, ...] (slot s's expert is tensor[s] of each), the same list
        layout on every rank (slot_tensors(params, optimizer) builds it). They are
        borrowed: keep them alive and in place (optimizer.step updates in place)."""
        tensors = list(tensors)
        if not tensors:
            raise errors.InvalidArgumentError("layer %d: no tensors to register" % layer)
        slots = tensors[0].shape[0]
        for i, t in enumerate(tensors):
            if not t.is_contiguous() or t.dim() < 1 or t.shape[0] != slots:
                raise errors.InvalidArgumentError(
                    "layer %d tensor %d: shape %s (contiguous: %s); every tensor must be contiguous "
                    "and slot-major with %d slots" % (layer, i, tuple(t.shape), t.is_contiguous(), slots))
            if t.device != tensors[0].device:
                raise errors.InvalidArgumentError("layer %d: tensors on %s and %s"
                                                  % (layer, tensors[0].device, t.device))
        self._layers[int(layer)] = tensors

    def register_slots(self, layer, slots):
        """The expert tensors of MoE layer ``layer`` on this rank, slot by slot: ``slots[s]``
        is the list of contiguous tensors that make up slot s's expert (the same count,
        sizes and order at every slot, and on every rank), for experts that are not
        stacked slot-major (Megatron-Core's per-expert parameters:
        routepack.adapters.megatron_migration). Borrowed like register()'s."""
        slots = [list(ts) for ts in slots]
        if not slots or not slots[0]:
            raise errors.InvalidArgumentError("layer %d: no tensors to register" % layer)
        shapes = [(t.numel() * t.element_size()) for t in slots[0]]
        for s, ts in enumerate(slots):
            sizes = [t.numel() * t.element_size() for t in ts]
            if sizes != shapes:
                raise errors.InvalidArgumentError("layer %d slot %d: tensors of %s bytes, slot 0's are %s"
                                                  % (layer, s, sizes, shapes))
            for i, t in enumerate(ts):
                if not t.is_contiguous():
                    raise errors.InvalidArgumentError("layer %d slot %d tensor %d is not contiguous"
                                                      % (layer, s, i))
                if t.device != slots[0][0].device:
                    raise errors.InvalidArgumentError("layer %d: tensors on %s and %s"
                                                      % (layer, slots[0][0].device, t.device))
        self._layers[int(layer)] = slots

    def _slots(self, layer):
        """Layer ``layer``'s tensors slot by slot, read now (a stacked parameter's storage
        may have been replaced since it was registered)."""
        ts = self._layers[layer]
        if torch.is_tensor(ts[0]):
            return [[t[s] for t in ts] for s in range(ts[0].shape[0])]
        return ts

    def _build(self):
        """The registry with the tensors' current addresses. It is made once and kept: it
        carries the slots' identities, which the C executor updates as it commits."""
        L = self.scheduler.config.num_layers
        missing = [l for l in range(L) if l not in self._layers]
        if missing:
            raise errors.InvalidArgumentError("MoE layers %s have no registered tensors" % missing)
        slots = len(self._slots(0))
        memory = "cuda" if self._slots(0)[0][0].is_cuda else "host"
        reg = self._registry
        fresh = reg is None or reg.memory != memory or reg.num_slots != slots
        if fresh:
            reg = Registry(L, slots, memory)
        for l in range(L):
            per_slot = self._slots(l)
            if len(per_slot) != slots:
                raise errors.InvalidArgumentError("layer %d has %d slots, layer 0 has %d"
                                                  % (l, len(per_slot), slots))
            for s in range(slots):
                reg.set(l, s, [(t.data_ptr(), t.numel() * t.element_size()) for t in per_slot[s]])
        reg.check()
        if fresh:
            rank = self.messenger.rank
            begin = int(np.concatenate([[0], np.cumsum(self.scheduler.config.slots)])[rank])
            for l in range(L):
                for s in range(slots):
                    reg.set_identity(l, s, int(self.placement[l][begin + s]))
        if self._transport is None or self._transport.memory != memory:
            self._transport = CallbackTransport(self.messenger, self.messenger.rank,
                                                self.messenger.size, memory)
        self._registry = reg
        return reg

    def _staging_at(self, nbytes):
        """Address of ``nbytes`` of staging on the registered tensors' device: one buffer
        kept across calls (the memory check counts staging as held: execution.
        staging_budget_bytes), grown when a migration's largest round needs more."""
        if self._staging is None or self._staging.numel() < nbytes:
            device = self._slots(0)[0][0].device
            self._staging = None
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # payload receives land in it directly (no copy): after a failed call it is
        # dropped, never reused, so a receive abandoned there writes nothing in use
        self.messenger.direct = self._staging
        return self._staging.data_ptr()

    def slot_experts(self, layer):
        """The logical expert each of this rank's slots of ``layer`` holds now (the C
        executor's slot identities; -1: none), list of int."""
        reg = self._registry or self._build()
        return [reg.identity(layer, s)[1] for s in range(reg.num_slots)]

    def expert_bytes(self):
        """Bytes of one expert per layer, as registered (int list)."""
        reg = self._registry or self._build()
        return [reg.expert_bytes(l) for l in range(reg.num_layers)]

    def sync(self):
        """Tell the scheduler the registered expert bytes and the staging budget; the
        migration plans of later steps use them."""
        self.scheduler.set_migration_options(self.expert_bytes(), self.staging_budget_bytes)

    def execute(self, res=None):
        """Run step ``res``'s migration (its StepResult) on every rank: call it on every rank
        of the group after the step, before the step's placement is used and before the
        next step is planned (a later step makes it refuse). Returns the
        routepack.executor.MigrationResult, or None when nothing moves. Raises
        routepack.executor.MigrationFailed, the same on every rank, when a round failed
        (exception in a callback, timeout, checksum mismatch): the rounds before it stay
        committed, the failed round left every rank's tensors intact, and the scheduler
        has reverted its plan for the rest, so the next step plans from the weights as
        they are. ``execute()`` without the result, the former form, runs the scheduler's
        last step's (FutureWarning)."""
        if res is None:
            warnings.warn("MigrationExecutor.execute() runs the scheduler's last step's migration; pass "
                          "the step's result: execute(res)", FutureWarning, stacklevel=2)
            res = self.scheduler.last
            if res is None:
                return None
        if res.migration is not None and res is not self.scheduler.last:
            raise errors.InvalidArgumentError(
                "step %d's migration cannot run now: the scheduler planned step %d since; execute a "
                "step's migration after its step and before the next is planned"
                % (res.step, self.scheduler.last.step))
        if self._transport is not None and not self._transport.usable:
            raise errors.TransportError(
                "an earlier migration left the transport unusable (the ranks could not agree on a "
                "round's outcome, so the weights may differ between ranks): end the job")
        reg = self._build()   # pointers as they are now (state may have been re-created)
        self.messenger.begin_call()
        try:
            self.last = execute(res, reg, self._transport, self.timeout_s, staging=self._staging_at)
        except errors.Error:
            self._staging = self.messenger.direct = None   # an abandoned receive may still write it
            if self._transport.usable:
                # Every rank is here (the outcome was agreed): a message that failed may
                # have closed the message group's connections, so every rank replaces it.
                old, self.group = self.group, self._new_group()
                self.messenger.group = self.group
                self.messenger.join()
                try:
                    dist.destroy_process_group(old)
                except Exception:  # noqa: BLE001 (a broken group may not shut down cleanly)
                    pass
            raise
        return self.last
