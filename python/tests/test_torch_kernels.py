"""routepack.torch.kernels and cell: the grouped expert GEMM equals the per-expert loop
(plain and SwiGLU experts, skewed and empty groups, forward and gradients); the fused
varlen attention the device picks equals the math reference (causal, GQA, sequences of
different lengths); MoELayer with SwiGLU experts on one rank equals the dense formula;
LayerCell runs a cell forward and backward, with and without tokens."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="routepack.torch needs PyTorch (pip install torch)")

import torch_world  # noqa: E402
from routepack.torch import kernels  # noqa: E402
from routepack.torch.cell import LayerCell, median_seconds  # noqa: E402


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("gated", [False, True])
def test_grouped_equals_loop(gated):
    g = torch.Generator().manual_seed(3)
    counts = [7, 0, 33, 1, 16]
    d, f = 24, 12
    x = torch.randn(sum(counts), d, generator=g)
    w_in = torch.randn(len(counts), d, 2 * f if gated else f, generator=g) * 0.2
    w_out = torch.randn(len(counts), f, d, generator=g) * 0.2
    cot = torch.randn(sum(counts), d, generator=g)
    outs = []
    for kern in (kernels.GROUPED, kernels.LOOP):
        leaves = _leaves(x, w_in, w_out)
        y = kernels.expert_mlp(*leaves[:1], counts, *leaves[1:], kern)
        y.backward(cot)
        outs.append([y.detach()] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # by hand for expert 3's single row
    row = x[sum(counts[:3])]
    h = row @ w_in[3]
    act = torch.nn.functional.silu(h[:f]) * h[f:] if gated else torch.nn.functional.silu(h)
    torch.testing.assert_close(outs[0][0][sum(counts[:3])], act @ w_out[3], rtol=1e-5, atol=1e-5)


def test_expert_mlp_rejects_shapes_and_kernels():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="fit neither"):
        kernels.expert_mlp(x, [2], torch.zeros(1, 4, 5), torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="unknown expert kernel"):
        kernels.expert_mlp(x, [2], torch.zeros(1, 4, 3), torch.zeros(1, 3, 4), "cutlass")


def test_cpu_kernel_choice():
    kern, why = kernels.choose_expert_kernel("cpu", torch.float32)
    assert kern in (kernels.GROUPED, kernels.LOOP) and why
    att, notes = kernels.choose_attention_kernel("cpu", torch.float32)
    assert att in kernels.FUSED_ATTENTION, notes


def test_fused_attention_equals_reference():
    att, notes = kernels.choose_attention_kernel("cpu", torch.float32)
    if att is None:
        pytest.skip("no fused attention on this CPU: %s" % notes)
    g = torch.Generator().manual_seed(5)
    lens = [5, 17, 17, 1]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    T = sum(lens)
    q, k, v = (torch.randn(T, n, 8, generator=g) for n in (4, 2, 2))
    cot = torch.randn(T, 4, 8, generator=g)
    res = []
    for kern in (att, kernels.UNFUSED_ATTENTION):
        leaves = _leaves(q, k, v)
        out = kernels.varlen_attention(*leaves, cu, max(lens), kern)
        out.backward(cot)
        res.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a sequence of one token attends to itself only
    torch.testing.assert_close(res[0][0][T - 1], v[T - 1].repeat_interleave(2, dim=0), rtol=1e-5, atol=1e-5)


SHAPE = dict(hidden_size=16, expert_ffn_size=8, num_heads=4, num_kv_heads=2, head_dim=4)


def _cell_moe_block(rank, world):
    """In a process of its own (torch_world): LayerCell makes a one-rank process group."""
    torch.set_num_threads(1)
    att, _ = kernels.choose_attention_kernel("cpu", torch.float32)
    cell = LayerCell(SHAPE, 3, attention_kernel=att, expert_kernel=kernels.GROUPED, dtype=torch.float32)
    inputs = cell.inputs([6, 3], [4, 0, 2])
    _, z = cell(inputs["x"], inputs["cu"], inputs["max_len"], inputs["rows"], inputs["routing"])
    rows = cell.norm2(inputs["rows"])
    want = []
    for i, e in enumerate([0, 0, 0, 0, 2, 2]):
        h = rows[i] @ cell.moe.w_in[e]
        want.append(inputs["rows"][i] + (torch.nn.functional.silu(h[:8]) * h[8:]) @ cell.moe.w_out[e])
    return float((z - torch.stack(want)).abs().max())


def test_layer_cell_moe_block_is_the_swiglu_formula():
    assert torch_world.run(_cell_moe_block, 1)[0] < 1e-5


def _cell_steps(rank, world, cases):
    att, _ = kernels.choose_attention_kernel("cpu", torch.float32)
    cell = LayerCell(SHAPE, 3, attention_kernel=att, expert_kernel=kernels.LOOP, dtype=torch.float32)
    out = []
    for lengths, counts in cases:
        inputs = cell.inputs(lengths, counts)
        y, z = cell.step(inputs)
        out.append((tuple(y.shape), tuple(z.shape), median_seconds(lambda: cell.step(inputs), "cpu", 1, 2)))
    return out


def test_layer_cell_steps_with_and_without_tokens():
    cases = [([6, 3], [4, 0, 2]), ([], [0, 0, 0]), ([5], [])]
    got = torch_world.run(_cell_steps, 1, cases)[0]
    for (lengths, counts), (ys, zs, t) in zip(cases, got):
        assert ys == (sum(lengths), 16) and zs == (sum(counts), 16) and t > 0


def test_rmsnorm_fallback_equals_torch():
    from routepack.torch import cell
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    mine = cell._RMSNorm(16)
    with torch.no_grad():
        mine.weight.copy_(torch.linspace(0.5, 1.5, 16))
    if hasattr(torch.nn, "RMSNorm"):
        ref = torch.nn.RMSNorm(16, eps=1e-6)
        with torch.no_grad():
            ref.weight.copy_(mine.weight)
        torch.testing.assert_close(mine(x), ref(x), rtol=1e-5, atol=1e-5)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * mine.weight
    torch.testing.assert_close(mine(x), want, rtol=1e-5, atol=1e-5)
