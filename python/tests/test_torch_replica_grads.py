"""MoELayer's replica-gradient exchange does no memory work beyond what it receives (issue
29): on 4 gloo ranks, a rank whose replicated experts sit in a run of its slots sends
those gradients as they are and adds the others' into them in place; a rank whose copies
are all extra replicas (dropped after the step) only sends them, to the slot holders, and
receives nothing; a rank later in rank order adds into what it received. Each rank's allocations during the exchange stay
within the bytes it receives plus small index tensors (the old exchange built a zeroed sum
buffer, a gathered copy per peer and a zeroed total besides), and every holder ends with
the sum of all the copies, added in EP-rank order, computed here from each rank's
gradients before the exchange."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402
from test_torch_moe_levers import _AllocatedBytes  # noqa: E402

D, F, SLOTS, WORLD = 16, 8, 5, 4
# rank r: experts 4r .. 4r + 3, then a spare slot; rank 1's spare holds expert 0
PHY2LOG = np.array([0, 1, 2, 3, -1, 4, 5, 6, 7, 0, 8, 9, 10, 11, -1, 12, 13, 14, 15, -1])
# extra replicas of experts 1 and 2 on ranks 2 and 3 (one microbatch)
EXTRAS = np.array([[1, 2], [2, 2], [1, 3], [2, 3]])


def _exchange_rank(rank, world):
    from routepack.torch import ExpertPlacement, MoELayer
    placement = ExpertPlacement(PHY2LOG, np.arange(world + 1) * SLOTS, [EXTRAS])
    layer = MoELayer(D, F, 16, 2, SLOTS)
    g = torch.Generator().manual_seed(3)
    layer.load_experts(torch.randn(16, D, F, generator=g), torch.randn(16, F, D, generator=g), placement)
    layer.fetch_replicas(placement)
    g = torch.Generator().manual_seed(10 + rank)
    T = 24
    routing = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(T)])
    routing[:8, 0] = torch.tensor([0, 1, 2, 0, 1, 2, 1, 2])   # every copy of 0, 1, 2 gets rows
    # the replicated experts' choices spread over their copies: slot (physical id = slot),
    # rank 1's spare slot for expert 0, the extra replicas (physical 20 + row of EXTRAS)
    first = {e: int(np.nonzero(PHY2LOG == e)[0][0]) for e in range(16)}
    physical = routing.clone().apply_(lambda e: first[e])
    alt = torch.arange(T) % 3
    for t in range(T):
        for j in range(2):
            e = int(routing[t, j])
            if e == 0 and alt[t] == 1:
                physical[t, j] = 9
            elif e in (1, 2) and alt[t] > 0:
                physical[t, j] = 20 + [(1, 2), (2, 2), (1, 3), (2, 3)].index((e, 1 + int(alt[t])))
    x = torch.randn(T, D, generator=g)   # no grad: the exchange starts in reduce_replica_grads
    layer(x, routing, physical).square().sum().backward()
    before = {name: t.grad.clone() if t.grad is not None else t.detach().new_zeros((0,) + t.shape[1:])
              for name, t in (("w_in", layer.w_in), ("w_out", layer.w_out),
                              ("extra_w_in", layer.extra_w_in), ("extra_w_out", layer.extra_w_out))}
    with _AllocatedBytes() as mode:
        layer.reduce_replica_grads()
    return dict(before={k: v.numpy() for k, v in before.items()},
                after=[layer.w_in.grad.numpy().copy(), layer.w_out.grad.numpy().copy()],
                exchange_bytes=mode.bytes, received=layer.replica_grad_bytes["received"],
                sent=layer.replica_grad_bytes["sent"],
                own=layer._gplan.get("own"))


def test_replica_gradient_exchange_sums_without_copies():
    out = torch_world.run(_exchange_rank, WORLD)
    copies = {}   # expert: [(rank, w_in grad, w_out grad)] in rank order
    for r, o in enumerate(out):
        for s, e in enumerate(PHY2LOG[r * SLOTS:(r + 1) * SLOTS]):
            if e >= 0:
                copies.setdefault(int(e), []).append((o["before"]["w_in"][s], o["before"]["w_out"][s]))
        step = EXTRAS[np.lexsort((EXTRAS[:, 1], EXTRAS[:, 0]))]   # the step's order
        for j, e in enumerate(step[step[:, 1] == r, 0]):
            copies[int(e)].append((o["before"]["extra_w_in"][j], o["before"]["extra_w_out"][j]))
    for r, o in enumerate(out):
        for s, e in enumerate(PHY2LOG[r * SLOTS:(r + 1) * SLOTS]):
            if e < 0:
                continue
            for part in range(2):
                want = np.zeros_like(copies[int(e)][0][part])
                for c in copies[int(e)]:
                    want = want + c[part]
                np.testing.assert_allclose(o["after"][part][s], want, rtol=1e-6, atol=1e-7,
                                           err_msg="rank %d slot %d (expert %d)" % (r, s, e))
    # the two holders of expert 0 and the three of experts 1, 2 end with the same bits
    assert np.array_equal(out[0]["after"][0][0], out[1]["after"][0][4])
    # memory work: what it receives, plus the peers' index tensors (a few hundred bytes)
    for r, o in enumerate(out):
        assert o["exchange_bytes"] <= o["received"] + 1024, (
            "rank %d allocated %d bytes in the exchange, receiving %d" % (r, o["exchange_bytes"], o["received"]))
    # only slot holders receive: one expert's gradient is 2 D F parameters of 4 B; rank 0
    # gets expert 0 from rank 1 and experts 1, 2 from ranks 2 and 3 (their extra replicas),
    # rank 1 expert 0 from rank 0; ranks 2 and 3 send experts 1 and 2 to rank 0 and get nothing
    one = 2 * D * F * 4
    assert [o["received"] for o in out] == [5 * one, one, 0, 0], out
    assert [o["sent"] for o in out] == [one, one, 2 * one, 2 * one], out

    # the paths this placement takes: a run of slots first in rank order (rank 0), a run of
    # slots after a peer (rank 1), extra replicas only (ranks 2, 3)
    assert [o["own"] for o in out] == ["slots", "slots", "extras", "extras"]
