"""routepack.torch.router_shift_weights: hand-computed weights (no shift gives 1, a token
whose top-k moved entirely gets the floor, geometric mean over layers, the old-logits
reference), dtypes and per-layer lists as trainers hold them, no gradient, CUDA equal to
CPU (skipped without a GPU), bad input."""

import math

import pytest

torch = pytest.importorskip("torch")
from routepack.torch import router_shift_weights  # noqa: E402


def logits_for(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_no_shift_gives_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 16, generator=g)
    old = logits.topk(4, dim=-1).indices                   # the current top-k: no shift
    w = router_shift_weights(old, logits)
    assert w.shape == (50,) and w.dtype == torch.float32
    assert torch.allclose(w, torch.ones(50), atol=1e-6)
    # with the old router's logits equal to the current ones: exactly 1
    w = router_shift_weights(old.flip(-1), logits, old_router_logits=logits.clone())
    assert torch.equal(w, torch.ones(50))


def test_moved_entirely_gets_floor():
    # 1 layer, 2 tokens, top-2 of 6: token 0 keeps its experts, token 1's moved to {4, 5}
    logits = logits_for([[[8., 8., 0., 0., 0., 0.], [-20., -20., 0., 0., 10., 10.]]])
    old = torch.tensor([[[0, 1], [0, 1]]])
    w = router_shift_weights(old, logits, floor=0.25)
    assert w[0].item() == pytest.approx(1.0, abs=1e-6)
    assert w[1].item() == 0.25


def test_hand_values_and_geometric_mean():
    # p = softmax([0, ln 3, 0, 0]) = [1/6, 1/2, 1/6, 1/6]; old expert 0: mass 1/6 against
    # the current top-1 mass 1/2, ratio 1/3; a second layer without shift: ratio 1
    a = [0.0, math.log(3.0), 0.0, 0.0]
    logits = logits_for([[a], [a]])
    old = torch.tensor([[[0]], [[1]]])
    w = router_shift_weights(old, logits, floor=0.01)
    assert w.item() == pytest.approx(math.sqrt(1 / 3), rel=1e-6)
    w1 = router_shift_weights(old[:1], logits[:1], floor=0.01)
    assert w1.item() == pytest.approx(1 / 3, rel=1e-6)
    assert router_shift_weights(old[:1], logits[:1], floor=0.5).item() == 0.5


def test_old_logits_reference_is_symmetric():
    # old mass on {0} is 1/2, current 1/4 -> 1/2; swapped -> also 1/2
    half = [math.log(3.0), 0.0, 0.0, 0.0]      # p0 = 3/6 = 1/2
    quarter = [0.0, 0.0, 0.0, 0.0]             # p0 = 1/4
    old = torch.tensor([[[0]]])
    a = router_shift_weights(old, logits_for([[quarter]]), floor=0.01, old_router_logits=logits_for([[half]]))
    b = router_shift_weights(old, logits_for([[half]]), floor=0.01, old_router_logits=logits_for([[quarter]]))
    assert a.item() == pytest.approx(0.5, rel=1e-6) and b.item() == pytest.approx(0.5, rel=1e-6)


def test_probs_scores():
    # sigmoid-style scores given as they are: mass 0.2 on the old expert, top-1 0.8
    scores = torch.tensor([[[0.2, 0.8, 0.1]]])
    w = router_shift_weights(torch.tensor([[[0]]]), scores, floor=0.01, scores="probs")
    assert w.item() == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_dtypes_and_lists(dtype, id_dtype):
    g = torch.Generator().manual_seed(1)
    logits32 = torch.randn(4, 30, 8, generator=g)
    old = torch.randn(4, 30, 8, generator=g).topk(2, dim=-1).indices.to(id_dtype)
    ref = router_shift_weights(old, logits32.to(dtype).float(), floor=0.05)
    w = router_shift_weights(old, logits32.to(dtype), floor=0.05)
    assert w.dtype == torch.float32 and torch.allclose(w, ref, atol=1e-6)
    assert ((w >= 0.05) & (w <= 1.0)).all() and (w < 1).any()
    lw = router_shift_weights(list(old.unbind(0)), list(logits32.to(dtype).unbind(0)), floor=0.05)
    assert torch.equal(lw, w)


def test_no_grad_flows():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 10, 8, generator=g, requires_grad=True)
    old = torch.randn(2, 10, 8, generator=g).topk(2, dim=-1).indices
    w = router_shift_weights(old, logits)
    assert not w.requires_grad and w.grad_fn is None
    log_ratio = torch.zeros(10, requires_grad=True)
    loss = -(torch.exp(log_ratio) * w).sum()
    loss.backward()
    assert logits.grad is None
    assert torch.allclose(log_ratio.grad, -w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_equals_cpu():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 64, 32, generator=g).to(torch.bfloat16)
    old = torch.randn(3, 64, 32, generator=g).topk(4, dim=-1).indices
    cpu = router_shift_weights(old, logits)
    gpu = router_shift_weights(old.cuda(), logits.cuda())
    assert gpu.device.type == "cuda" and torch.allclose(gpu.cpu(), cpu, atol=1e-6)


def test_bad_input():
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"old_topk_ids\[1, 2, 0\] is 4, outside the 4 experts"):
        router_shift_weights(torch.tensor([[[0], [1], [2]], [[0], [1], [4]]]), logits)
    with pytest.raises(ValueError, match="same layers and tokens"):
        router_shift_weights(torch.zeros(2, 5, 1, dtype=torch.int64), logits)
    with pytest.raises(ValueError, match="floor"):
        router_shift_weights(torch.zeros(2, 3, 1, dtype=torch.int64), logits, floor=0.0)
    with pytest.raises(TypeError, match="integer"):
        router_shift_weights(torch.zeros(2, 3, 1), logits)
    with pytest.raises(ValueError, match=r"\[layers, tokens, k\]"):
        router_shift_weights(torch.zeros(3, 1, dtype=torch.int64), logits)
