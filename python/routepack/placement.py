"""ExpertPlacement: one MoE layer's placement in one EP group as a step's plan gives it
(StepResult.placement(layer)): the slots' experts, each EP rank's slots and the extra
replicas of each microbatch, with what an executor derives from them (the EP rank and
local index of every physical id, the step's extra replicas, the holders of each
replicated expert). Numpy only; routepack.torch.MoELayer executes it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ExpertPlacement:
    """One MoE layer's placement in one EP group, as a plan gives it (the same on every
    rank of the group).

    ``phy2log``: int [S], the logical expert of each slot (slots EP-rank-major; -1: an
    empty slot, which receives no tokens and is never reduced);
    ``slot_begin``: int [ep_size + 1], EP rank r holds slots slot_begin[r] .. [r+1]-1;
    ``extras``: per microbatch, int [n, 2] rows (expert, ep_rank) of that microbatch's
    extra replicas in plan order (physical id S + i is row i), so rp_remap's physical ids
    index this placement directly. Treat it as immutable: what is derived from it (the
    slots' ranks, the step's extra replicas) is computed once per object."""

    phy2log: np.ndarray
    slot_begin: np.ndarray
    extras: list

    @classmethod
    def from_step(cls, res, layer):
        """The former form of ``res.placement(layer)``."""
        return res.placement(layer)

    @property
    def num_slots(self):
        return int(self.phy2log.shape[0])

    @property
    def ep_size(self):
        return int(self.slot_begin.shape[0] - 1)

    @property
    def num_microbatches(self):
        return max(len(self.extras), 1)

    def local_slots(self, ep_rank):
        return int(self.slot_begin[ep_rank + 1] - self.slot_begin[ep_rank])

    def _memo(self, name, make):
        got = self.__dict__.get(name)
        if got is None:
            got = self.__dict__[name] = make()
        return got.copy()   # each caller its own: the copy is cheap, the making is not

    def slot_rank(self):
        """int64 [S]: the EP rank of each slot."""
        return self._memo("_slot_rank", lambda: (np.searchsorted(self.slot_begin, np.arange(self.num_slots),
                                                                 side="right") - 1).astype(np.int64))

    def microbatch_extras(self, microbatch):
        if not self.extras:
            return np.zeros((0, 2), np.int64)
        return np.asarray(self.extras[microbatch], np.int64).reshape(-1, 2)

    def physical(self, microbatch):
        """(logical expert, EP rank, local index) of every physical id of a microbatch,
        int64 arrays [P]. A rank's local experts are its slots, then its extra replicas
        of the whole step (step_extras order): a microbatch uses some of them."""
        S = self.num_slots
        extras = self.microbatch_extras(microbatch)
        slot_rank = self.slot_rank()
        step = self.step_extras()
        logical = np.concatenate([self.phy2log, extras[:, 0]])
        rank = np.concatenate([slot_rank, extras[:, 1]])
        local = np.concatenate([np.arange(S) - self.slot_begin[slot_rank], np.zeros(len(extras), np.int64)])
        if len(extras):
            # an extra replica's local index: its rank's slots, then its place among that
            # rank's rows of step (sorted by expert, then rank)
            W = self.ep_size
            by_rank = np.argsort(step[:, 1], kind="stable")
            ranks = step[by_rank, 1]
            place = np.empty(len(step), np.int64)
            place[by_rank] = np.arange(len(step)) - np.searchsorted(ranks, ranks, side="left")
            at = np.searchsorted(step[:, 0] * W + step[:, 1], extras[:, 0] * W + extras[:, 1])
            slots = self.slot_begin[1:] - self.slot_begin[:-1]
            local[S:] = slots[extras[:, 1]] + place[at]
        return logical.astype(np.int64), rank.astype(np.int64), local.astype(np.int64)

    def first_replica(self):
        """int64 [E']: the lowest slot holding each logical expert (-1 where none)."""
        E = int(self.phy2log.max()) + 1 if self.num_slots else 0
        first = np.full(max(E, 0), -1, np.int64)
        for s in range(self.num_slots - 1, -1, -1):
            if self.phy2log[s] >= 0:
                first[self.phy2log[s]] = s
        return first

    def step_extras(self):
        """Sorted unique (expert, ep_rank) pairs over every microbatch: the weights that
        have to be fetched for the step."""
        def make():
            rows = [np.asarray(e, np.int64).reshape(-1, 2) for e in self.extras if len(e)]
            return np.unique(np.concatenate(rows), axis=0) if rows else np.zeros((0, 2), np.int64)
        return self._memo("_step_extras", make)

    def replica_holders(self, num_experts):
        """{expert: sorted distinct EP ranks holding a copy} for every expert with more
        than one copy in the step (slots and extra replicas): the experts whose
        gradients are summed over their copies."""
        copies = np.bincount(self.phy2log[self.phy2log >= 0], minlength=num_experts)
        step = self.step_extras()
        copies = copies + np.bincount(step[:, 0], minlength=num_experts) if len(step) else copies
        slot_rank = self.slot_rank()
        out = {}
        for e in np.nonzero(copies > 1)[0]:
            ranks = set(slot_rank[self.phy2log == e].tolist()) | set(step[step[:, 0] == e, 1].tolist())
            out[int(e)] = sorted(ranks)
        return out
