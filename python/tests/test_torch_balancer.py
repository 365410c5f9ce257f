"""RoutePack's plan feeding a trainer that balances every forward itself (Megatron-Core's
virtual experts): routepack.torch.VirtualExpertBalancer, a stand-in with the balancer's
contract, on 4 gloo ranks over the evenly owned placement RoutePack's plans keep. Per
microbatch and layer it plans from the exchanged histograms, pushes the virtual experts
(MoELayer.fetch_replicas) and reduces their gradients back (reduce_replica_grads); the
output, input and expert gradients equal a dense single-process reference, and every rank
computes the group's mean load. Also the offload plan through the Python binding."""

import numpy as np
import pytest

import routepack.virtual_experts as vx

HID, FFN, E, K = 8, 6, 8, 2


def test_plan_forward_by_hand():
    # every rank routes its 10 choices to expert 0 (rank 0's): ranks 1-3 each take 10 in
    # a virtual slot, and every choice is computed where it was routed (docs/baselines.md)
    counts = np.zeros((4, 8), np.int32)
    counts[:, 0] = 10
    p = vx.plan_forward(counts)
    assert p.rank_load.tolist() == [10, 10, 10, 10]
    assert p.allocation[0].tolist() == [10, 10, 10, 10]
    assert p.slot_expert.tolist() == [[-1, -1], [0, -1], [0, -1], [0, -1]]
    assert p.num_virtual == 3 and p.pushes_out.tolist() == [3, 0, 0, 0]
    assert (p.traffic == np.diag([10, 10, 10, 10])).all()


def test_plan_forward_refuses_uneven_ownership():
    from routepack import errors
    with pytest.raises(errors.InvalidArgumentError, match="EP rank 0 owns more than 2 experts"):
        vx.plan_forward(np.ones((2, 4), np.int32), owner=[0, 0, 0, 1])
    with pytest.raises(errors.InvalidArgumentError, match="ep_size is 1"):
        vx.plan_forward(np.ones((1, 4), np.int32))


torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402


def _data(world, seed, microbatches=2):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    w_in = torch.randn(E, HID, FFN, generator=g) * 0.3
    w_out = torch.randn(E, FFN, HID, generator=g) * 0.3
    router = torch.randn(E, HID, generator=g) * 0.5
    x, routing, cot = {}, {}, {}
    for r in range(world):
        for m in range(microbatches):
            T = 0 if (r == 2 and m == 1) else int(rng.integers(3, 14))   # unequal counts, one empty
            x[r, m] = torch.randn(T, HID, generator=g)
            cot[r, m] = torch.randn(T, HID, generator=g)
            ids = []
            for _ in range(T):   # expert 0 is hot: rank 0 is overloaded
                first = 0 if rng.random() < 0.6 else int(rng.integers(0, E))
                second = int(rng.choice([e for e in range(E) if e != first]))
                ids.append([first, second])
            routing[r, m] = torch.as_tensor(np.array(ids, np.int64).reshape(T, K))
    return dict(w_in=w_in, w_out=w_out, router=router, x=x, routing=routing, cot=cot, M=microbatches)


def _reference(d, world):
    w_in = d["w_in"].clone().requires_grad_()
    w_out = d["w_out"].clone().requires_grad_()
    router = [d["router"].clone().requires_grad_() for _ in range(world)]
    ys, xs, loss = {}, {}, 0.0
    for (r, m), x in d["x"].items():
        x = x.clone().requires_grad_()
        xs[r, m] = x
        probs = torch.softmax((x @ router[r].T).float(), -1)
        ids = d["routing"][r, m]
        gate = probs.gather(1, ids)
        gate = gate / gate.sum(-1, keepdim=True)
        h = torch.nn.functional.silu(torch.einsum("td,tkdf->tkf", x, w_in[ids]))
        y = (torch.einsum("tkf,tkfh->tkh", h, w_out[ids]) * gate.unsqueeze(-1)).sum(1)
        ys[r, m] = y
        loss = loss + (y * d["cot"][r, m]).sum()
    loss.backward()
    return ys, xs, w_in.grad, w_out.grad


def _balanced_layer(d, world):
    """What a RoutePack plan with per_forward_balancing holds (every expert once,
    contiguous), a layer loaded with it and the balancer over it."""
    from routepack.torch import ExpertPlacement, MoELayer, VirtualExpertBalancer
    base = ExpertPlacement(np.arange(E), np.arange(world + 1) * (E // world), [np.zeros((0, 2), np.int64)])
    layer = MoELayer(HID, FFN, E, K, E // world)
    layer.load_experts(d["w_in"], d["w_out"], base)
    with torch.no_grad():
        layer.router.weight.copy_(d["router"])
    return base, layer, VirtualExpertBalancer(E, base)


def _balanced_rank(rank, world, seed):
    import torch.distributed as dist
    d = _data(world, seed)
    ref_y, ref_x, ref_gin, ref_gout = _reference(d, world)
    per_rank = E // world
    _, layer, balancer = _balanced_layer(d, world)
    errs = {"virtual": 0, "load": 0}
    for m in range(d["M"]):
        x = d["x"][rank, m].clone().requires_grad_()
        placement, physical, plan = balancer.plan(d["routing"][rank, m])   # histograms exchanged
        layer.fetch_replicas(placement)                                      # the push
        y = layer(x, d["routing"][rank, m], physical, microbatch=0)
        (y * d["cot"][rank, m]).sum().backward()
        layer.reduce_replica_grads()                                        # gradients back to owners
        errs["virtual"] += plan.num_virtual
        # the rows each rank computed: every rank's choices by destination, summed
        _, dest, _ = placement.physical(0)
        computed = torch.bincount(torch.as_tensor(dest)[physical.reshape(-1)], minlength=world)
        dist.all_reduce(computed)
        errs["load"] += int((computed.numpy() != plan.rank_load).sum())
        errs["y%d" % m] = (y - ref_y[rank, m]).abs().max().item() if y.numel() else 0.0
        errs["x%d" % m] = (x.grad - ref_x[rank, m].grad).abs().max().item() if y.numel() else 0.0
    mine = np.arange(rank * per_rank, (rank + 1) * per_rank)
    errs["w_in"] = (layer.w_in.grad - ref_gin[mine]).abs().max().item()
    errs["w_out"] = (layer.w_out.grad - ref_gout[mine]).abs().max().item()
    return errs


@pytest.mark.parametrize("seed", [1, 2])
def test_balanced_forward_equals_dense_reference(seed):
    out = torch_world.run(_balanced_rank, 4, seed)
    for rank, errs in enumerate(out):
        assert errs["load"] == 0, "rank %d: a rank did not compute the plan's load" % rank
        for key, v in errs.items():
            if key not in ("virtual", "load"):
                assert v < 1e-5, "rank %d: %s differs from the dense reference by %g" % (rank, key, v)
    assert out[0]["virtual"] > 0   # the balancer did offload


def _uneven_rank(rank, world):
    from routepack.torch import ExpertPlacement, VirtualExpertBalancer
    placement = ExpertPlacement(np.array([0, 1, 2, 0]), np.array([0, 2, 4]), [np.zeros((0, 2), np.int64)])
    try:
        VirtualExpertBalancer(4, placement)
    except ValueError as e:
        return str(e)
    return ""


def test_balancer_refuses_replicas():
    out = torch_world.run(_uneven_rank, 2)
    assert all("expert 0 has two replicas" in msg for msg in out)


def _prepared_rank(rank, world, seed):
    """The balancer's per-forward placements planned and prepared before the step (as
    bench_moe's stand-in does), the step run twice: no table is made inside it, the
    results equal the dense reference's, and the layer keeps only PREPARED placements."""
    import routepack.torch.moe as moe
    d = _data(world, seed)
    ref_y, ref_x, _, _ = _reference(d, world)
    base, layer, balancer = _balanced_layer(d, world)
    planned = [balancer.plan(d["routing"][rank, m])[:2] for m in range(d["M"])]
    for placement, _ in planned:
        layer.prepare(placement)
    made, real = [], moe._PlacementTables

    def counting(*a):
        made.append(a[0])
        return real(*a)
    moe._PlacementTables = counting
    errs = {}
    try:
        for rep in range(2):
            for m, (placement, physical) in enumerate(planned):
                x = d["x"][rank, m].clone().requires_grad_()
                layer.fetch_replicas(placement)
                y = layer(x, d["routing"][rank, m], physical, microbatch=0)
                (y * d["cot"][rank, m]).sum().backward()
                layer.reduce_replica_grads()
                errs["y%d" % m] = max(errs.get("y%d" % m, 0.0), (y - ref_y[rank, m]).abs().max().item()
                                      if y.numel() else 0.0)
        errs["made_in_step"] = len(made)
        layer.PREPARED = 1                    # a third placement evicts the oldest ones
        layer.prepare(base)
        layer.fetch_replicas(planned[0][0], prefetch=False)
        errs["made_after_eviction"] = len(made)
    finally:
        moe._PlacementTables = real
    return errs


def test_prepared_placements_make_no_tables_in_the_step():
    for rank, errs in enumerate(torch_world.run(_prepared_rank, 4, 1)):
        assert errs.pop("made_in_step") == 0, "rank %d made placement tables inside the step" % rank
        assert errs.pop("made_after_eviction") == 2, "rank %d: an evicted placement is made again" % rank
        for key, v in errs.items():
            assert v < 1e-5, "rank %d: %s differs from the dense reference by %g" % (rank, key, v)
