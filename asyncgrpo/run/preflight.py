"""Checks before a run starts: the replicas' LoRA capacity and adapter fetching, and
``asyncgrpo train CONFIG --dry-run``, which checks a recipe without starting, loading or
downloading.

What a real start would find out minutes (and a model download) later is checked here in
milliseconds: the config validates; the transport's scheme and form are known and a credential
it needs is set; every reward function imports; the replicas' vLLM flags,
derived exactly as a run derives them, pass the same LoRA capacity check a run applies to a live
replica's ``/server_info``; prompt plus completion fit the replicas' context; a token budget
below the longest sample is reported. Nothing is downloaded: model and dataset are only named.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.errors import ConfigError
from asyncgrpo.vllm.api import PLUGIN_FIX, PLUGIN_INFO_PATH

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _where(name: str) -> str:
    path = Path(name).expanduser()
    return f"local {path}" if path.exists() else "Hugging Face id, not fetched by --dry-run"


def check_lora_capacity(
    info: Mapping[str, Any], *, lora_rank: int, max_staleness: int, pinned: int = 0
) -> int:
    """Validate a ``/server_info`` document for async GRPO; return the KV block size.

    Refuses, naming the flag to change, when LoRA is off, the rank is too small, or there are
    fewer than ``max_staleness + 2`` slots, plus ``pinned`` versions an evaluation keeps
    (load-before-unload would make vLLM silently evict a policy that still has rollouts in
    flight).
    """
    config = info.get("vllm_config", info)
    lora = config.get("lora_config")
    if not lora:
        raise ConfigError("vLLM has LoRA disabled: start it with --enable-lora")
    if lora["max_lora_rank"] < lora_rank:
        raise ConfigError(
            f"vLLM --max-lora-rank is {lora['max_lora_rank']} but the adapter has r={lora_rank}: "
            "raise --max-lora-rank (allowed 1, 8, 16, 32, 64, 128, 256, 320, 512)"
        )
    need = max_staleness + 2 + pinned
    if lora["max_loras"] < need:
        held = " and one for the version an evaluation runs on (eval.every)" if pinned else ""
        raise ConfigError(
            f"vLLM --max-loras is {lora['max_loras']} but max_staleness={max_staleness} needs "
            f">= {need} (max_staleness + 2: load before unload{held}); raise --max-loras or "
            "lower max_staleness"
        )
    return int(config.get("cache_config", {}).get("block_size", 16))


def check_adapter_fetching(replicas: list[Mapping[str, Any]], transport_url: str) -> None:
    """Refuse to start unless every replica that answered runs the adapter plugin and may fetch
    from ``transport_url``; the message names the replica and the fix. A replica that could not
    be reached (status 0: it left the fleet) is not judged: the proxy replays the adapters to it
    through the plugin before it takes requests again, which fails without the plugin."""
    answered = [entry for entry in replicas if entry.get("status") != 0]
    if not answered:
        raise ConfigError("no replica answered the adapter-plugin check")
    for entry in answered:
        url, info = entry.get("url"), entry.get("info")
        if not isinstance(info, Mapping):
            raise ConfigError(
                f"replica {url} has no asyncgrpo adapter plugin ({PLUGIN_INFO_PATH} answered "
                f"{entry.get('status')}: {str(entry.get('body', ''))[:200]}): {PLUGIN_FIX}"
            )
        if not info.get("ok", False):
            raise ConfigError(f"replica {url}: {info.get('error')}")
        roots = [str(r).rstrip("/") for r in info.get("transports") or []]
        target = transport_url.rstrip("/")
        if not any(target == r or target.startswith(r + "/") for r in roots):
            raise ConfigError(
                f"replica {url} may not fetch adapters from {target} (it allows "
                f"{roots or 'no transport'}): start it with --transport {target} "
                f"(python -m asyncgrpo.serve) or ASYNCGRPO_ADAPTER_TRANSPORTS={target}"
            )


def dry_run(cfg: TrainingConfig) -> list[str]:
    """Report lines for a valid recipe; raises ``ConfigError`` naming the field to fix."""
    from asyncgrpo.config.redaction import redact_text
    from asyncgrpo.config.training import run_transport_url
    from asyncgrpo.rollout.environment import environment_class
    from asyncgrpo.rollout.rewards import load_reward_func
    from asyncgrpo.run.endpoint import replica_config
    from asyncgrpo.transport import check_transport_url

    gen, tr = cfg.generation, cfg.trainer
    lines = [f"model: {cfg.model} ({_where(cfg.model)})"]
    transport = run_transport_url(cfg)
    try:
        check_transport_url(transport)
    except ConfigError as exc:
        raise ConfigError(f"transport_url: {exc}") from None
    lines.append(f"transport: {redact_text(transport)} (not contacted by --dry-run)")
    if cfg.dataset.path is not None:
        lines.append(f"dataset: {cfg.dataset.path} ({_where(cfg.dataset.path)})")
    for path in cfg.rollout.reward_funcs:
        load_reward_func(path)  # raises ConfigError naming the path
        lines.append(f"reward function {path}: imports")
    if cfg.rollout.environment is not None:
        env = environment_class(cfg.rollout.environment)  # raises ConfigError naming the path
        if not cfg.rollout.reward_funcs and not env.provides_reward:
            raise ConfigError(
                f"rollout.environment={cfg.rollout.environment} does not score its episodes and "
                "rollout.reward_funcs is empty: set at least one reward function"
            )
        lines.append(f"environment {cfg.rollout.environment}: imports")

    max_len = cfg.serve.max_model_len
    if max_len is not None:
        if gen.max_completion_length >= max_len:
            raise ConfigError(
                f"generation.max_completion_length={gen.max_completion_length} leaves no room for "
                f"the prompt in serve.max_model_len={max_len}; raise max_model_len"
            )
        prompt_room = max_len - gen.max_completion_length
        max_prompt = cfg.dataset.max_prompt_tokens
        if max_prompt is not None and max_prompt > prompt_room:
            raise ConfigError(
                f"dataset.max_prompt_tokens={max_prompt} + generation.max_completion_length="
                f"{gen.max_completion_length} > serve.max_model_len={max_len}: set "
                f"dataset.max_prompt_tokens to at most {prompt_room}"
            )
        lines.append(
            f"context: prompts up to {max_prompt or prompt_room} + completions up to "
            f"{gen.max_completion_length} tokens <= max_model_len {max_len}"
        )
        if tr.token_budget is not None and tr.token_budget < max_len:
            lines.append(
                f"warning: trainer.token_budget={tr.token_budget} < max_model_len {max_len}: "
                "a longer sample gets a row of its own (more memory than the budget)"
            )

    if cfg.serve.replicas:
        serve = replica_config(cfg)
        argv = serve.command(port=8000)
        flags = {"max_lora_rank": int(_flag(argv, "--max-lora-rank") or 0),
                 "max_loras": int(_flag(argv, "--max-loras") or 0)}  # fmt: skip
        check_lora_capacity(
            {"lora_config": flags}, lora_rank=cfg.lora.r, max_staleness=tr.max_staleness,
            pinned=cfg.serve.pinned_versions,
        )  # fmt: skip
        lines.append(
            f"replicas: {cfg.serve.replicas} local, LoRA rank {cfg.lora.r} <= --max-lora-rank "
            f"{flags['max_lora_rank']}, {flags['max_loras']} LoRA slots >= max_staleness "
            f"{tr.max_staleness} + 2"
            + (f" + {pins} pinned by eval.every" if (pins := cfg.serve.pinned_versions) else "")
        )
        lines.append("replica command: " + shlex.join(argv[1:]))
    if cfg.proxy.upstreams:
        lines.append(
            f"{len(cfg.proxy.upstreams)} remote replica(s): their /server_info and adapter "
            "plugin are checked at start"
        )
    # each line redacted: a replica command or a dataset may quote a URL with credentials
    lines += [_step_line(cfg), *_evaluation(cfg), *_trackers(cfg)]
    return [redact_text(line) for line in lines]


def _step_line(cfg: TrainingConfig) -> str:
    gen, tr = cfg.generation, cfg.trainer
    groups, rest = divmod(tr.samples_per_step, gen.num_generations)
    return (
        f"step: {tr.samples_per_step} samples ({groups} prompts x G={gen.num_generations}"
        f"{f' + {rest}' if rest else ''}), lr {tr.learning_rate:g}, max_staleness "
        f"{tr.max_staleness}, weight_sync_steps {tr.weight_sync_steps}, {tr.max_steps} steps"
    )


def _evaluation(cfg: TrainingConfig) -> list[str]:
    """The held-out set: readable, and disjoint from the training set when it must be."""
    if cfg.eval is None:
        return []
    from asyncgrpo.evaluation.runner import eval_rows

    e = cfg.eval
    rows, _ = eval_rows(cfg)  # raises ConfigError naming the overlap
    shown = min(len(rows), e.max_prompts or len(rows))
    source = "held out of the training set" if e.holdout else "disjoint from the training set"
    during = (
        f", every {e.every} versions during training (one at a time, proxy run weight "
        f"{e.share_weight:g})"
        if e.every
        else ""
    )
    return [
        f"eval: {shown} prompts ({source}), k={e.num_generations}, temperature "
        f"{e.temperature:g}: base model before step 1{during}, final version after step "
        f"{cfg.trainer.max_steps}"
    ]


def _trackers(cfg: TrainingConfig) -> list[str]:
    """The trackers switched on: installed, and W&B with a key (or offline)."""
    import os

    from asyncgrpo.run.trackers import check_wandb_key, require_installed

    names = [n for n in ("trackio", "wandb") if getattr(cfg.logging, n)]
    for name in names:
        require_installed(name)
    if cfg.logging.wandb:
        check_wandb_key()
        mode = os.environ.get("WANDB_MODE", "online")
        return [f"trackers: {', '.join(names)} (W&B mode {mode}, files in {cfg.run_dir}/wandb)"]
    return [f"trackers: {', '.join(names)}"] if names else []


async def preflight_fleet(cfg: TrainingConfig, client: Any, transport_url: str) -> bool:
    """Refuse to start, before the trainer loads its model, when the served replicas cannot
    hold the run: LoRA off, a rank or slot count too small, or (when replicas fetch adapters
    themselves: ``serve.adapter_delivery``) no asyncgrpo vLLM plugin or no access to this
    run's transport. Returns whether the replicas fetch."""
    check_lora_capacity(
        await client.server_info(), lora_rank=cfg.lora.r,
        max_staleness=cfg.trainer.max_staleness, pinned=cfg.serve.pinned_versions,
    )  # fmt: skip
    fetching = cfg.serve.delivery(remote_replicas=bool(cfg.proxy.upstreams)) == "fetch"
    if fetching:
        check_adapter_fetching(await client.adapter_plugin_info(), transport_url)
    return fetching
