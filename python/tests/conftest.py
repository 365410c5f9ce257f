"""Shared fixtures of the binding's tests: the repository's files, the CLI, small configs
and generated steps."""

import copy
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import routepack

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"


def _repo():
    env = os.environ.get("ROUTEPACK_SOURCE_DIR")
    if env:
        return Path(env)
    return HERE.parent.parent


REPO = _repo()
SMALL_CONFIG = REPO / "examples" / "config-small.json"
SMALL_TRACE = REPO / "examples" / "small.rpt"

# A config small enough for thousands of steps a second: 2 GPUs on one node, one EP group
# of 2 with 5 slots each (8 experts, 2 spare slots), 2 MoE layers, top-2.
TINY_CONFIG = {
    "topology": {"num_nodes": 1, "gpus_per_node": 2, "ep_size": 2, "slots_per_gpu": 5},
    "model": {"num_layers": 2, "num_experts": 8, "top_k": 2, "hidden_size": 256,
              "expert_ffn_size": 128, "num_heads": 4, "num_kv_heads": 4, "head_dim": 64},
    "limits": {"max_tokens_per_microbatch": 4096},
}


@pytest.fixture
def tiny_config():
    return copy.deepcopy(TINY_CONFIG)


@pytest.fixture(scope="session")
def small_trace():
    if not SMALL_TRACE.exists():
        pytest.skip("examples/small.rpt is not in this tree")
    return routepack.TraceReader(SMALL_TRACE)


def cli_path():
    """The routepack tool of the build the library came from, or None."""
    env = os.environ.get("ROUTEPACK_CLI")
    if env and os.path.isfile(env):
        return env
    lib = Path(routepack.library_path()).resolve()
    for cand in (lib.parent.parent / "routepack", REPO / "build" / "routepack"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("routepack")


@pytest.fixture(scope="session")
def cli():
    """The routepack tool's path (cli_path); the test is skipped where it is not built."""
    path = cli_path()
    if path is None:
        pytest.skip("the routepack tool is not built")
    return path


def load_script(name, relpath):
    """A script of scripts/ (relpath from there, "results/planner.py") imported as module
    `name`, with scripts/ on the path while it loads (its own imports of siblings)."""
    import importlib.util
    scripts = str(REPO / "scripts")
    sys.path.insert(0, scripts)
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / relpath)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(scripts)


def random_step(rng, num_seqs, num_layers, top_k, num_experts, max_len=64, skew=1.2,
                dtype=np.int32, lens=None):
    """(seq_lens, routing [tokens, layers, k]) with distinct experts per token and a
    Zipf-like skew so that some experts are hot. `lens` fixes the lengths."""
    if lens is None:
        lens = rng.integers(0, max_len + 1, size=num_seqs).astype(np.int32)
    lens = np.asarray(lens, dtype=np.int32)
    T = int(lens.sum())
    weights = 1.0 / np.arange(1, num_experts + 1) ** skew
    ids = np.empty((T, num_layers, top_k), dtype=dtype)
    for l in range(num_layers):
        perm = rng.permutation(num_experts)
        p = weights[perm] / weights.sum()
        # top-k distinct experts per token: Gumbel top-k on log-probabilities
        g = np.log(p)[None, :] + rng.gumbel(size=(T, num_experts))
        ids[:, l, :] = np.argsort(-g, axis=1)[:, :top_k]
    return lens, ids
