"""Router shift (routepack/shift.h, rp_shift_compute): how many of the replayed routing's
token-choices left the training forward's own top-k for the same tokens, per layer,
(layer, expert) and sequence. A choice (token t, layer l, old entry j) is changed when
its expert is not among the token's new top-k ids at that layer; order within a top-k is
ignored. docs/router-shift.md has the definitions.

    shift = routepack.router_shift(seq_lens, old_routing, new_routing, num_experts=64)
    shift.fraction, shift.layer_fraction, shift.expert_lost_fraction
    sched.attach_shift(old_routing, new_routing)   # into the last step's report/metrics
"""

import ctypes

import numpy as np

from . import _lib, _routing, errors
from ._context import Context
from .trace import _new_batch


class RouterShift:
    """Router-shift counts of one step, copied out of the C library (every array is the
    caller's, int64):

    ``layer_changed`` [L], ``seq_changed`` [S], ``seq_choices`` [S] (len x L x k),
    ``expert_old`` [L, E] (old choices of each expert: the old routing's loads),
    ``expert_lost`` [L, E] (of those, the changed ones), ``expert_arrived`` [L, E] (new
    choices of experts that were not in the token's old top-k); ``choices`` and
    ``changed`` (totals), ``fraction`` (changed / choices, 0 without choices) and
    ``summary`` (the dict the step report's ``router_shift`` holds: the worst layer,
    sequence and (layer, expert) with their fractions)."""

    def __init__(self, lib, handle):
        self.num_seqs = S = lib.rp_shift_num_seqs(handle)
        self.num_layers = L = lib.rp_shift_num_layers(handle)
        self.num_experts = E = lib.rp_shift_num_experts(handle)
        self.top_k = lib.rp_shift_top_k(handle)
        self.choices = int(lib.rp_shift_choices(handle))
        self.changed = int(lib.rp_shift_changed(handle))

        def grab(fn, n, shape):
            return np.ctypeslib.as_array(fn(handle), shape=(n,)).copy().reshape(shape) if n else \
                np.zeros(shape, np.int64)

        self.layer_changed = grab(lib.rp_shift_layer_changed, L, (L,))
        self.seq_changed = grab(lib.rp_shift_seq_changed, S, (S,))
        self.seq_choices = grab(lib.rp_shift_seq_choices, S, (S,))
        self.expert_old = grab(lib.rp_shift_expert_old, L * E, (L, E))
        self.expert_lost = grab(lib.rp_shift_expert_lost, L * E, (L, E))
        self.expert_arrived = grab(lib.rp_shift_expert_arrived, L * E, (L, E))
        m = lib.rp_shift_summarize(handle)
        self.summary = {name: getattr(m, name) for name, _ in m._fields_}
        self.fraction = float(m.fraction)

    @property
    def layer_fraction(self):
        """[L] float64: changed / (tokens x k) per layer (0 without tokens)."""
        per_layer = self.choices // self.num_layers if self.num_layers else 0
        return self.layer_changed / per_layer if per_layer else np.zeros(self.num_layers)

    @property
    def seq_fraction(self):
        """[S] float64: changed / choices per sequence (0 for an empty sequence)."""
        out = np.zeros(self.num_seqs)
        nz = self.seq_choices > 0
        out[nz] = self.seq_changed[nz] / self.seq_choices[nz]
        return out

    @property
    def expert_lost_fraction(self):
        """[L, E] float64: of the old choices of (layer, expert), the share no longer
        chosen (0 where the expert had none)."""
        out = np.zeros(self.expert_old.shape)
        nz = self.expert_old > 0
        out[nz] = self.expert_lost[nz] / self.expert_old[nz]
        return out

    def __repr__(self):
        return ("RouterShift(%d of %d token-choices changed (%.4f), %d sequences, %d layers, %d experts)"
                % (self.changed, self.choices, self.fraction, self.num_seqs, self.num_layers,
                   self.num_experts))


def _need(lib):
    if getattr(lib, "rp_shift_compute", None) is None:
        raise errors.LibraryError("libroutepack at %s has no router shift (rp_shift_compute): rebuild "
                                  "it from a tree with core/shift.c" % _lib.path())


def compute(lib, ctx_handle, lens, old_view, new_view, num_experts, num_threads):
    """rp_shift_compute over a batch of `lens` (a Lengths): (C handle, RouterShift)."""
    _need(lib)
    batch = _new_batch(lib, ctx_handle, lens)
    try:
        out = ctypes.c_void_p()
        err = _lib.new_error()
        st = lib.rp_shift_compute(ctx_handle, batch, old_view.pointer(), new_view.pointer(),
                                  num_experts, num_threads, ctypes.byref(out), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err, cls=errors.RoutingError if st in (errors.EINVAL, errors.ERANGE) else None)
    finally:
        lib.rp_batch_free(batch)
    return out, RouterShift(lib, out)


def views(old_routing, new_routing, seq_lens, cu_seqlens, *, num_layers, top_k, num_experts,
          layout=None, new_layout=None):
    """(Lengths, old RoutingView, new RoutingView): both routings of the same tokens, in any
    form Scheduler.step takes (each in its own form)."""
    lens, old_view = _routing.prepare(old_routing, seq_lens, cu_seqlens, None, num_layers=num_layers,
                                      top_k=top_k, num_experts=num_experts, layout=layout)
    lay, arrays = _routing.normalize(new_routing, new_layout)
    new_view = _routing.view(lay, arrays, num_layers=num_layers, top_k=top_k,
                             num_experts=num_experts, lens=lens)
    return lens, old_view, new_view


def router_shift(seq_lens, old_routing, new_routing, num_experts, *, cu_seqlens=None, layout=None,
                 new_layout=None, num_threads=0):
    """Router shift of one step without a scheduler: ``old_routing`` (the replayed
    routing) and ``new_routing`` (the training forward's top-k ids) of the same tokens, each
    in any form Scheduler.step takes ([tokens, layers, k], per sequence, per layer; numpy
    or CPU tensors), with ``seq_lens`` or ``cu_seqlens`` (None for per-sequence arrays).
    Layers and k come from the arrays. Returns a RouterShift. Raises RoutingError for
    shapes that disagree or an id outside [0, num_experts) (naming which routing, the
    sequence, token, layer and choice)."""
    lib = _lib.load()
    lay, arrays = _routing.normalize(old_routing, layout)
    shape = _routing.shape_of(lay, arrays)
    if shape is None:
        raise errors.RoutingError("cannot tell layers and k from the old routing's arrays", errors.EINVAL)
    num_layers, top_k = shape
    lens, old_view, new_view = views(old_routing, new_routing, seq_lens, cu_seqlens,
                                     num_layers=num_layers, top_k=top_k, num_experts=int(num_experts),
                                     layout=layout, new_layout=new_layout)
    ctx = Context()
    handle, shift = compute(lib, ctx.handle, lens, old_view, new_view, int(num_experts), int(num_threads))
    lib.rp_shift_free(handle)
    ctx.close()
    return shift
