"""routepack.torch.holders.sum_among_holders (what routepack.adapters.megatron_layer's
reduce_replica_grads runs on Megatron's main_grad): on 4 gloo ranks, every slot of a
replicated expert ends with the sum of all its slots' gradients (the same bits on every
holder), slots of experts held once keep theirs, the bytes sent are the holders formula
(each holder to each other holder, one copy of the expert's gradient), and a rank that
holds no replicated expert sends nothing but still takes part in the batched call."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402

WORLD, SLOTS = 4, 2
# two layers of 8 slots (rank r: slots 2r, 2r + 1). Layer 0: expert 0 on ranks 0 and 3,
# expert 1 on ranks 0 and 1, expert 2 on ranks 1 and 2; experts 3 and 4 once. Layer 1:
# expert 0 twice on rank 0 (summed there, nothing sent), expert 5 on ranks 2 and 3; rank 1
# holds no replicated expert there.
ROWS = [np.array([0, 1, 1, 2, 2, 3, 4, 0]), np.array([0, 0, 2, 3, 4, 5, 5, 6])]
SHAPES = [(3, 2), (4,)]          # a slot's gradient pieces


def _grad(layer, slot):
    g = torch.Generator().manual_seed(100 * layer + slot)
    return [torch.randn(s, generator=g, dtype=torch.float32) for s in SHAPES]


def _run(rank, world):
    from routepack.torch.holders import sum_among_holders
    mine = [[_grad(l, rank * SLOTS + i) for i in range(SLOTS)] for l in range(len(ROWS))]
    with torch_world.counting_sends() as seen:
        sent = sum_among_holders(ROWS, mine, None)
    return sent, sum(seen), len(seen), [[[t.numpy().copy() for t in s] for s in layer] for layer in mine]


def test_replicas_take_the_sum_exchanged_among_holders_only():
    out = torch_world.run(_run, WORLD)
    one = sum(int(np.prod(s)) for s in SHAPES) * 4        # one expert's gradient, FP32
    # layer 0: rank 0 shares 0 with rank 3 and 1 with rank 1; rank 1 shares 1 with 0 and 2
    # with 2; rank 2 shares 2 with 1; rank 3 shares 0 with 0. Layer 1: ranks 2 and 3, expert 5.
    want_sent = [2 * one, 2 * one, 2 * one, 2 * one]
    for rank in range(WORLD):
        sent, counted, _, _ = out[rank]
        assert sent == want_sent[rank] and counted == sent, (rank, sent, counted)
    for l, row in enumerate(ROWS):
        for e in set(row.tolist()):
            slots = np.flatnonzero(row == e)
            want = [sum(_grad(l, int(p))[k] for p in slots).numpy() for k in range(len(SHAPES))]
            for p in slots:
                got = out[int(p) // SLOTS][3][l][int(p) % SLOTS]
                for k in range(len(SHAPES)):
                    if len(slots) == 1:
                        assert np.array_equal(got[k], want[k]), (l, e, p)      # untouched
                    else:
                        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
            # every holder has the same bits
            for p in slots[1:]:
                for k in range(len(SHAPES)):
                    assert np.array_equal(out[int(p) // SLOTS][3][l][int(p) % SLOTS][k],
                                          out[int(slots[0]) // SLOTS][3][l][int(slots[0]) % SLOTS][k])


def _no_replicas(rank, world):
    from routepack.torch.holders import sum_among_holders
    rows = [np.arange(WORLD * SLOTS)]
    mine = [[_grad(0, rank * SLOTS + i) for i in range(SLOTS)]]
    return sum_among_holders(rows, mine, None), [t.numpy().copy() for s in mine[0] for t in s]


def test_no_replicated_expert_moves_nothing():
    out = torch_world.run(_no_replicas, WORLD)
    for rank in range(WORLD):
        sent, grads = out[rank]
        assert sent == 0
        want = [t for i in range(SLOTS) for t in _grad(0, rank * SLOTS + i)]
        assert all(np.array_equal(a, b.numpy()) for a, b in zip(grads, want))
