"""asyncgrpo: asynchronous GRPO for LoRA adapters, trainer and vLLM replicas decoupled.

Public names are imported lazily, so ``import asyncgrpo`` stays light: the proxy and the
transports never load torch.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AdapterStore": "asyncgrpo.store.adapters",
    "AdapterSync": "asyncgrpo.run.sync",
    "AdapterVersion": "asyncgrpo.store.adapters",
    "AlreadyExists": "asyncgrpo.errors",
    "AsyncGRPOError": "asyncgrpo.errors",
    "AuditError": "asyncgrpo.errors",
    "CheckpointStore": "asyncgrpo.store.checkpoints",
    "ConfigError": "asyncgrpo.errors",
    "IntegrityError": "asyncgrpo.errors",
    "LaunchError": "asyncgrpo.errors",
    "NoHealthyReplica": "asyncgrpo.errors",
    "NotFound": "asyncgrpo.errors",
    "ProxyConfig": "asyncgrpo.config.proxy",
    "Replica": "asyncgrpo.serve",
    "ReplicaError": "asyncgrpo.errors",
    "RolloutChannel": "asyncgrpo.store.channel",
    "RolloutClient": "asyncgrpo.rollout.client",
    "RunResult": "asyncgrpo.store.run_documents",
    "Sample": "asyncgrpo.sample",
    "ServeConfig": "asyncgrpo.serve",
    "SyncError": "asyncgrpo.errors",
    "TrainingConfig": "asyncgrpo.config.training",
    "Transport": "asyncgrpo.transport",
    "TransportError": "asyncgrpo.errors",
    "VLLMClient": "asyncgrpo.vllm.client",
    "launch": "asyncgrpo.launch.launcher",
    "launch_replicas": "asyncgrpo.serve",
    "open_transport": "asyncgrpo.transport",
    "run_rollouts": "asyncgrpo.run.rollouts",
    "run_training": "asyncgrpo.run.training",
    "serve_proxy": "asyncgrpo.proxy.server",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
