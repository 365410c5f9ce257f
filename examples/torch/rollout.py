"""The rollout both train_moe.py examples start from (examples/torch and, through
sys.path, examples/megatron): a step's sequences, the same in every run, and the rank
that rolled each one out."""

import numpy as np
import torch


def rollout_batch(step, world, seqs_per_rank, seed, vocab, max_len):
    """The step's sequences: lengths in [4, max_len), tokens (each a function of the seed,
    the step and its id), and the rank that rolled each out (sequence s: rank s % world)."""
    S = seqs_per_rank * world
    rng = np.random.default_rng([seed, step])
    lens = rng.integers(4, max_len, S).astype(np.int32)
    tokens = [torch.randint(0, vocab, (int(lens[s]),), generator=torch.Generator().manual_seed(
        seed * 1000003 + step * 1009 + s)) for s in range(S)]
    return lens, tokens, np.arange(S) % world
