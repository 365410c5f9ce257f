"""routepack.Config: a loaded and validated config (rp_config) with the figures the
binding and the adapters read from it (topology, model, limits, trainer, execution)."""

from __future__ import annotations

import ctypes
import json
import os

import numpy as np

from . import _args, _lib, errors
from ._context import Owned


def _config_bytes(config):
    """('path', bytes) or ('text', bytes, name) for a config given as a path, a JSON text
    or a dict."""
    if isinstance(config, dict):
        return ("text", json.dumps(config).encode("utf-8"), b"<dict>")
    if isinstance(config, bytes):
        config = config.decode("utf-8")
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return ("text", config.encode("utf-8"), b"<inline>")
    if isinstance(config, (str, os.PathLike)):
        return ("path", _args.c_path(config, "config"))
    raise TypeError("config must be a path, a JSON text or a dict, got %s" % type(config).__name__)


class Config:
    """A loaded and validated config (rp_config). Errors raise ConfigError with the C
    message (file:line:column and the JSON path)."""

    def __init__(self, config, ctx):
        self._lib = _lib.load()
        self._ctx = ctx
        handle = ctypes.c_void_p()
        err = _lib.new_error()
        kind = _config_bytes(config)
        if kind[0] == "path":
            st = self._lib.rp_config_load(ctx.handle, kind[1], ctypes.byref(handle),
                                          ctypes.byref(err))
        else:
            st = self._lib.rp_config_parse(ctx.handle, kind[1], len(kind[1]), kind[2],
                                           ctypes.byref(handle), ctypes.byref(err))
        if st != errors.OK:
            _lib.raise_error(st, err, cls=errors.ConfigError)
        self._owned = Owned(handle, self._lib.rp_config_free, [ctx])
        topo = self._lib.rp_config_topology(handle).contents
        model = self._lib.rp_config_model(handle).contents
        self.num_gpus = topo.num_gpus
        self.gpus_per_node = topo.gpus_per_node
        self.num_nodes = topo.num_nodes
        self.ep_size = topo.ep_size
        self.slots = np.ctypeslib.as_array(topo.slots, (topo.ep_size,)).copy()
        # the Megatron layout (docs/config.md, "topology"): a plan's rank is a TP x CP group
        self.tensor_parallel_size = topo.tensor_parallel_size
        self.context_parallel_size = topo.context_parallel_size
        self.expert_tensor_parallel_size = topo.expert_tensor_parallel_size
        self.expert_parallel_size = topo.expert_parallel_size
        self.num_layers = model.num_layers
        self.num_experts = model.num_experts
        self.top_k = model.top_k
        limits = self._lib.rp_config_limits(handle).contents
        self.max_tokens_per_microbatch = limits.max_tokens_per_microbatch
        trainer = self._lib.rp_config_trainer(handle).contents
        # what the trainer demands of a packing (docs/config.md, "trainer")
        self.equal_sequences_per_rank = bool(trainer.equal_sequences_per_rank)
        self.microbatch_multiple = trainer.microbatch_multiple
        self.nonempty_microbatches = bool(trainer.nonempty_microbatches)
        # the trainer runs Megatron's per-forward balancer on plans that ask for it
        self.per_forward_balancer = bool(trainer.per_forward_balancer)
        # how a rollout batch is trained: mini-batches of M / mini_batches consecutive
        # microbatches, one optimizer step each, epochs times (verl's ppo_mini_batch_size,
        # ppo_epochs)
        self.mini_batches = trainer.mini_batches
        self.epochs = trainer.epochs
        execution = self._lib.rp_config_execution(handle).contents
        # what the memory check counts (docs/cost-model.md, "Memory per GPU")
        self.optimizer_sharding = ("none", "dp")[execution.optimizer_sharding]
        self.staging_budget_bytes = execution.staging_budget_bytes

    @property
    def handle(self):
        return self._owned.handle

    def free(self):
        """Drop the config (freed once no scheduler made from it is left)."""
        self._owned.close()

