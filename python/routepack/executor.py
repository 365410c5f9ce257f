"""Executing a step's expert migration from Python with the C executor
(rp_migration_execute, core/include/routepack/migrate.h) over a callback transport whose
messages and exchanges a Python object moves (routepack.torch passes torch.distributed).

Three pieces, none of which needs torch:

- ``Registry``: per MoE layer and local slot of this rank, the buffers that make up the
  expert held there (weights, optimizer state), as (address, bytes) pairs the caller keeps
  alive (rp_registry).
- ``CallbackTransport``: an rp_transport whose start / wait / finish / allgather call the
  methods of a Python object (the ``Messenger`` protocol below).
- ``execute(res, registry, transport)`` runs step ``res``'s migration plan with them and,
  on failure, tells the scheduler that planned it (rp_sched_migration_failed).

The contract (what a failure leaves behind, staging, rounds) is docs/migration.md."""

from __future__ import annotations

import ctypes
from ctypes import c_void_p

from . import _lib, errors
from ._context import Context, Owned

MEMORY = {"host": 0, "cuda": 1}   # rp_memory
COPY_KINDS = ("device", "to_host", "from_host")   # rp_copy_kind


# The C structs and callback types live in _lib with every other declaration; the names
# stay importable from here.
from ._lib import (ALLGATHER_FN, ALLOC_FN, CHECKSUM_FN, COPY_FN, FINISH_FN, FREE_FN,  # noqa: E402,F401
                   START_FN, WAIT_FN, WAIT_ONE_FN, rp_migration_exec_options, rp_migration_options,
                   rp_migration_result, rp_slot_identity, rp_tensor, rp_transport_callbacks,
                   rp_transport_message)


def lib():
    """The library with the executor's functions declared; LibraryError when it lacks them."""
    return _lib.require_executor()


def execute(res, registry, transport, timeout_s=60.0, ep_group=-1, exchange_timeout_s=0.0, staging=None):
    """Run step ``res``'s migration (a StepResult's; its plan is the scheduler's
    rp_sched_migration) with the C executor on this rank's ``registry`` (Registry) over
    ``transport`` (CallbackTransport): call on every rank of the transport after the step,
    before the step's placement is used and before the next step is planned (a later step
    makes it refuse: InvalidArgumentError). Returns a MigrationResult (None when the step
    moved nothing). Each round is all-or-nothing on every rank; on a failure the scheduler
    is told (rp_sched_migration_failed: the layers of rounds that did not commit go back
    to their old placement in the plan in use, so the next step plans from what the
    weights are) and MigrationFailed is raised, the same on every rank. ``ep_group``: for
    a transport over one EP group, that group. ``timeout_s`` bounds the transfers,
    ``exchange_timeout_s`` the exchanges between ranks (0: ``timeout_s``;
    docs/migration.md, "Deadlines"). ``staging``: None (the executor allocates its staging
    for the call) or a callable that takes the bytes this migration's largest round stages
    on a GPU and returns the address of that much memory of the transport's kind, the
    caller's, kept for the call (a trainer keeps one buffer across steps instead of
    allocating, and faulting in, staging every call)."""
    if res.migration is None:
        return None
    sched = res._scheduler() if res._scheduler is not None else None
    if sched is None:
        raise errors.InvalidArgumentError("step %d's migration cannot run: the scheduler that planned it "
                                          "is gone" % res.step)
    xlib = lib()
    with sched._open_migration(res) as (handle, mp):
        if not mp:
            return None
        opts = rp_migration_exec_options()
        xlib.rp_migration_exec_defaults(ctypes.byref(opts))
        opts.timeout_s = float(timeout_s)
        opts.ep_group = int(ep_group)
        opts.exchange_timeout_s = float(exchange_timeout_s)
        if staging is not None:
            summary = _lib.rp_migration_summary()
            xlib.rp_migration_plan_summary(mp, ctypes.byref(summary))
            if summary.max_staging_bytes > 0:
                opts.staging = staging(int(summary.max_staging_bytes))
                opts.staging_bytes = int(summary.max_staging_bytes)
        raw = rp_migration_result()
        err = _lib.new_error()
        st = xlib.rp_migration_execute(mp, registry.handle, transport.handle, ctypes.byref(opts),
                                       ctypes.byref(raw), ctypes.byref(err))
        if st == errors.OK:
            return MigrationResult(raw)
        text = _lib.text(err.text)
        result = MigrationResult(raw, st, text)
        ferr = _lib.new_error()
        fst = xlib.rp_sched_migration_failed(handle, ctypes.byref(raw), ctypes.byref(ferr))
        if fst != errors.OK:
            text += "; the scheduler could not take the failure back: " + _lib.text(ferr.text)
    raise MigrationFailed(text, st, result)


class Registry:
    """rp_registry: the buffers of every (layer, local slot) of this rank.

    ``set(layer, slot, buffers)``: ``buffers`` is a list of (address, bytes) pairs, the
    same count and sizes at every slot of a layer (weights first, then optimizer state,
    in one fixed order). The memory is borrowed: the caller keeps it alive and in place
    while the registry is used. ``memory``: "host" or "cuda" for every buffer."""

    def __init__(self, num_layers, num_slots, memory="host", ctx=None):
        if memory not in MEMORY:
            raise errors.InvalidArgumentError("memory must be 'host' or 'cuda', got %r" % (memory,))
        self._lib = lib()
        self._ctx = ctx or Context(None)
        self.memory = memory
        self.num_layers, self.num_slots = int(num_layers), int(num_slots)
        handle = c_void_p()
        err = _lib.new_error()
        st = self._lib.rp_registry_new(self._ctx.handle, self.num_layers, self.num_slots,
                                       ctypes.byref(handle), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        self._owned = Owned(handle, self._lib.rp_registry_free, [self._ctx])

    @property
    def handle(self):
        return self._owned.handle

    def set(self, layer, slot, buffers):
        arr = (rp_tensor * max(len(buffers), 1))()
        for i, (addr, nbytes) in enumerate(buffers):
            arr[i] = rp_tensor(c_void_p(int(addr)), int(nbytes), MEMORY[self.memory])
        err = _lib.new_error()
        st = self._lib.rp_registry_set(self.handle, int(layer), int(slot), arr, len(buffers),
                                       ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)

    def set_identity(self, layer, slot, expert, version=0):
        """What (layer, slot) holds: logical ``expert`` of ``layer`` (-1: nothing) at weights
        ``version``. Set once when the weights are loaded; the executor keeps it from then
        on and refuses a migration whose current placement disagrees with it."""
        ident = rp_slot_identity(int(layer), int(expert), int(version) & (2**64 - 1))
        err = _lib.new_error()
        st = self._lib.rp_registry_set_identity(self.handle, int(layer), int(slot), ctypes.byref(ident),
                                                ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)

    def identity(self, layer, slot):
        """(layer, expert, version) that (layer, slot) holds (expert -2: never set)."""
        ident = rp_slot_identity()
        err = _lib.new_error()
        st = self._lib.rp_registry_identity(self.handle, int(layer), int(slot), ctypes.byref(ident),
                                            ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        return ident.layer, ident.expert, ident.version

    def set_version(self, version):
        """Every slot's weights version becomes ``version`` (after an optimizer step)."""
        self._lib.rp_registry_set_version(self.handle, int(version) & (2**64 - 1))

    def expert_bytes(self, layer):
        """Bytes of one expert at `layer` (all its buffers); -1 when nothing is registered."""
        return int(self._lib.rp_registry_expert_bytes(self.handle, int(layer)))

    def check(self):
        """Raise unless every (layer, slot) is registered and no two buffers overlap."""
        err = _lib.new_error()
        st = self._lib.rp_registry_check(self.handle, ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)

    def close(self):
        self._owned.close()


class Message:
    """One point-to-point message the executor asks for: ``peer`` (transport rank),
    ``tag`` (0..32767), ``send`` (True: send ``nbytes`` from ``address``; False: receive
    them into it), ``payload`` (expert bytes rather than a header), ``address`` (memory
    of the transport's kind, valid until finish), ``nbytes``."""

    __slots__ = ("peer", "tag", "send", "payload", "address", "nbytes")

    def __init__(self, m):
        self.peer, self.tag = m.peer, m.tag
        self.send, self.payload = bool(m.send), bool(m.payload)
        self.address, self.nbytes = m.buf, m.bytes

    def __repr__(self):
        return "Message(%s %d bytes %s rank %d, tag %d)" % (
            "send" if self.send else "recv", self.nbytes, "to" if self.send else "from",
            self.peer, self.tag)


class TransportFailure(Exception):
    """Raised by a Messenger method to fail with a status: ``status`` an rp_status
    (errors.ETRANSPORT, errors.ETIMEOUT, ...), ``index`` the message that failed or -1."""

    def __init__(self, message, status=errors.ETRANSPORT, index=-1):
        super().__init__(message)
        self.status, self.index = status, index


def _write_why(buf, size, text):
    data = text.encode("utf-8", "replace")[: max(int(size) - 1, 0)]
    if size:
        ctypes.memmove(buf, data + b"\0", len(data) + 1)


class CallbackTransport:
    """An rp_transport over a Python ``messenger`` with these methods (all ranks call
    them in the same order; see routepack.torch.TorchMessenger):

    - ``start(messages)``: start every Message of a batch without waiting;
    - ``wait(timeout_s)``: until every one completed (raise TransportFailure with
      errors.ETIMEOUT when one is still pending at the deadline);
    - optionally ``wait_one(index, timeout_s)``: until message ``index`` of the batch
      completed (its bytes in place), raising as ``wait`` does; with it, in host memory
      without ``checksum_experts``, the executor commits each received expert as it
      arrives while later ones are still on the way (``wait`` still follows);
    - ``finish()``: forget the batch (completed or abandoned); return False only when a
      receive may still write an executor buffer after it returns;
    - ``allgather(data: bytes, timeout_s) -> bytes``: every rank's equal-sized bytes,
      rank-major;
    - for memory other than host, also ``alloc(nbytes) -> address``, ``free(address)``,
      ``copy(dst, src, nbytes, kind)`` with kind one of COPY_KINDS;
    - optionally ``checksum_experts(experts, timeout_s) -> [int]``, experts a list of
      lists of (address, nbytes) parts in the transport's memory: each expert's
      rp_checksum_expert, computed where the bytes are (the attribute None: not offered).
      Used for CUDA memory where the C kernel cannot run, and for host memory whenever
      offered.

    An exception from a method fails the executor's call with its text (any exception:
    RP_ETRANSPORT; TransportFailure: its status), which the executor turns into a rolled
    back round on every rank. ``rank``/``size``: this rank in the transport."""

    def __init__(self, messenger, rank, size, memory="host", ctx=None):
        self._lib = lib()
        self._ctx = ctx or Context(None)
        self.messenger = messenger
        self.rank, self.size, self.memory = int(rank), int(size), memory
        cb = rp_transport_callbacks()
        # The ctypes function objects must live as long as the transport: kept on self.
        self._fns = [START_FN(self._start), WAIT_FN(self._wait), FINISH_FN(self._finish),
                     ALLGATHER_FN(self._allgather)]
        cb.start, cb.wait, cb.finish, cb.allgather = self._fns
        if memory != "host":
            mem = [ALLOC_FN(self._alloc), FREE_FN(self._free), COPY_FN(self._copy)]
            self._fns += mem
            cb.alloc, cb.free, cb.copy = mem
        cb.max_message_bytes = int(getattr(messenger, "max_message_bytes", 0))
        # CUDA memory: the stream the messenger queues its copies on, where the checksum
        # kernel then runs after them (None: the default stream)
        cb.stream = getattr(messenger, "stream", None) or None
        # The messenger's own expert checksums (routepack.torch: torch ops on the device),
        # where it offers them (checksum_experts not None)
        if getattr(messenger, "checksum_experts", None) is not None:
            fn = CHECKSUM_FN(self._checksum)
            self._fns.append(fn)
            cb.checksum = fn
        # Single-message waits, where the messenger offers them: the executor then commits
        # each expert as it arrives (host memory)
        if getattr(messenger, "wait_one", None) is not None:
            fn = WAIT_ONE_FN(self._wait_one)
            self._fns.append(fn)
            cb.wait_one = fn
        self._cb = cb
        handle = c_void_p()
        err = _lib.new_error()
        st = self._lib.rp_transport_callback_new(self._ctx.handle, ctypes.byref(cb), None,
                                                 self.rank, self.size, MEMORY[memory],
                                                 ctypes.byref(handle), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err)
        self._owned = Owned(handle, self._lib.rp_transport_free, [self._ctx])

    @property
    def handle(self):
        return self._owned.handle

    @property
    def usable(self):
        """False after a failure that left the transport unusable (a failed exchange)."""
        return bool(self._lib.rp_transport_usable(self.handle))

    def close(self):
        self._owned.close()

    # Every callback catches everything: an exception must never unwind through C.
    def _fail(self, exc, why, why_bytes, failed=None):
        status = exc.status if isinstance(exc, TransportFailure) else errors.ETRANSPORT
        if failed is not None and isinstance(exc, TransportFailure):
            failed[0] = exc.index
        text = str(exc) or type(exc).__name__
        if not isinstance(exc, TransportFailure):
            text = "%s: %s" % (type(exc).__name__, text)
        _write_why(why, why_bytes, text)
        return status

    def _start(self, _ud, msgs, n, failed, why, why_bytes):
        try:
            self.messenger.start([Message(msgs[i]) for i in range(n)])
            return errors.OK
        except BaseException as e:  # noqa: BLE001 (reported to C, which reports it back)
            return self._fail(e, why, why_bytes, failed)

    def _wait(self, _ud, timeout_s, failed, why, why_bytes):
        try:
            self.messenger.wait(float(timeout_s))
            return errors.OK
        except BaseException as e:  # noqa: BLE001
            return self._fail(e, why, why_bytes, failed)

    def _wait_one(self, _ud, index, timeout_s, failed, why, why_bytes):
        try:
            self.messenger.wait_one(int(index), float(timeout_s))
            return errors.OK
        except BaseException as e:  # noqa: BLE001
            return self._fail(e, why, why_bytes, failed)

    def _finish(self, _ud):
        try:
            return 1 if self.messenger.finish() is not False else 0
        except BaseException:  # noqa: BLE001 (cannot tell: the buffers may still be written)
            return 0

    def _allgather(self, _ud, mine, out, nbytes, timeout_s, why, why_bytes):
        try:
            data = self.messenger.allgather(ctypes.string_at(mine, nbytes), float(timeout_s))
            if len(data) != nbytes * self.size:
                raise TransportFailure("the exchange returned %d bytes, expected %d ranks x %d"
                                       % (len(data), self.size, nbytes))
            ctypes.memmove(out, data, len(data))
            return errors.OK
        except BaseException as e:  # noqa: BLE001
            return self._fail(e, why, why_bytes)

    def _checksum(self, _ud, part_ptr, part_bytes, part_begin, n, sums, timeout_s, why, why_bytes):
        try:
            experts = [[(part_ptr[p] or 0, int(part_bytes[p])) for p in range(part_begin[i], part_begin[i + 1])]
                       for i in range(n)]
            out = self.messenger.checksum_experts(experts, float(timeout_s))
            if len(out) != n:
                raise TransportFailure("the checksum callback returned %d checksums for %d experts" % (len(out), n))
            for i, v in enumerate(out):
                sums[i] = int(v)
            return errors.OK
        except BaseException as e:  # noqa: BLE001
            return self._fail(e, why, why_bytes)

    def _alloc(self, _ud, nbytes):
        try:
            return self.messenger.alloc(int(nbytes))
        except BaseException:  # noqa: BLE001 (NULL is the C side's "no memory")
            return None

    def _free(self, _ud, address):
        try:
            self.messenger.free(address)
        except BaseException:  # noqa: BLE001
            pass

    def _copy(self, _ud, dst, src, nbytes, kind, timeout_s, why, why_bytes):
        try:
            self.messenger.copy(dst, src, int(nbytes), COPY_KINDS[kind])
            return errors.OK
        except BaseException as e:  # noqa: BLE001
            return self._fail(e, why, why_bytes)


class MigrationResult:
    """What rp_migration_execute did on this rank (rp_migration_result): ``num_rounds``,
    ``rounds_committed`` (rounds before it hold the new placement), ``bytes_sent``,
    ``bytes_received``, ``bytes_local``, ``slots_written``, ``staging_bytes``,
    ``seconds``; on failure (the same on every rank) ``failed_rank``, ``failed_layer``,
    ``failed_expert``, ``failed_peer`` (-1 when unknown), ``status`` and ``error``."""

    def __init__(self, raw, status=errors.OK, error=""):
        for name, _ in rp_migration_result._fields_:
            setattr(self, name, getattr(raw, name))
        self.status, self.error = status, error
        self._raw = raw

    @property
    def ok(self):
        return self.status == errors.OK

    def __repr__(self):
        return ("MigrationResult(rounds_committed=%d/%d, sent=%d, received=%d, %s)"
                % (self.rounds_committed, self.num_rounds, self.bytes_sent, self.bytes_received,
                   "ok" if self.ok else "failed: " + self.error))


class MigrationFailed(errors.Error):
    """A migration that did not complete; ``result`` (a MigrationResult) says which
    rounds committed. The scheduler was told (its plan in use reverted the layers of the
    rounds that did not commit); the cause's class is in ``cause``."""

    def __init__(self, message, status, result):
        super().__init__(message, status)
        self.result = result
        self.cause = errors.class_for_status(status)
