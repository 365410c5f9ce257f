"""Memory: 10,000 steps after a warm-up leave resident memory flat within 1%: nothing the
binding or the library allocates per step survives it."""

import os
import time

import numpy as np
import pytest

import routepack
from conftest import DATA, random_step

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(os.environ.get("ROUTEPACK_SANITIZED") == "1",
                    reason="AddressSanitizer's quarantine grows resident memory by design")
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_resident_memory_flat_over_10000_steps(tiny_config):
    rng = np.random.default_rng(5)
    # a few different steps in rotation, in every routing form, so each path runs
    steps = []
    for i in range(4):
        lens, ids = random_step(rng, 8, 2, 2, 8, max_len=24, dtype=np.uint8)
        cu = np.concatenate([[0], np.cumsum(lens)])
        per_seq = [ids[cu[s]:cu[s + 1]] for s in range(len(lens))]
        per_layer = [ids[:, l, :] for l in range(2)]
        steps += [(lens, ids), (lens, per_seq), (lens, per_layer), (lens, ids.astype(np.int64))]
    # the baselines are quick; a hot swap every 500 steps (a Lua file policy, then a
    # baseline again) also builds and frees sandboxes inside the measured run
    swaps = [str(DATA / "swap_attn.lua"), "attn_kk+eplb", "token_kk+eplb"]
    with routepack.Scheduler(tiny_config, policy="token_kk+eplb") as s:
        def block(n):
            swapped = 0
            for i in range(n):
                if i % 500 == 499:
                    s.stage_policy(path=swaps[(i // 500) % len(swaps)])
                lens, routing = steps[i % len(steps)]
                res = s.step(lens, routing)
                assert res.plan_hash and not res.fallback and not res.swap_error
                swapped += res.swapped
            return swapped
        block(2000)                                       # warm-up: caches, history, allocator
        before = rss_bytes()
        t0 = time.perf_counter()
        assert block(10000) == 20
        after = rss_bytes()
        elapsed = time.perf_counter() - t0
    growth = (after - before) / before
    print("RSS %d -> %d bytes (%+.3f%%) over 10000 steps, %.0f us/step"
          % (before, after, 100 * growth, elapsed / 10000 * 1e6))
    assert growth < 0.01, "resident memory grew %.2f%% (%d -> %d bytes)" % (100 * growth, before, after)
