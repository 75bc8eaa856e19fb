"""The trainer side of the service: one base model, one LoRA adapter and AdamW per client.

The base model is loaded once by the trainer's own ``load_policy``; every training client adds
a peft adapter of its own rank to it (named by its model id) and gets an AdamW over that
adapter's weights only. Before each request the client's adapter is made the active one, so
clients never see each other's weights, and gradients accumulate in each adapter's own
parameters across ``forward_backward`` calls until that client's ``optim_step``.

Called from one worker thread at a time (the service's scheduler), never concurrently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncgrpo.config.trainer import LoraConfig
from asyncgrpo.tinker.losses import LossInputError, check_inputs, check_loss, token_loss
from asyncgrpo.tinker.provenance import check_tiling
from asyncgrpo.tinker.wire import FwdBwdRequest, FwdBwdResult, WireDatum
from asyncgrpo.trainer.attention import varlen_kwargs
from asyncgrpo.trainer.checkpoint import save_torch
from asyncgrpo.trainer.model import autocast, load_policy, model_device
from asyncgrpo.trainer.packing import plan_rows, restarting_positions

__all__ = ["AdamStep", "Engine", "LoraSpec", "StateError", "read_state"]

STATE_FILE = "tinker_state.pt"
_STATE_FORMAT = "asyncgrpo-tinker-state-1"


class StateError(ValueError):
    """A saved state that does not fit the client loading it (another rank or layers)."""


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool


@dataclass(frozen=True)
class AdamStep:
    """One ``optim_step``'s ``AdamParams``."""

    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


@dataclass
class _Client:
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


def read_state(directory: Path) -> dict[str, Any]:
    """The state :meth:`Engine.save_state` wrote into ``directory`` (tensors on the CPU)."""
    return torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)


def target_modules(model: torch.nn.Module, *, mlp: bool, attn: bool) -> list[str]:
    """The names (last path component) of the base model's linear layers in its MLP and/or
    attention blocks; never the LM head (vLLM's runtime LoRA does not serve it)."""
    names: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or "lora_" in path:
            continue
        parts = path.split(".")
        if parts[-1] == "base_layer":  # already wrapped by another client's adapter
            parts = parts[:-1]
        in_attn = any("attn" in p or "attention" in p for p in parts[:-1])
        in_mlp = any("mlp" in p for p in parts[:-1])
        if (attn and in_attn) or (mlp and in_mlp):
            names.add(parts[-1])
    return sorted(names)


class Engine:
    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str,
        lora_alpha: float,
        token_budget: int = 4096,
        device: torch.device | None = None,
    ) -> None:
        self.model: Any = load_policy(model_path, LoraConfig(r=1), dtype=dtype, device=device)
        #: tokens per packed forward of ``forward_backward``: bounds its activations and logits
        self.token_budget = token_budget
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.lora_alpha = lora_alpha
        self._clients: dict[str, _Client] = {}

    @property
    def dtype_name(self) -> str:
        """The dtype ``auto`` resolved to (``float32``...), which replicas it starts serve at."""
        return str(self.model.dtype).removeprefix("torch.")

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add client ``model_id``'s adapter (seeded by ``spec.seed``) and its optimizer."""
        from peft import LoraConfig as PeftLoraConfig

        base = self.model.get_base_model()
        targets = target_modules(base, mlp=spec.train_mlp, attn=spec.train_attn)
        if not targets:
            raise LossInputError("train_mlp and train_attn are both False: LoRA needs one")
        config = PeftLoraConfig(
            task_type="CAUSAL_LM",
            r=spec.rank,
            lora_alpha=self.lora_alpha,
            target_modules=targets,
            lora_dropout=0.0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed if spec.seed is not None else 0)
            self.model.add_adapter(model_id, config)
        params = [p for n, p in self.model.named_parameters() if f".{model_id}." in n]
        optimizer = torch.optim.AdamW(
            params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
        )
        self._clients[model_id] = _Client(spec=spec, params=params, optimizer=optimizer)

    def remove(self, model_id: str) -> None:
        """Drop the client's adapter and optimizer (a finished session's)."""
        if self._clients.pop(model_id, None) is not None:
            if self.model.active_adapter == model_id:
                self.model.set_adapter("default")  # peft warns when the active one goes
            self.model.delete_adapter(model_id)

    def has(self, model_id: str) -> bool:
        return model_id in self._clients

    def _activate(self, model_id: str) -> _Client:
        client = self._clients[model_id]
        self.model.set_adapter(model_id)
        return client

    def check(self, request: FwdBwdRequest) -> None:
        """Refuse a request whose loss, config or datums this model cannot take (no torch work:
        safe to call from any thread). Provenance spans are accepted on every loss; they must
        tile their fields, and a loss that reads the sampler's record needs them on every
        datum."""
        spec = check_loss(request.loss_fn, request.loss_fn_config)
        for i, datum in enumerate(request.data):
            check_inputs(request.loss_fn, int(datum.tokens.size), datum.inputs, i)
            for what, arr in (
                ("model_input", datum.tokens),
                ("target_tokens", datum.inputs["target_tokens"]),
            ):
                if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
                    raise LossInputError(
                        f"datum {i}: {what} has a token id outside the "
                        f"model's vocabulary [0, {self.vocab_size})"
                    )
            if datum.target_spans is not None and datum.input_spans is not None:
                check_tiling(datum.input_spans, int(datum.tokens.size), "model_input", i)
                check_tiling(datum.target_spans, int(datum.tokens.size), "loss_fn_inputs", i)
            elif spec.provenance:
                raise LossInputError(
                    f"datum {i} has no provenance: loss {request.loss_fn} reads what the sampler "
                    "recorded, so every datum must name its sampled sequences "
                    "(Datum.with_provenance, with the sequence_id of each SampledSequence)"
                )

    def _row_logprobs(self, data: Sequence[WireDatum]) -> list[torch.Tensor]:
        """Each datum's logprob of every ``target_tokens[i]`` given ``model_input[: i + 1]``
        (with grad), from one forward over the datums packed into one row: positions restart
        at 0 for each and varlen attention keeps each datum to its own tokens, as the trainer's
        packed rows do."""
        device = model_device(self.model)
        lens = [int(d.tokens.size) for d in data]
        ids = torch.as_tensor(np.concatenate([d.tokens for d in data]), device=device).long()
        targets = np.concatenate([d.inputs["target_tokens"] for d in data])
        targets_t = torch.as_tensor(targets, device=device).long()
        with autocast(self.model, device):
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=restarting_positions(lens).to(device).unsqueeze(0),
                use_cache=False,
                **varlen_kwargs(lens, device),
            )
        logits = out.logits[0].float()
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets_t.unsqueeze(-1)).squeeze(-1) - lse
        return list(torch.split(logp, lens))

    def _pass(
        self, request: FwdBwdRequest, indices: Sequence[int], outputs: list[dict[str, np.ndarray]]
    ) -> list[float]:
        """One forward (and, unless ``forward_only``, one backward of the row's summed loss)
        over the datums ``indices``; fills their ``outputs`` and returns their losses."""
        data = [request.data[i] for i in indices]
        logps = self._row_logprobs(data)
        losses = []
        for datum, logp in zip(data, logps, strict=True):
            inputs = {k: torch.as_tensor(v, device=logp.device) for k, v in datum.inputs.items()}
            if datum.trained is not None:
                inputs["trained"] = torch.as_tensor(datum.trained, device=logp.device)
            losses.append(token_loss(request.loss_fn, logp, inputs, request.loss_fn_config))
        sums = torch.stack([loss_t.sum() for loss_t in losses])
        if not request.forward_only:
            sums.sum().backward()
        lens = [int(d.tokens.size) for d in data]
        logp_np = torch.cat(logps).detach().cpu().numpy()
        loss_np = torch.cat(losses).detach().cpu().numpy()
        cuts = np.cumsum(lens)[:-1]
        for i, lp, el in zip(
            indices, np.split(logp_np, cuts), np.split(loss_np, cuts), strict=True
        ):
            outputs[i] = {"logprobs": lp, "elementwise_loss": el}
        return [float(x) for x in sums.detach().cpu().tolist()]

    def forward_backward(self, request: FwdBwdRequest) -> FwdBwdResult:
        """The loss and logprobs of every datum; unless ``forward_only``, the gradient of the
        summed loss is added to the client's adapter (all datums checked before any).

        The datums are packed into as few rows as ``token_budget`` allows (the trainer's
        ``plan_rows``), one forward and one backward per row: a request of many short datums
        costs a few forwards, not one per datum."""
        self.check(request)
        self._activate(request.model_id)
        lengths = [int(d.tokens.size) for d in request.data]
        empty = {"logprobs": np.zeros(0, np.float32), "elementwise_loss": np.zeros(0, np.float32)}
        outputs: list[dict[str, np.ndarray]] = [dict(empty) for _ in request.data]
        losses = [0.0] * len(request.data)
        nonempty = [i for i, n in enumerate(lengths) if n]  # nothing to forward for no tokens
        rows = plan_rows(
            [lengths[i] for i in nonempty],
            token_budget=self.token_budget,
            budget_setting="tinker.token_budget",
        )
        with torch.set_grad_enabled(not request.forward_only):
            for row in rows:
                indices = [nonempty[k] for k in row]
                for i, loss in zip(indices, self._pass(request, indices, outputs), strict=True):
                    losses[i] = loss
        return FwdBwdResult(outputs=outputs, metrics={"loss:sum": sum(losses)})

    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        """One AdamW step of the client's accumulated gradient, which is then cleared."""
        client = self._activate(model_id)
        for group in client.optimizer.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        grads = [p.grad for p in client.params if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if step.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(
                client.params, step.grad_clip_norm, torch.tensor(norm)
            )
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return {"grad_norm:mean": norm}

    def save_adapter(self, model_id: str, directory: Path) -> Path:
        """Write the client's adapter as a plain PEFT directory (what vLLM loads); its path."""
        self.model.save_pretrained(
            str(directory), selected_adapters=[model_id], safe_serialization=True
        )
        return directory / model_id  # peft writes a named adapter under its name

    def save_state(self, model_id: str, directory: Path) -> None:
        """Write the client's adapter, AdamW state and step count into ``directory``."""
        client = self._clients[model_id]
        names = [
            n.replace(f".{model_id}.", ".{adapter}.")
            for n, p in self.model.named_parameters()
            if f".{model_id}." in n
        ]
        state = {
            "format": _STATE_FORMAT,
            "rank": client.spec.rank,
            "adapter": {n: p.detach().cpu() for n, p in zip(names, client.params, strict=True)},
            "optimizer": client.optimizer.state_dict(),
            "steps": client.steps,
        }
        directory.mkdir(parents=True, exist_ok=True)
        save_torch(state, directory / STATE_FILE)

    def load_state(self, model_id: str, directory: Path, *, optimizer: bool) -> None:
        """Restore a :meth:`save_state` into the client (its AdamW state too if ``optimizer``,
        else a fresh AdamW); StateError if it was saved from another LoRA shape."""
        self.apply_state(model_id, read_state(directory), optimizer=optimizer)

    def apply_state(self, model_id: str, state: dict[str, Any], *, optimizer: bool) -> None:
        """:meth:`load_state` of a state already read (:func:`read_state`): what data-parallel
        ranks receive from rank 0, which alone reads the file."""
        client = self._clients[model_id]
        names = [
            n.replace(f".{model_id}.", ".{adapter}.")
            for n, p in self.model.named_parameters()
            if f".{model_id}." in n
        ]
        saved = state.get("adapter", {})
        if (
            state.get("format") != _STATE_FORMAT
            or set(saved) != set(names)
            or any(saved[n].shape != p.shape for n, p in zip(names, client.params, strict=True))
        ):
            raise StateError(
                f"the saved state (LoRA rank {state.get('rank')}) does not fit this "
                f"client (rank {client.spec.rank}, its layers): load it into a "
                "client made with the same rank, train_mlp and train_attn"
            )
        with torch.no_grad():
            for n, p in zip(names, client.params, strict=True):
                p.copy_(saved[n])
        client.optimizer = torch.optim.AdamW(
            client.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
        )
        if optimizer:
            client.optimizer.load_state_dict(state["optimizer"])
            client.steps = int(state["steps"])

    def params(self, model_id: str) -> list[torch.nn.Parameter]:
        """The client's adapter parameters (what its AdamW steps)."""
        return self._clients[model_id].params

    def spec(self, model_id: str) -> LoraSpec:
        return self._clients[model_id].spec

    def steps(self, model_id: str) -> int:
        return self._clients[model_id].steps

    def rank(self, model_id: str) -> int:
        return self._clients[model_id].spec.rank
