"""Checks before a run starts: ``asyncgrpo train CONFIG --dry-run``'s (:func:`dry_run`), which
every command that trains, serves or launches makes first, and the checks of the replicas once
they answer (:func:`preflight_fleet`).

What a real start would find out minutes (and a model download) later is checked by the dry
run in milliseconds: the config validates; the transport's scheme and form are known and a
credential it needs is set; the run directory and the replicas' log and cache directories can
be written; an inline or local dataset parses, every row with its prompt column; every reward
function (the evaluation's too) imports and is callable; the held-out rows read; the replicas'
vLLM flags, derived exactly as a run derives them, pass the same LoRA capacity check a run
applies to a live replica's ``/server_info``; prompt plus completion fit the replicas' context;
a token budget below the longest sample is reported. Nothing is downloaded: the model and a
``datasets`` name are only named. Once the replicas answer, :func:`preflight_fleet` compares
what they report with what the trainer will use (:func:`check_serving_agrees`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.vllm.api import PLUGIN_FIX, PLUGIN_INFO_PATH

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig


T = TypeVar("T")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _where(name: str) -> str:
    path = Path(name).expanduser()
    if path.exists():
        return f"local {path}"
    if path.is_absolute():  # a Hub id never is: a directory still to be made (the demo's model)
        return "a local path, not there yet"
    return "Hugging Face id, not fetched by --dry-run"


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


def dry_run(cfg: TrainingConfig, *, here: bool = True) -> list[str]:
    """Report lines for a valid recipe; raises ``ConfigError`` naming the field to fix.

    The same checks run first in every command that trains, serves or launches, before anything
    starts. ``here=False`` (a launch whose trainer runs on another machine): what only that
    machine can tell (the reward functions import, the directories are writable, a local
    dataset parses) is reported, not refused; the backend refuses local paths itself.
    """
    from asyncgrpo.config.paths import check_writable
    from asyncgrpo.config.redaction import redact_text
    from asyncgrpo.config.training import run_transport_url
    from asyncgrpo.rollout.dataset import local_rows
    from asyncgrpo.transport import check_transport_url

    lines = [f"model: {cfg.model} ({_where(cfg.model)})"]
    transport = run_transport_url(cfg)
    try:
        check_transport_url(transport)
    except ConfigError as exc:
        raise ConfigError(f"transport_url: {exc}") from None
    lines.append(f"transport: {redact_text(transport)} (not contacted by --dry-run)")
    rows = None
    if here:
        check_writable(cfg.run_dir, f"output_dir={cfg.output_dir}")
        lines.append(f"run directory: {cfg.run_dir} (writable)")
        if cfg.serve.replicas:
            for setting in ("log_dir", "adapter_cache_dir"):
                if (value := getattr(cfg.serve, setting)) is not None:
                    check_writable(Path(value), f"serve.{setting}={value}")
        rows = local_rows(cfg.dataset)
        if rows is not None:
            where = "inline" if cfg.dataset.path is None else f"{cfg.dataset.path}, parsed"
            lines.append(f"dataset: {len(rows)} rows ({where})")
    if cfg.dataset.path is not None and rows is None:
        lines.append(f"dataset: {cfg.dataset.path} ({_where(cfg.dataset.path)})")
    lines += _code(cfg, here=here)

    lines += _context(cfg) + _local_replicas(cfg)
    if cfg.proxy.upstreams:
        lines.append(
            f"{len(cfg.proxy.upstreams)} remote replica(s): their /server_info and adapter "
            "plugin are checked at start"
        )
    lines += [_step_line(cfg), *_evaluation(cfg), *_trackers(cfg)]
    # each line redacted: a replica command or a dataset may quote a URL with credentials
    return [redact_text(line) for line in lines]


def _context(cfg: TrainingConfig) -> list[str]:
    """Prompt plus completion within ``serve.max_model_len``; a token budget below it."""
    gen, tr = cfg.generation, cfg.trainer
    lines: list[str] = []
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
    return lines


def _local_replicas(cfg: TrainingConfig) -> list[str]:
    """The vLLM flags of the replicas the run starts, through the live LoRA capacity check."""
    from asyncgrpo.run.endpoint import replica_config

    tr = cfg.trainer
    lines: list[str] = []
    if cfg.serve.replicas:
        serve = replica_config(cfg)
        argv = serve.command(port=8000)
        flags = {
            "max_lora_rank": int(_flag(argv, "--max-lora-rank") or 0),
            "max_loras": int(_flag(argv, "--max-loras") or 0),
        }
        check_lora_capacity(
            {"lora_config": flags},
            lora_rank=cfg.lora.r,
            max_staleness=tr.max_staleness,
            pinned=cfg.serve.pinned_versions,
        )
        lines.append(
            f"replicas: {cfg.serve.replicas} local, LoRA rank {cfg.lora.r} <= --max-lora-rank "
            f"{flags['max_lora_rank']}, {flags['max_loras']} LoRA slots >= max_staleness "
            f"{tr.max_staleness} + 2"
            + (f" + {pins} pinned by eval.every" if (pins := cfg.serve.pinned_versions) else "")
        )
        lines.append("replica command: " + shlex.join(argv[1:]))
    return lines


def _code(cfg: TrainingConfig, *, here: bool) -> list[str]:
    """The reward functions (training's and the evaluation's) and the environment: each
    imports and is callable. Not ``here``: a failure is a warning line (the trainer's machine
    may have the module this one lacks)."""
    from asyncgrpo.rollout.environment import environment_class
    from asyncgrpo.rollout.rewards import load_reward_func

    paths = list(cfg.rollout.reward_funcs)
    if cfg.eval is not None and cfg.eval.reward_funcs is not None:
        paths += [p for p in cfg.eval.reward_funcs if p not in paths]
    lines = []
    for path in paths:
        try:
            load_reward_func(path)  # raises ConfigError naming the path
        except ConfigError as exc:
            if here:
                raise
            lines.append(f"warning: {exc} (here; the trainer job must be able to)")
            continue
        lines.append(f"reward function {path}: imports")
    if cfg.rollout.environment is not None:
        try:
            env = environment_class(cfg.rollout.environment)  # raises ConfigError naming it
        except ConfigError as exc:
            if here:
                raise
            return [*lines, f"warning: {exc} (here; the trainer job must be able to)"]
        if not cfg.rollout.reward_funcs and not env.provides_reward:
            raise ConfigError(
                f"rollout.environment={cfg.rollout.environment} does not score its episodes and "
                "rollout.reward_funcs is empty: set at least one reward function"
            )
        lines.append(f"environment {cfg.rollout.environment}: imports")
    return lines


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


#: What two models must share for one to serve the other's LoRA adapters.
_SHAPE = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _served_shape(model_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The served model's shape, from the text of its Hugging Face config in ``/server_info``
    (``Qwen2Config {...json...}``); None when the document does not say."""
    text = model_config.get("hf_config")
    if isinstance(text, dict):
        doc: Any = text
    elif isinstance(text, str) and "{" in text:
        try:
            doc = json.loads(text[text.index("{") :])
        except ValueError:
            return None
    else:
        return None
    return {k: doc.get(k) for k in _SHAPE} if isinstance(doc, dict) else None


def _dtype_name(value: Any) -> str | None:
    return str(value).removeprefix("torch.") if value not in (None, "", "auto") else None


def check_serving_agrees(
    info: Mapping[str, Any],
    cfg: TrainingConfig,
    *,
    trainer_dtype: str | None,
    trainer_shape: Callable[[], Mapping[str, Any] | None] = lambda: None,
) -> list[str]:
    """Compare what a replica reports in ``/server_info`` with what the trainer will use: the
    model, its dtype and the context length (the LoRA rank and slots:
    :func:`check_lora_capacity`). Refuses, naming the flag or setting to change, what would
    fail later (the served-policy audit on other weights, a prompt that does not fit); returns
    the lines saying what agreed, and warnings for what is allowed but worth knowing.
    ``trainer_shape`` gives the trainer's model config (read only when the names differ)."""
    config = info.get("vllm_config", info)
    model_config = config.get("model_config") if isinstance(config, Mapping) else None
    if not isinstance(model_config, Mapping):
        return []  # an older vLLM, or a proxy that does not forward the document
    lines = []
    served = model_config.get("model")
    if isinstance(served, str) and served != cfg.model:
        ours, theirs = trainer_shape(), _served_shape(model_config)
        if ours is not None and theirs is not None:
            differ = [k for k in _SHAPE if ours.get(k) != theirs.get(k)]
            if differ:
                shown = ", ".join(f"{k} {theirs.get(k)} != {ours.get(k)}" for k in differ)
                raise ConfigError(
                    f"the replicas serve model {served}, not the trainer's model={cfg.model} "
                    f"({shown}): start them with --model {cfg.model} (python -m asyncgrpo.serve), "
                    f"or set model to the one they serve"
                )
        lines.append(f"served model: {served} (the trainer loads {cfg.model}; same shape)")
    served_dtype = _dtype_name(model_config.get("dtype"))
    if served_dtype and trainer_dtype and served_dtype != trainer_dtype:
        mismatch = (
            f"the replicas serve {served_dtype} (vLLM --dtype) but the trainer computes in "
            f"{trainer_dtype} (trainer.dtype), so their logprobs differ by more than the "
            "served-policy audit's tolerance"
        )
        fix = (
            f"start the replicas with --dtype {trainer_dtype} (python -m asyncgrpo.serve, "
            f"serve.dtype) or set trainer.dtype={served_dtype}"
        )
        if cfg.trainer.audit.action != "off":
            raise ConfigError(f"{mismatch}: {fix} (or trainer.audit.action=off to train anyway)")
        lines.append(f"warning: {mismatch}; {fix}")
    elif served_dtype:
        lines.append(f"dtype: {served_dtype} on the replicas and in the trainer")
    context = model_config.get("max_model_len")
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        completion = cfg.generation.max_completion_length
        prompt = cfg.dataset.max_prompt_tokens
        if completion >= context or (prompt is not None and prompt + completion > context):
            need = f"{prompt} + " if prompt is not None else ""
            raise ConfigError(
                f"the replicas' context is {context} tokens (vLLM --max-model-len) but the run "
                f"needs {need}generation.max_completion_length={completion}: start them with "
                f"a larger --max-model-len (serve.max_model_len), or lower "
                "generation.max_completion_length"
                + (" or dataset.max_prompt_tokens" if prompt is not None else "")
            )
        lines.append(f"context: {context} tokens on the replicas >= completions of {completion}")
    return lines


async def preflight_fleet(
    cfg: TrainingConfig,
    client: Any,
    transport_url: str,
    *,
    trainer_dtype: str | None = None,
    say: Callable[[str], None] | None = None,
) -> bool:
    """Refuse to start, before the trainer loads its model, when the served replicas cannot
    hold the run or do not agree with the trainer: LoRA off, a rank or slot count too small,
    another model, dtype (``trainer_dtype``: a run's; None: not compared) or a context too
    short (:func:`check_serving_agrees`), or (when replicas fetch adapters themselves:
    ``serve.adapter_delivery``) no asyncgrpo vLLM plugin or no access to this run's
    transport. ``say`` hears what agreed. Returns whether the replicas fetch."""
    info = await _slow_named(client.server_info(), client, "GET /server_info")
    check_lora_capacity(
        info,
        lora_rank=cfg.lora.r,
        max_staleness=cfg.trainer.max_staleness,
        pinned=cfg.serve.pinned_versions,
    )
    agreed = await anyio.to_thread.run_sync(
        lambda: check_serving_agrees(
            info,
            cfg,
            trainer_dtype=trainer_dtype,
            trainer_shape=lambda: _trainer_shape(cfg.model),
        )
    )
    for line in agreed:
        if say is not None:
            say(line)
    fetching = cfg.serve.delivery(remote_replicas=bool(cfg.proxy.upstreams)) == "fetch"
    if fetching:
        replicas = await _slow_named(client.adapter_plugin_info(), client, "the plugin check")
        check_adapter_fetching(replicas, transport_url)
    return fetching


async def _slow_named(call: Awaitable[T], client: Any, what: str) -> T:
    """``await call``; a time-out becomes an error naming the setting that bounds it."""
    try:
        return await call
    except ReplicaError as exc:
        if not isinstance(exc.__cause__, TimeoutError):
            raise
        timeout = getattr(client, "timeout_s", None)
        within = f" within {timeout:.0f} s" if timeout else ""
        raise ReplicaError(
            f"{what} through {client.base_url} got no answer{within}: the replicas are slow to "
            "answer their first requests on a busy host (that time-out is twice their start "
            "time, at most serve.startup_timeout_s); raise serve.startup_timeout_s, or free "
            "the host"
        ) from exc


def _trainer_shape(model: str) -> dict[str, Any] | None:
    """The shape of the model the trainer will load, from its config (a small file)."""
    try:
        from transformers import AutoConfig

        doc = AutoConfig.from_pretrained(model).to_dict()
    except Exception:  # not readable here yet: the trainer's own load says why
        return None
    return {k: doc.get(k) for k in _SHAPE}
