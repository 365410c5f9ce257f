"""routepack.torch.MoELayer fetches the step's extra replicas ahead (issue 35): with
fetch_replicas(prefetch=True), the default, every layer's fetch is left in flight when
fetch_replicas returns (a trainer sets every layer's placement at the step's start, and
layer l's fetch runs while the layers before it compute: what the cost model's
execution.extras_ahead prices), the layer waits for it at its first forward, and the
step's outputs and gradients are those of the fetch finished inside fetch_replicas; a
fetch group of its own (fetch_group) gives the same."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402


def _prefetch_rank(rank, world, prefetch, own_group):
    import torch.distributed as dist
    from routepack.torch import ExpertPlacement, MoELayer
    g = torch.Generator().manual_seed(7)
    S, d, f, k, T = 8, 16, 16, 2, 24
    fetch_group = dist.new_group(list(range(world))) if own_group else None
    layers = [MoELayer(d, f, S, k, S // world + 1, fetch_group=fetch_group) for _ in range(2)]
    phy2log = np.concatenate([np.arange(S), [0, 1]])   # rank 0 [0..4], rank 1 [5, 6, 7, 0, 1]
    # microbatch 0: expert 2 (slot 2, rank 0) on rank 1: a remote fetch; expert 3 on rank 0
    placement = ExpertPlacement(phy2log, np.arange(world + 1) * (S // world + 1),
                                [np.array([[2, 1], [3, 0]]), np.zeros((0, 2), np.int64)])
    for layer in layers:
        layer.load_experts(torch.randn(S, d, f, generator=g), torch.randn(S, f, d, generator=g), placement)
    for layer in layers:
        layer.fetch_replicas(placement, prefetch=prefetch)
    in_flight = [layer._fetch is not None for layer in layers]
    outs = []
    for m in range(2):
        x = torch.randn(T, d, generator=g).requires_grad_()
        routing = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
        physical = routing.clone()
        if m == 0:
            physical[routing == 2] = len(phy2log)        # expert 2's extra replica (rank 1)
            physical[routing == 3] = len(phy2log) + 1    # expert 3's (rank 0)
        y = x
        for layer in layers:
            y = layer(y, routing, physical, microbatch=m)
        y.square().sum().backward()
        outs.append(y.detach().numpy().copy())
    for layer in layers:
        layer.reduce_replica_grads()
    grads = [(layer.w_in.grad.numpy().copy(), layer.w_out.grad.numpy().copy()) for layer in layers]
    extras = [(layer.extra_w_in.detach().numpy().copy(), layer.extra_w_out.detach().numpy().copy()) for layer in layers]
    dist.barrier()
    return in_flight, outs, grads, extras


@pytest.mark.parametrize("own_group", [False, True])
def test_prefetched_extras_equal_the_fetch_inside_fetch_replicas(own_group):
    ahead = torch_world.run(_prefetch_rank, 2, True, own_group)
    inside = torch_world.run(_prefetch_rank, 2, False, own_group)
    for rank in range(2):
        in_flight, outs, grads, extras = ahead[rank]
        assert in_flight == [True, True], "the fetch is left in flight on every rank (both take part)"
        assert inside[rank][0] == [False, False], "prefetch=False finishes it in fetch_replicas"
        for a, b in zip(outs, inside[rank][1]):
            assert np.array_equal(a, b)
        for (ai, ao), (bi, bo) in zip(grads, inside[rank][2]):
            assert np.array_equal(ai, bi) and np.array_equal(ao, bo)
        for (ai, ao), (bi, bo) in zip(extras, inside[rank][3]):
            assert np.array_equal(ai, bi) and np.array_equal(ao, bo)
    # rank 1 received expert 2's weights from rank 0's slot 2 (the same on both layers' runs)
    assert ahead[1][3][0][0].shape[0] == 1 and ahead[0][3][0][0].shape[0] == 1
