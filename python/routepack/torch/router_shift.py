"""Per-token router-shift weights for a GRPO/GSPO-style loss, after RSPO (Zhang et al.,
"Towards Stable and Effective Reinforcement Learning for Mixture-of-Experts", arXiv
2510.23027): how much of the current router's probability still sits on the experts the
old policy activated for a token, as a trust weight in [floor, 1] that the loss multiplies
into its importance ratios before clipping. docs/torch.md, "Router-shift weights", states
the formula and what of it is checked against the paper."""

import torch


def _stack(x, what, last):
    """A list of per-layer [tokens, last] tensors, or one [layers, tokens, last] tensor."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError("%s: an empty list of layers" % what)
        x = torch.stack(list(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError("%s must be a torch.Tensor or a list of per-layer tensors, got %s"
                        % (what, type(x).__name__))
    if x.dim() != 3:
        raise ValueError("%s must be [layers, tokens, %s] (or a list of [tokens, %s] per layer), "
                         "got shape %s" % (what, last, last, tuple(x.shape)))
    return x


def _log_probs(scores, kind, what):
    s = scores.float()
    if kind == "softmax":
        return torch.log_softmax(s, dim=-1)
    if kind == "probs":
        return torch.log(s.clamp_min(0.0))
    raise ValueError("%s: scores must be 'softmax' (logits) or 'probs', got %r" % (what, kind))


@torch.no_grad()
def router_shift_weights(old_topk_ids, router_logits, floor=0.1, *, old_router_logits=None,
                         scores="softmax"):
    """Per-token RSPO router-shift weights, stop-gradient, in [floor, 1].

    ``old_topk_ids``: [layers, tokens, k] integer (int64 or int32), or a list of per-layer
    [tokens, k]: the experts the old policy (the rollout's routing replay) activated.
    ``router_logits``: [layers, tokens, E] (bf16, fp16 or fp32), or a list of per-layer
    [tokens, E]: the current router's logits for the same tokens (the training forward's).
    ``old_router_logits``: optional, the old router's logits, same shape. ``scores``:
    "softmax" (the default: the inputs are logits, probabilities are their softmax) or
    "probs" (the inputs already are the router's probabilities or gate scores, e.g.
    sigmoid scores). ``floor``: the lower bound, in (0, 1].

    For token t at layer l, with S the set of old experts, p the current router's
    probabilities (computed in fp32) and M(p) = sum over e in S of p[e]:

        reference  R_l = sum over e in S of p_old[e]          with old_router_logits
                   R_l = the sum of the k largest p[e]        without (the current
                         router's own top-k mass: the most any k experts get now)
        d_l        = |log M_l - log R_l|
        w_t        = max(floor, exp(-(1/L) * sum_l d_l))

    so w_t is the geometric mean over layers of min(M_l / R_l, R_l / M_l), floored. No
    shift gives 1 (the old experts are still the current top-k, or keep the old mass);
    a token whose top-k moved entirely to experts the router now strongly prefers gets
    the floor. Returns float32 [tokens] on the logits' device, detached (no gradient
    flows into the router through the weights). Raises ValueError or TypeError for
    shapes that disagree, an id outside [0, E), or a floor outside (0, 1]."""
    ids = _stack(old_topk_ids, "old_topk_ids", "k")
    logits = _stack(router_logits, "router_logits", "E")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError("old_topk_ids must be an integer tensor, got %s" % ids.dtype)
    if not (0.0 < float(floor) <= 1.0):
        raise ValueError("floor must be in (0, 1], got %r" % (floor,))
    L, T, K = ids.shape
    if logits.shape[:2] != (L, T):
        raise ValueError("router_logits has shape %s but old_topk_ids has %s: both must be "
                         "[layers, tokens, ...] of the same layers and tokens"
                         % (tuple(logits.shape), tuple(ids.shape)))
    E = logits.shape[2]
    if K > E:
        raise ValueError("top-k %d exceeds the %d experts of router_logits" % (K, E))
    ids = ids.to(device=logits.device, dtype=torch.int64)
    if T and (int(ids.min()) < 0 or int(ids.max()) >= E):
        bad = ((ids < 0) | (ids >= E)).nonzero()[0].tolist()
        raise ValueError("old_topk_ids[%d, %d, %d] is %d, outside the %d experts of router_logits"
                         % (bad[0], bad[1], bad[2], int(ids[tuple(bad)]), E))

    logp = _log_probs(logits, scores, "router_logits")                       # [L, T, E]
    in_old = torch.zeros(L, T, E, dtype=torch.bool, device=logits.device)
    in_old.scatter_(2, ids, True)                 # a repeated id marks its expert once
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    log_mass = torch.where(in_old, logp, neg_inf).logsumexp(-1)              # log M_l
    if old_router_logits is not None:
        old = _stack(old_router_logits, "old_router_logits", "E")
        if old.shape != logits.shape:
            raise ValueError("old_router_logits has shape %s, router_logits %s: they must match"
                             % (tuple(old.shape), tuple(logits.shape)))
        old_logp = _log_probs(old.to(logits.device), scores, "old_router_logits")
        log_ref = torch.where(in_old, old_logp, neg_inf).logsumexp(-1)
    else:
        log_ref = logp.topk(K, dim=-1).values.logsumexp(-1)
    d = (log_mass - log_ref).abs()
    # a mass of 0 (probabilities given as scores) makes d infinite: the weight is the floor
    d = torch.nan_to_num(d, nan=float("inf"))
    w = torch.exp(-d.mean(0))
    return w.clamp(min=float(floor), max=1.0).to(torch.float32)
