"""routepack.torch.MoELayer on 4 gloo ranks against a dense single-process reference: under
random placements (with replicas), random per-choice replica choices (what shares decide)
and extra replicas, the output, the input gradient, the router gradient and every
replica's expert gradient (after reduce_replica_grads) equal the reference's; a rank with
no tokens in a microbatch still takes part. Also the packing helper."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402

HID, FFN, E, K = 8, 6, 6, 2


def _data(world, seed, slots_per_rank, microbatches=2):
    """Everything every rank needs, the same on every rank: logical weights, a placement
    with replicas, extra replicas per microbatch, tokens, routing and physical ids."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    S = world * slots_per_rank
    phy2log = np.concatenate([rng.permutation(E), rng.integers(0, E, S - E)])
    rng.shuffle(phy2log)
    slot_begin = np.arange(world + 1) * slots_per_rank
    extras = []
    for m in range(microbatches):
        n = int(rng.integers(1, 4))
        rows = np.stack([rng.integers(0, E, n), rng.integers(0, world, n)], axis=1)
        rows = np.unique(rows, axis=0)
        extras.append(rows[np.argsort(rows[:, 0], kind="stable")])
    tokens = [[0 if (r == 1 and m == 0) else int(rng.integers(3, 12)) for m in range(microbatches)]
              for r in range(world)]
    w_in = torch.randn(E, HID, FFN, generator=g) * 0.3
    w_out = torch.randn(E, FFN, HID, generator=g) * 0.3
    router = torch.randn(E, HID, generator=g) * 0.5
    x, routing, physical, cot = {}, {}, {}, {}
    for r in range(world):
        for m in range(microbatches):
            T = tokens[r][m]
            x[r, m] = torch.randn(T, HID, generator=g)
            cot[r, m] = torch.randn(T, HID, generator=g)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) if T else np.zeros((0, K), np.int64)
            routing[r, m] = torch.as_tensor(ids, dtype=torch.int64)
            # every choice picks one of the expert's candidates: its slots and this
            # microbatch's extra replicas (physical id S + row)
            phys = np.zeros_like(ids)
            for t in range(T):
                for j in range(K):
                    e = ids[t, j]
                    cand = list(np.nonzero(phy2log == e)[0]) + [S + i for i in np.nonzero(extras[m][:, 0] == e)[0]]
                    phys[t, j] = rng.choice(cand)
            physical[r, m] = torch.as_tensor(phys, dtype=torch.int64)
    return dict(phy2log=phy2log, slot_begin=slot_begin, extras=extras, w_in=w_in, w_out=w_out,
                router=router, x=x, routing=routing, physical=physical, cot=cot, M=microbatches)


def _reference(d, world):
    """Dense: every token-choice through its logical expert, one process."""
    w_in = d["w_in"].clone().requires_grad_()
    w_out = d["w_out"].clone().requires_grad_()
    router = [d["router"].clone().requires_grad_() for _ in range(world)]
    ys, xs = {}, {}
    loss = 0.0
    for (r, m), x in d["x"].items():
        x = x.clone().requires_grad_()
        xs[r, m] = x
        probs = torch.softmax((x @ router[r].T).float(), -1)
        ids = d["routing"][r, m]
        g = probs.gather(1, ids)
        g = g / g.sum(-1, keepdim=True)
        h = torch.nn.functional.silu(torch.einsum("td,tkdf->tkf", x, w_in[ids]))
        y = (torch.einsum("tkf,tkfh->tkh", h, w_out[ids]) * g.unsqueeze(-1)).sum(1)
        ys[r, m] = y
        loss = loss + (y * d["cot"][r, m]).sum()
    loss.backward()
    return ys, xs, w_in.grad, w_out.grad, [p.grad for p in router]


def _moe_rank(rank, world, seed, slots_per_rank, dedup="gpu", kernel=None, main_grad=False, outputs=None):
    """The layer on this rank against the dense reference: errors by name. ``main_grad``:
    the expert gradients kept as Megatron DDP keeps them (a post-accumulate hook adds
    .grad into main_grad and drops it). ``outputs``: a list that receives the outputs
    and gradients, for comparing two runs."""
    from routepack.torch import ExpertPlacement, MoELayer
    d = _data(world, seed, slots_per_rank)
    ref_y, ref_x, ref_gin, ref_gout, ref_router = _reference(d, world)
    placement = ExpertPlacement(d["phy2log"], d["slot_begin"], d["extras"])
    layer = MoELayer(HID, FFN, E, K, slots_per_rank, dispatch_dedup=dedup, expert_kernel=kernel)
    layer.load_experts(d["w_in"], d["w_out"], placement)
    with torch.no_grad():
        layer.router.weight.copy_(d["router"])
    if main_grad:
        for p in (layer.w_in, layer.w_out):
            p.main_grad = torch.zeros_like(p)

            def into_main(p):
                p.main_grad += p.grad
                p.grad = None
            p.register_post_accumulate_grad_hook(into_main)
    layer.fetch_replicas(placement)
    errs = {}
    for m in range(d["M"]):
        x = d["x"][rank, m].clone().requires_grad_()
        y = layer(x, d["routing"][rank, m], d["physical"][rank, m], microbatch=m)
        (y * d["cot"][rank, m]).sum().backward()
        errs["y%d" % m] = (y - ref_y[rank, m]).abs().max().item() if y.numel() else 0.0
        errs["x%d" % m] = (x.grad - ref_x[rank, m].grad).abs().max().item() if y.numel() else 0.0
        assert y.shape == ref_y[rank, m].shape
        if outputs is not None:
            outputs += [y.detach(), x.grad]
    # the exchange started when the last microbatch's backward of the layer ended
    errs["exchange not started"] = float(layer._grad_exchange is None)
    layer.reduce_replica_grads()
    b = int(d["slot_begin"][rank])
    mine = d["phy2log"][b:b + slots_per_rank]
    g_in, g_out = (layer.w_in.main_grad, layer.w_out.main_grad) if main_grad else (layer.w_in.grad, layer.w_out.grad)
    if main_grad:
        assert layer.w_in.grad is None and layer.w_out.grad is None
    if outputs is not None:
        outputs += [g_in, g_out, layer.router.weight.grad]
    errs["w_in"] = (g_in - ref_gin[mine]).abs().max().item()
    errs["w_out"] = (g_out - ref_gout[mine]).abs().max().item()
    errs["router"] = (layer.router.weight.grad - ref_router[rank]).abs().max().item()
    errs["scale"] = max(ref_gin.abs().max().item(), ref_gout.abs().max().item())
    errs["replicated"] = int(len(mine) - len(set(mine.tolist())) + len(placement.step_extras()))
    # the logical experts gathered back are the ones loaded
    g_in, g_out = layer.gather_experts(placement)
    errs["gather"] = max((g_in - d["w_in"]).abs().max().item(), (g_out - d["w_out"]).abs().max().item())
    return errs


@pytest.mark.parametrize("seed,dedup", [(1, "gpu"), (2, "gpu"), (3, "gpu"), (1, "choice"), (2, "choice")])
def test_moe_layer_equals_dense_reference(seed, dedup):
    out = torch_world.run(_moe_rank, 4, seed, 3, dedup)
    for rank, errs in enumerate(out):
        for key, v in errs.items():
            if key in ("scale", "replicated"):
                continue
            assert v < 1e-5, "rank %d: %s differs from the dense reference by %g" % (rank, key, v)
    assert sum(e["replicated"] for e in out) > 0   # the placements do replicate


def test_without_replicas_forward_is_the_same():
    """Sanity of the reference itself: one slot per expert on 2 ranks, no extras."""
    out = torch_world.run(_plain_rank, 2)
    assert all(v < 1e-5 for errs in out for v in errs.values())


def _plain_rank(rank, world):
    from routepack.torch import ExpertPlacement, MoELayer
    g = torch.Generator().manual_seed(7)
    w_in, w_out = torch.randn(4, HID, FFN, generator=g), torch.randn(4, FFN, HID, generator=g)
    placement = ExpertPlacement(np.array([2, 0, 3, 1]), np.array([0, 2, 4]), [np.zeros((0, 2), np.int64)])
    layer = MoELayer(HID, FFN, 4, K, 2)
    layer.load_experts(w_in, w_out, placement)
    layer.fetch_replicas(placement)
    x = torch.randn(5, HID, generator=torch.Generator().manual_seed(rank))
    routing = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [0, 3]])
    y = layer(x, routing)
    probs = torch.softmax(x @ layer.router.weight.detach().T, -1)
    gsel = probs.gather(1, routing)
    gsel = gsel / gsel.sum(-1, keepdim=True)
    ref = sum(gsel[:, j:j + 1] * (torch.nn.functional.silu(torch.einsum("td,tdf->tf", x, w_in[routing[:, j]]))
                                  .unsqueeze(1) @ w_out[routing[:, j]]).squeeze(1) for j in range(K))
    return {"y": (y - ref).abs().max().item()}


def _pack_rank(rank, world, seed):
    from routepack.torch import pack_microbatches
    rng = np.random.default_rng(seed)
    S, M = 11, 3
    lens = rng.integers(0, 7, S)
    owner = rng.integers(0, world, S)
    perm = rng.permutation(S)
    plan = [[[] for _ in range(M)] for _ in range(world)]
    for i, s in enumerate(perm):
        plan[int(rng.integers(0, world))][int(rng.integers(0, M))].append(int(s))
    plan = [[np.array(mb, dtype=np.int32) for mb in row] for row in plan]
    # global data: token ids seq*100 + position; routing [T, 2, 3]
    data = {s: torch.arange(lens[s]) + 100 * s for s in range(S)}
    mine = [s for s in rng.permutation(S) if owner[s] == rank]   # any local order
    local = torch.cat([data[s] for s in mine]) if mine else torch.zeros(0, dtype=torch.int64)
    route = local.view(-1, 1, 1).repeat(1, 2, 3).to(torch.int32)
    packed = pack_microbatches(plan, owner, lens, mine, {"tokens": local, "routing": route})
    assert len(packed) == M and [pm.microbatch for pm in packed] == list(range(M))
    # in a plan's run order (pipeline parallelism): the same micro-batches, reordered
    order = [list(np.roll(np.arange(M), g + 1)) for g in range(world)]
    ordered = pack_microbatches(plan, owner, lens, mine, {"tokens": local, "routing": route}, order=order)
    assert [pm.microbatch for pm in ordered] == order[rank]
    for k, pm in enumerate(ordered):
        assert torch.equal(pm["tokens"], packed[order[rank][k]]["tokens"]), (rank, k)
    with pytest.raises(ValueError, match="not a permutation"):
        pack_microbatches(plan, owner, lens, mine, {"tokens": local, "routing": route}, order=[[0] * M] * world)
    for m, pm in enumerate(packed):
        ids = plan[rank][m]
        want = torch.cat([data[s] for s in ids]) if len(ids) else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(pm["tokens"], want), (rank, m)
        assert torch.equal(pm["routing"], want.view(-1, 1, 1).repeat(1, 2, 3).to(torch.int32))
        assert pm.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lens[ids])]).tolist()
        assert list(pm.seq_ids) == list(ids)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_pack_microbatches_fetches_each_sequence_from_its_owner(world):
    assert all(torch_world.run(_pack_rank, world, 5 + world))
