"""routepack.torch.MoELayer as a production dispatcher runs it (issue 29), on gloo ranks:
extra replicas run from a buffer fetched once per step (gradients equal to the per-expert
loop's, and a backward whose allocations stay linear in the slots: the old per-forward
stack of per-slot views allocated a full-size gradient per slot); one device-to-host read
per layer forward and none in backward (counted by a CUDA-free shim: every host read of a
tensor and every op that reads the device on CUDA); de-duplicated dispatch equal to
per-choice dispatch; replica gradients into Megatron's main_grad, exchanged only among
the ranks holding the expert; every rank taking part in every batched point-to-point
call, even with nothing to send."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402
from test_torch_moe import E, _moe_rank  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


# ---- restack-free extras ----

class _AllocatedBytes(TorchDispatchMode):
    """Bytes of every tensor an op returns (what the allocator is asked for), summed."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        views = func.is_view if hasattr(func, "is_view") else False
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not views and t._base is None:
                self.bytes += t.numel() * t.element_size()
        return out


def _extras_rank(rank, world, kernel):
    """One rank, 16 slots and 8 extra replicas of its own experts in microbatch 0: the
    gradients under `kernel` and the bytes the backward allocated, against the weights'."""
    from routepack.torch import ExpertPlacement, MoELayer
    S, d, f, k, T = 16, 32, 16, 2, 64
    g = torch.Generator().manual_seed(5)
    w_in, w_out = torch.randn(S, d, f, generator=g) * 0.2, torch.randn(S, f, d, generator=g) * 0.2
    extras = np.stack([np.arange(0, 16, 2), np.zeros(8, np.int64)], axis=1)
    placement = ExpertPlacement(np.arange(S), np.array([0, S]), [extras])
    layer = MoELayer(d, f, S, k, S, expert_kernel=kernel)
    layer.load_experts(w_in, w_out, placement)
    layer.fetch_replicas(placement)
    x = torch.randn(T, d, generator=g).requires_grad_()
    routing = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    # every even expert's choices alternate between its slot and its extra replica
    physical = routing.clone()
    alt = (routing % 2 == 0) & (torch.arange(T).unsqueeze(1) % 2 == 1)
    physical[alt] = S + routing[alt] // 2
    y = layer(x, routing, physical)
    cot = torch.randn(y.shape, generator=g)
    with _AllocatedBytes() as mode:
        y.backward(cot)
    grads = [x.grad, layer.w_in.grad.clone(), layer.w_out.grad.clone(), layer.extra_w_in.grad, layer.extra_w_out.grad]
    layer.reduce_replica_grads()
    weights = (S + len(extras)) * 2 * d * f * 4
    return dict(grads=[t.detach().numpy().copy() for t in grads],
                summed=[layer.w_in.grad.numpy().copy(), layer.w_out.grad.numpy().copy()], backward_bytes=mode.bytes,
                weight_bytes=weights, rows=T * k, used_extra=bool(alt.any()))


@pytest.mark.parametrize("kernel", ["torch._grouped_mm", "per_expert_loop"])
def test_extra_replicas_backward_is_linear_and_equals_the_loop(kernel):
    from routepack.torch import kernels
    if kernel == kernels.GROUPED and kernels.choose_expert_kernel("cpu", torch.float32, 32, 16, False)[0] != kernel:
        pytest.skip("torch._grouped_mm does not run on this CPU")
    got = torch_world.run(_extras_rank, 1, kernel)[0]
    ref = torch_world.run(_extras_rank, 1, kernels.LOOP)[0]
    assert got["used_extra"]
    for a, b in zip(got["grads"] + got["summed"], ref["grads"] + ref["summed"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Linear in the slots: the weights' gradients (slots + extras) and activation-sized
    # temporaries. Stacking 24 per-slot views allocated 24 full [16, ...] gradients: 16x
    # the weights' bytes.
    activations = got["rows"] * (32 + 16) * 4
    bound = 3 * got["weight_bytes"] + 16 * activations
    assert got["backward_bytes"] <= bound, (got["backward_bytes"], got["weight_bytes"], activations)


# ---- one synchronisation per layer forward, none in backward ----

_SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.unique", "aten._unique", "aten.masked_select",
             "aten.bincount", "aten.equal", "aten.is_nonzero")


class _SyncCounter(TorchDispatchMode):
    """Counts what would make a CUDA host wait, without CUDA: every read of a tensor's
    values on the host (numpy, tolist, item, int/float/bool) and every op whose CUDA
    kernel reads the device (data-dependent sizes, scalars; repeat_interleave without
    output_size)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where = []
        self._saved = {}
        self._inside = False   # a host read counts once, not again for the op under it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        kwargs = kwargs or {}
        if self._inside:
            pass
        elif name in _SYNC_OPS or (name == "aten.repeat_interleave" and kwargs.get("output_size") is None
                                 and isinstance(args[0], torch.Tensor) and args[0].dim() > 0
                                 and len(args) < 2):
            self._hit(name)
        return func(*args, **kwargs)

    def _hit(self, what):
        self.count += 1
        self.where.append(what)

    def __enter__(self):
        for attr in ("numpy", "tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
            orig = getattr(torch.Tensor, attr)
            self._saved[attr] = orig

            def counted(t, *a, _orig=orig, _attr=attr, **kw):
                if self._inside:
                    return _orig(t, *a, **kw)
                self._hit("Tensor." + _attr)
                self._inside = True
                try:
                    return _orig(t, *a, **kw)
                finally:
                    self._inside = False
            setattr(torch.Tensor, attr, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, orig in self._saved.items():
            setattr(torch.Tensor, attr, orig)
        return super().__exit__(*exc)


def _sync_rank(rank, world, dedup):
    from routepack.torch import ExpertPlacement, MoELayer, kernels
    g = torch.Generator().manual_seed(11)
    S, d, f, k, T = 8, 16, 16, 2, 24
    kernels.choose_expert_kernel("cpu", torch.float32, d, f, False)   # once per process, before counting
    layers = [MoELayer(d, f, S, k, S // world + 1, dispatch_dedup=dedup) for _ in range(2)]
    phy2log = np.concatenate([np.arange(S), [0, 1]])   # experts 0 and 1 replicated
    placement = ExpertPlacement(phy2log, np.arange(world + 1) * (S // world + 1),
                                [np.array([[2, 1], [3, 0]]), np.zeros((0, 2), np.int64)])
    for layer in layers:
        layer.load_experts(torch.randn(S, d, f, generator=g), torch.randn(S, f, d, generator=g), placement)
        layer.fetch_replicas(placement)
    counts = []
    for m in range(2):
        x = torch.randn(T, d, generator=g).requires_grad_()
        routing = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
        physical = routing.clone()
        if m == 0:
            physical[routing == 2] = len(phy2log)        # the extra replica of expert 2
            physical[routing == 3] = len(phy2log) + 1
        physical[(routing == 0) & (torch.arange(T).unsqueeze(1) % 2 == 0)] = S   # expert 0's second slot
        with _SyncCounter() as fwd:
            y = x
            for layer in layers:
                y = layer(y, routing, physical, microbatch=m)
        loss = y.square().sum()
        with _SyncCounter() as bwd:
            loss.backward()
        counts.append((fwd.count, fwd.where, bwd.count, bwd.where))
    for layer in layers:
        layer.reduce_replica_grads()
    return counts


@pytest.mark.parametrize("dedup", ["gpu", "choice"])
def test_one_host_sync_per_layer_forward_none_in_backward(dedup):
    for rank_counts in torch_world.run(_sync_rank, 2, dedup):
        for fwd, fwd_where, bwd, bwd_where in rank_counts:
            assert fwd == 2, "2 layers: %d host reads in forward (%s)" % (fwd, fwd_where)
            assert bwd == 0, "%d host reads in backward (%s)" % (bwd, bwd_where)


def test_sync_counter_sees_host_reads():
    """The shim counts what it claims to (a test that cannot fail proves nothing)."""
    t = torch.arange(5)
    with _SyncCounter() as c:
        t.tolist()
        int(t[0])
        t.nonzero()
        torch.bincount(t)
        t.repeat_interleave(t)
        t.repeat_interleave(t, output_size=10)   # not counted: the size is given
    assert c.count == 5, c.where


# ---- de-duplicated dispatch equals per-choice dispatch ----

def _both_modes_rank(rank, world, seed):
    out = {}
    for dedup in ("gpu", "choice"):
        tensors = []
        errs = _moe_rank(rank, world, seed, 3, dedup, None, False, tensors)
        out[dedup] = ([t.detach().numpy().copy() for t in tensors], errs)
    return out


def test_dedup_dispatch_equals_per_choice_dispatch():
    for rank, out in enumerate(torch_world.run(_both_modes_rank, 4, 4)):
        dedup, choice = out["gpu"][0], out["choice"][0]
        assert len(dedup) == len(choice)
        for a, b in zip(dedup, choice):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---- replica gradients into main_grad ----

def test_replica_gradients_reduce_into_main_grad():
    out = torch_world.run(_moe_rank, 4, 2, 3, "gpu", None, True)
    for rank, errs in enumerate(out):
        for key, v in errs.items():
            if key in ("scale", "replicated"):
                continue
            assert v < 1e-5, "rank %d: %s differs from the dense reference by %g" % (rank, key, v)


# ---- every rank in every batched point-to-point call ----

def _p2p_rank(rank, world):
    import torch.distributed as dist
    from routepack.torch import ExpertPlacement, MoELayer, moe
    calls = []
    real = dist.batch_isend_irecv

    def recording(ops):
        calls.append(len(ops))
        return real(ops)
    moe.dist.batch_isend_irecv = recording
    try:
        S, d, f = 4, 8, 8
        # slots 0-3 on rank 0, 4-7 on rank 1, 8-11 / 12-15 empty-ish on ranks 2, 3;
        # expert 0's replicas on ranks 0 and 1 only; one extra replica of expert 1 on rank 1
        phy2log = np.array([0, 1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
        placement = ExpertPlacement(phy2log, np.arange(world + 1) * S, [np.array([[1, 1]])])
        layer = MoELayer(d, f, 15, 2, S)
        g = torch.Generator().manual_seed(1)
        layer.load_experts(torch.randn(15, d, f, generator=g), torch.randn(15, f, d, generator=g), placement)
        layer.fetch_replicas(placement)
        x = torch.randn(6 if rank < 2 else 0, d, generator=g).requires_grad_()
        routing = torch.tensor([[0, 1]] * x.shape[0], dtype=torch.int64).view(-1, 2)
        physical = torch.tensor([[4, 16]] * x.shape[0], dtype=torch.int64).view(-1, 2)
        y = layer(x, routing, physical)
        y.sum().backward() if y.numel() else (y.sum() + sum(p.sum() * 0 for p in layer.parameters())).backward()
        layer.reduce_replica_grads()
        dist.barrier()   # nobody tears its gloo pairs down while a peer still waits on them
        return calls, layer.replica_grad_bytes
    finally:
        moe.dist.batch_isend_irecv = real


def test_every_rank_takes_part_in_every_batched_p2p_call():
    out = torch_world.run(_p2p_rank, 4)
    calls = [c for c, _ in out]
    assert all(len(c) == len(calls[0]) for c in calls), calls   # the same calls on every rank
    assert len(calls[0]) == 2, calls                            # the fetch and the gradient exchange
    assert all(n >= 1 for c in calls for n in c), calls          # nobody with an empty list
    # replica gradients move between the holders of experts 0 and 1 (ranks 0, 1) only:
    # expert 0 both ways (both keep it in a slot), expert 1 from rank 1 (an extra replica,
    # dropped after the step) to rank 0 (its slot) only
    width = 2 * 8 * 8 * 4
    assert out[0][1] == {"sent": width, "received": 2 * width}, out[0][1]
    assert out[1][1] == {"sent": 2 * width, "received": width}, out[1][1]
    assert out[2][1]["sent"] == 0 and out[3][1]["sent"] == 0


# ---- memory: what the layer keeps is what rp_memory_gpu counts ----

_MEMORY_POLICY = """
return {
  name = "two_extras", version = "1.0.0", api = 1, description = "contiguous; extras of rank 0's experts on rank 1",
  plan = function(ctx)
    local packing = {{{}, {}}, {{}, {}}}
    for s = 0, ctx.batch.num_seqs - 1 do table.insert(packing[s % 2 + 1][math.floor(s / 2) % 2 + 1], s) end
    return {packing = packing, placement = {{{0, 1}, {2, 3}}}, num_microbatches = 2,
            extra_replicas = {{microbatch = 0, layer = 0, expert = 0, ep_rank = 1},
                              {microbatch = 0, layer = 0, expert = 1, ep_rank = 1},
                              {microbatch = 1, layer = 0, expert = 0, ep_rank = 1}}}
  end,
}
"""


def _memory_rank(rank, world, policy):
    import routepack
    from routepack.torch import ExpertPlacement, MoELayer, kernels
    d, f, E, k = 16, 64, 4, 2
    cfg = {"topology": {"num_nodes": 1, "gpus_per_node": 2, "ep_size": 2, "slots_per_gpu": 2},
           "model": {"num_layers": 1, "num_experts": E, "top_k": k, "hidden_size": d, "expert_ffn_size": f,
                     "num_heads": 1, "num_kv_heads": 1, "head_dim": 8, "bytes_per_param": 4, "bytes_per_grad": 4},
           "limits": {"max_tokens_per_microbatch": 4096, "num_microbatches": 2}}
    lens = np.full(8, 2, np.int32)   # few tokens: a copy of the weights would outweigh them
    rng = np.random.default_rng(3)
    routing = np.stack([rng.choice(E, k, replace=False) for _ in range(int(lens.sum()))]).astype(np.int32)
    res = routepack.Scheduler(cfg, policy=policy, log_level=None).step(lens, routing.reshape(-1, 1, k))
    assert res.policy_name == "two_extras", res.fallback_reason
    model = res.memory(rank)
    placement = res.placement(0)
    layer = MoELayer(d, f, E, k, 2, gated=True)
    kernels.choose_expert_kernel("cpu", torch.float32, d, f, True)   # its check's tensors are not the layer's
    g = torch.Generator().manual_seed(0)
    layer.load_experts(torch.randn(E, d, 2 * f, generator=g), torch.randn(E, f, d, generator=g), placement)
    layer.fetch_replicas(placement)
    cu = np.concatenate([[0], np.cumsum(lens)])
    own = {t.untyped_storage().data_ptr() for t in (layer.w_in, layer.w_out, layer.extra_w_in, layer.extra_w_out,
                                                    layer.router.weight)}
    in_flight = []
    for m in range(2):
        ids = res.microbatches[rank][m]
        rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in ids])
        phys = torch.as_tensor(res.remap_rank(rank, m, routing[rows].reshape(-1, 1, k)), dtype=torch.int64)[:, 0]
        x = torch.randn(len(rows), d, generator=g).requires_grad_()
        saved = []

        def pack(t):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x, torch.as_tensor(routing[rows], dtype=torch.int64), phys, microbatch=m)
        # what this microbatch keeps for its backward beyond the layer's own tensors
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                    if t.untyped_storage().data_ptr() not in own and t.untyped_storage().data_ptr() != x.data_ptr()}
        in_flight.append((sum(storages.values()), len(rows)))
        y.square().sum().backward()
    layer.reduce_replica_grads()
    expert_bytes = 3 * d * f * 4
    return dict(layer=layer.extra_replica_bytes(), model=model["extra_replica_bytes"],
                count=model["extra_replicas"], held=int(layer.extra_w_in.shape[0]), in_flight=in_flight,
                expert_bytes=expert_bytes)


def test_layer_memory_is_what_the_model_counts(tmp_path):
    policy = tmp_path / "two_extras.lua"
    policy.write_text(_MEMORY_POLICY)
    out = torch_world.run(_memory_rank, 2, str(policy))
    assert out[0]["count"] == 0 and out[0]["layer"] == 0 == out[0]["model"]
    # rank 1 holds experts 0 and 1 as extra replicas in the step (expert 0 in both
    # microbatches counts once): weights and gradients, 3 d f x (4 + 4) bytes each
    assert out[1]["count"] == 2 == out[1]["held"]
    assert out[1]["layer"] == out[1]["model"] == 2 * 2 * out[1]["expert_bytes"]
    for r in out:
        for kept, tokens in r["in_flight"]:
            # what a microbatch keeps for its backward beyond the layer's tensors:
            # activations, at most 4 rows of hidden + 3 ffn width per token-choice (fp32),
            # here less than the 4 experts' weights (2 slots + 2 extras, 48 KiB) that the
            # old per-forward stack kept for every microbatch
            assert kept <= tokens * 2 * 4 * (16 + 3 * 64) * 4 < 4 * r["expert_bytes"], (kept, tokens)
