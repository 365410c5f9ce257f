"""routepack.torch.MigrationExecutor on 4 gloo ranks: expert weights and their Adam state
follow the placement of every step of a re-placing policy, in one round or in several
under a staging budget; an exception injected on one rank fails the migration on every
rank, leaves every byte of the failed rounds as it was, keeps the committed rounds, and
the scheduler plans the next step from the weights as they are."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402

CONFIG = {
    "topology": {"num_nodes": 2, "gpus_per_node": 2, "ep_size": 4, "slots_per_gpu": 3},
    "model": {"num_layers": 3, "num_experts": 9, "top_k": 2, "hidden_size": 64,
              "expert_ffn_size": 32, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16},
    "limits": {"max_tokens_per_microbatch": 4096},
}
L, E, SLOTS = 3, 9, 3


def _step_inputs(step):
    rng = np.random.default_rng(100 + step)
    lens = rng.integers(4, 40, 16).astype(np.int32)
    T = int(lens.sum())
    w = 1.0 / np.arange(1, E + 1) ** (1.5 + step % 2)
    ids = np.empty((T, L, 2), np.int32)
    for l in range(L):
        p = w[rng.permutation(E)]
        g = np.log(p / p.sum())[None, :] + rng.gumbel(size=(T, E))
        ids[:, l, :] = np.argsort(-g, axis=1)[:, :2]
    return lens, ids


def _expert_value(layer, expert, tensor, shape):
    g = torch.Generator().manual_seed(layer * 1000 + expert * 10 + tensor)
    return torch.randn(shape, generator=g)


def _layer_tensors():
    """Two stacked parameters per layer and their Adam state: 6 tensors per slot."""
    params = [[torch.nn.Parameter(torch.zeros(SLOTS, 4, 3)), torch.nn.Parameter(torch.zeros(SLOTS, 7))]
              for _ in range(L)]
    opt = torch.optim.Adam([p for ps in params for p in ps], lr=1e-3)
    return params, opt


def _fill(tensors_by_layer, phy2log, rank):
    with torch.no_grad():
        for l, ts in enumerate(tensors_by_layer):
            for s in range(SLOTS):
                e = int(phy2log[l][rank * SLOTS + s])
                for i, t in enumerate(ts):
                    t[s].copy_(_expert_value(l, e, i, t[s].shape))


def _holds(tensors_by_layer, phy2log, rank, layers):
    """Whether the slots of `layers` hold exactly their placement's experts."""
    for l in layers:
        ts = tensors_by_layer[l]
        for s in range(SLOTS):
            e = int(phy2log[l][rank * SLOTS + s])
            for i, t in enumerate(ts):
                if not torch.equal(t[s], _expert_value(l, e, i, t[s].shape)):
                    return False
    return True


def _executor(rank, messenger_class=None, **options):
    """Weights and Adam state of every layer filled for the scheduler's initial placement,
    the scheduler, and a MigrationExecutor (`options`) with every layer registered, its
    messenger made a `messenger_class` where given, the whole staging in one round:
    (tensors, scheduler, executor, initial placement)."""
    import routepack
    from routepack.torch import MigrationExecutor, init_optimizer_state, slot_tensors
    params, opt = _layer_tensors()
    init_optimizer_state(opt)
    tensors = [slot_tensors(ps, opt) for ps in params]
    sched = routepack.Scheduler(CONFIG, policy="token_kk+eplb")
    phy2log = sched.initial_placement()
    _fill(tensors, phy2log, rank)
    ex = MigrationExecutor(sched, **options)
    if messenger_class is not None:
        ex.messenger.__class__ = messenger_class
    for l in range(L):
        ex.register(l, tensors[l])
    ex.staging_budget_bytes = 0
    ex.sync()
    return tensors, sched, ex, phy2log


def _steps_with_a_fault(rank, tensors, sched, ex, phy2log, fault_step, steps=3):
    """Each step's migration, the messenger armed in `fault_step` (and told the placement
    the weights hold before each step, `before`): per step ("ok", rounds) with every
    expert where the step placed it, or ("failed", whether a checksum mismatch failed it)
    with every byte as before."""
    from routepack.executor import MigrationFailed
    report = []
    for step in range(steps):
        res = sched.step(*_step_inputs(step))
        ex.messenger.armed, ex.messenger.before = step == fault_step, phy2log
        try:
            r = ex.execute(res)
            assert _holds(tensors, res.phy2log, rank, range(L))
            report.append(("ok", r.num_rounds if r else 0))
            phy2log = res.phy2log
        except MigrationFailed as e:
            assert _holds(tensors, phy2log, rank, range(L))   # every byte as before
            report.append(("failed", "checksum mismatch" in str(e)))
    return report


def _migrate_rank(rank, world, budget_layers, fail_step, fail_batch):
    import routepack
    from routepack.executor import MigrationFailed
    from routepack.torch import MigrationExecutor, TorchMessenger, init_optimizer_state, slot_tensors

    class Flaky(TorchMessenger):
        """Raises on rank 2's `fail_batch`-th batch of expert bytes of step `fail_step`."""
        armed, batches = False, 0

        def start(self, messages):
            if self.armed and any(m.payload for m in messages):
                self.batches += 1
                if self.batches == fail_batch + 1:
                    self.armed = False
                    raise RuntimeError("injected: the link to rank %d went down" % messages[0].peer)
            super().start(messages)

    params, opt = _layer_tensors()
    init_optimizer_state(opt)
    tensors = [slot_tensors(ps, opt) for ps in params]
    assert all(len(ts) == 6 for ts in tensors)   # 2 weights + exp_avg, exp_avg_sq of each
    sched = routepack.Scheduler(CONFIG, policy="token_kk+eplb")
    phy2log = sched.initial_placement()   # where the first migration starts
    _fill(tensors, phy2log, rank)
    ex = MigrationExecutor(sched, timeout_s=2.0)
    if rank == 2:
        ex.messenger.__class__ = Flaky
    for l in range(L):
        ex.register(l, tensors[l])
    per_layer = ex.expert_bytes()[0] * SLOTS
    ex.staging_budget_bytes = budget_layers * per_layer
    ex.sync()
    report = []
    for step in range(4):
        res = sched.step(*_step_inputs(step))
        if rank == 2 and step == fail_step:
            ex.messenger.armed = True
        try:
            r = ex.execute(res)
            assert _holds(tensors, res.phy2log, rank, range(L))
            report.append(("ok", r.rounds_committed if r else 0, r.num_rounds if r else 0))
            phy2log = res.phy2log
        except MigrationFailed as e:
            committed = e.result.rounds_committed
            done = [l for l in range(L) if 0 <= res.migration.layer_round[l] < committed]
            rest = [l for l in range(L) if l not in done]
            assert _holds(tensors, res.phy2log, rank, done)
            assert _holds(tensors, phy2log, rank, rest)   # every byte as before
            assert "injected: the link to rank" in str(e) and "rank 2" in str(e)
            report.append(("failed", committed, e.result.num_rounds, str(e)))
            new = np.array(res.phy2log)
            for l in rest:
                new[l] = phy2log[l]
            phy2log = new
    sched.close()
    return report


@pytest.mark.parametrize("budget_layers,fail_batch", [(0, 0), (1, 1)])
def test_weights_and_adam_state_follow_the_placement_and_a_failure_rolls_back(budget_layers, fail_batch):
    out = torch_world.run(_migrate_rank, 4, budget_layers, 1, fail_batch)
    for rank_report in out[1:]:
        assert [r[:3] for r in rank_report] == [r[:3] for r in out[0]]   # every rank alike
    kinds = [r[0] for r in out[0]]
    assert kinds == ["ok", "failed", "ok", "ok"], out[0]
    assert len(set(r[3] for r in (rep[1] for rep in out))) == 1   # the same error text
    moved = [r for r in out[0] if r[0] == "ok" and r[2] > 0]
    assert moved, "the policy moved nothing"
    if budget_layers:
        assert max(r[2] for r in out[0]) > 1   # several rounds
        assert out[0][1][1] >= 1              # the failure came after a committed round


def _join_rank(rank, world):
    import routepack
    import torch.distributed as dist
    from routepack.torch import MigrationExecutor
    calls = []
    real = dist.batch_isend_irecv

    def recording(ops):
        calls.append(sorted((op.op.__name__, op.peer, op.tensor.numel()) for op in ops))
        return real(ops)
    dist.batch_isend_irecv = recording
    try:
        MigrationExecutor(routepack.Scheduler(CONFIG, policy="token_kk+eplb"), timeout_s=5.0)
    finally:
        dist.batch_isend_irecv = real
    dist.barrier()
    return calls


def test_every_rank_joins_the_message_group_first():
    """NCCL requires every rank of a group in its first batched point-to-point call; the
    executor's batches involve only ranks that move something, so making the executor
    joins every rank first with a zero-element ring exchange (no tags anywhere)."""
    out = torch_world.run(_join_rank, 4)
    for rank, calls in enumerate(out):
        assert calls == [sorted([("irecv", (rank - 1) % 4, 0), ("isend", (rank + 1) % 4, 0)])], (rank, calls)


def _torch_checksum_rank(rank, world, corrupt_step):
    from routepack.torch import TorchMessenger
    from routepack.torch.messenger import bytes_at

    class Corrupting(TorchMessenger):
        """Flips a byte of the first expert received in step `corrupt_step`, after it
        arrived and before the executor checks it."""
        armed = False

        def wait(self, timeout_s):
            super().wait(timeout_s)
            if self.armed:
                for m, _work, _buf, _direct, _done in self._batch:
                    if not m.send and m.payload:
                        b = bytes_at(m.address, m.nbytes, self.device)
                        b[m.nbytes // 2] ^= 0xFF
                        self.armed = False
                        break

    tensors, sched, ex, phy2log = _executor(rank, Corrupting, timeout_s=5.0, torch_checksum=True)
    report = _steps_with_a_fault(rank, tensors, sched, ex, phy2log, corrupt_step)
    calls = ex.messenger.checksum_calls
    sched.close()
    return report, calls


def test_migration_with_torch_op_checksums_on_cpu():
    """The device checksum path (routepack.torch.checksum: torch ops, no host copy) run on
    CPU tensors: every expert checksum of the executor goes through it (source, and the
    written slots), a migration moves weights and Adam state, and a byte flipped in
    staging fails the round on every rank with every weight as before."""
    out = torch_world.run(_torch_checksum_rank, 4, 1)
    reports = [o[0] for o in out]
    assert all(r == reports[0] for r in reports), reports
    assert reports[0][0][0] == "ok" and reports[0][0][1] > 0, reports[0]   # step 0 moved experts
    assert reports[0][1] == ("failed", True), reports[0]
    assert reports[0][2][0] == "ok", reports[0]
    assert all(o[1] >= 2 for o in out), [o[1] for o in out]   # source, written slots: per round


def _post_order_rank(rank, world):
    import torch.distributed as dist
    tensors, sched, ex, _ = _executor(rank, timeout_s=5.0)
    batches, real = [], dist.batch_isend_irecv

    def recording(ops):
        batches.append([op.op.__name__ for op in ops])
        return real(ops)
    dist.batch_isend_irecv = recording
    try:
        for step in range(3):
            res = sched.step(*_step_inputs(step))
            ex.execute(res)
            assert _holds(tensors, res.phy2log, rank, range(L))
    finally:
        dist.batch_isend_irecv = real
    sched.close()
    return batches


def test_sends_are_posted_before_receives():
    """On gloo a send posted after the peer's receive is written on the posting thread
    under the connection's lock while gloo's loop thread spins on that lock (on a shared
    core it takes the writer's time): TorchMessenger posts every batch's sends first,
    whatever the executor's order, and the experts still land where they belong."""
    out = torch_world.run(_post_order_rank, 4)
    assert any(b for rank in out for b in rank), out
    for batches in out:
        for b in batches:
            assert b == sorted(b, key=lambda name: name != "isend"), b
    assert any("isend" in b and "irecv" in b for rank in out for b in rank), out


def _late_corrupt_rank(rank, world, corrupt_step):
    from routepack.torch import TorchMessenger
    from routepack.torch.messenger import bytes_at

    class LateCorrupt(TorchMessenger):
        """Counts single-message waits; in step `corrupt_step` flips a byte of the last
        expert message of the batch once it arrived, when the executor has already
        committed the ones before it (counted: layers no longer as `before`)."""
        armed, single, written_before = False, 0, 0

        def wait_one(self, index, timeout_s):
            super().wait_one(index, timeout_s)
            self.single += 1
            last = max((i for i, e in enumerate(self._batch) if not e[0].send and e[0].payload), default=-1)
            if self.armed and index == last:
                self.armed = False
                self.written_before = sum(not _holds(tensors, self.before, rank, [l]) for l in range(L))
                m = self._batch[index][0]
                b = bytes_at(m.address, m.nbytes, self.device)
                b[m.nbytes // 2] ^= 0xFF

    tensors, sched, ex, phy2log = _executor(rank, LateCorrupt, timeout_s=5.0)
    report = _steps_with_a_fault(rank, tensors, sched, ex, phy2log, corrupt_step)
    sched.close()
    return report, ex.messenger.single, ex.messenger.written_before


def test_each_expert_commits_as_it_arrives_and_a_late_failure_rolls_back():
    """Host memory over gloo: the executor waits for each message (TorchMessenger.wait_one)
    and commits each expert as it arrives; a byte flipped in the last expert message of a
    rank's batch, after the experts before it were written into their slots, fails the
    round on every rank with every weight as before, and the next step moves again."""
    out = torch_world.run(_late_corrupt_rank, 4, 1)
    reports = [o[0] for o in out]
    assert all(r == reports[0] for r in reports), reports
    assert reports[0][0][0] == "ok" and reports[0][0][1] > 0, reports[0]
    assert reports[0][1] == ("failed", True), reports[0]
    assert reports[0][2][0] == "ok", reports[0]
    assert all(o[1] > 0 for o in out), [o[1] for o in out]   # single-message waits
    assert any(o[2] > 0 for o in out), [o[2] for o in out]   # a layer written before the last arrived


def test_torch_checksum_equals_the_c_checksum():
    """routepack.torch.checksum.checksum_experts against rp_checksum_expert (the C
    reference of routepack/checksum.h) on CPU tensors: lengths around every branch of
    XXH64 (under 4, 8 and 32 bytes, whole and partial 4 KiB blocks, under and over 4 block
    hashes), experts of several parts whose blocks span parts, an empty expert, and the
    same sums when the experts are split into several device batches."""
    import ctypes

    from routepack import _lib
    from routepack.torch.checksum import checksum_experts

    fn = _lib.load().rp_checksum_expert
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_int32]

    def c_sum(parts):
        n = max(len(parts), 1)
        ptrs = (ctypes.c_void_p * n)(*[p.data_ptr() for p in parts])
        sizes = (ctypes.c_size_t * n)(*[p.numel() * p.element_size() for p in parts])
        return fn(ptrs, sizes, len(parts))

    g = torch.Generator().manual_seed(7)
    experts = [[torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
               for sizes in ([0], [1], [3], [4], [7], [8], [31], [32], [33], [100], [4095], [4096],
                             [4097], [3 * 4096], [4 * 4096], [5 * 4096 + 13], [17 * 4096 + 40],
                             [1000, 5000, 3], [4096 * 3, 4096], [1 << 20])]
    experts.append([torch.randn(64, 33, generator=g), torch.randn(7, generator=g).double()])
    want = [c_sum(e) for e in experts]
    assert checksum_experts(experts) == want
    assert checksum_experts(experts, batch_bytes=5000) == want
    assert want[0] == 0xEF46DB3751D8E999   # no bytes: XXH64 of nothing


def _step_result_rank(rank, world):
    """execute(res) with the step's result; an older step's result after a later step is
    refused on every rank before anything moves; the former execute() (the scheduler's
    last step's) still runs, with a FutureWarning."""
    import warnings

    import routepack
    tensors, sched, ex, _ = _executor(rank, timeout_s=5.0)
    out = {}
    r0 = sched.step(*_step_inputs(0))
    ex.execute(r0)
    r1 = sched.step(*_step_inputs(1))
    try:
        ex.execute(r0)
    except routepack.InvalidArgumentError as e:
        out["stale"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex.execute()
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    out["holds"] = _holds(tensors, r1.phy2log, rank, range(L)) and r0.migration is not None \
        and r1.migration is not None
    sched.close()
    return out


def test_a_step_result_carries_its_migration():
    for out in torch_world.run(_step_result_rank, 4):
        assert "step 0's migration cannot run now: the scheduler planned step 1 since" in out["stale"]
        assert len(out["warned"]) == 1 and "execute(res)" in out["warned"][0]
        assert out["holds"]
