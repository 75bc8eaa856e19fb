"""Replicas that fetch each sampler version from the transport themselves (replicas elsewhere):
nothing of the service's disk is sent to them."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm  # real vLLM replicas


@contextlib.contextmanager
def _fleet(replicas: list, model: Path, work: Path, **overrides: object) -> Iterator[str]:
    from anyio.from_thread import start_blocking_portal

    from asyncgrpo.proxy import ProxyConfig, serve_proxy
    from asyncgrpo.tinker import TinkerConfig, serve_tinker

    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        proxy_cfg = ProxyConfig(upstreams=tuple(r.url for r in replicas), port=0)
        proxy_url = stack.enter_context(portal.wrap_async_context_manager(serve_proxy(proxy_cfg)))
        config = TinkerConfig(
            model=str(model),
            port=0,
            max_lora_rank=8,
            proxy_url=proxy_url,
            work_dir=str(work),
            sampler_keep=1,
            **overrides,
        )
        yield stack.enter_context(portal.wrap_async_context_manager(serve_tinker(config)))


def test_replicas_fetch_sampler_weights_from_the_transport(
    vllm_replicas: list, tiny_model: Path, tmp_path: Path, tmp_path_factory
) -> None:
    import tinker
    from tinker import types

    work, store = tmp_path / "work", tmp_path / "transport"  # the replicas may fetch from it
    with _fleet(
        vllm_replicas, tiny_model, work, transport_url=str(store), adapter_delivery="fetch"
    ) as url:
        service = tinker.ServiceClient(base_url=url)
        training = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
        tokenizer = training.get_tokenizer()
        ids = tokenizer.encode("12 + 7 = 19")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:]},
        )
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("12 + 7 ="))
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=0)).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) > 0 for s in out.sequences)
        fetched = list(
            tmp_path_factory.getbasetemp().glob("replica-adapters*/**/adapter_config.json")
        )
        assert fetched, "no replica fetched a version into its own cache"
        assert not (work / "cache").exists()  # no copy on the service's disk was made for them
        service.close("success").result()


def test_fetch_from_a_transport_the_replicas_may_not_read_is_refused_at_start(
    vllm_replicas: list, tiny_model: Path, tmp_path: Path
) -> None:
    from asyncgrpo.errors import ConfigError

    with tempfile.TemporaryDirectory() as elsewhere:  # outside what the replicas allow
        with pytest.raises(ConfigError, match=r"may not fetch adapters from .*--transport"):
            with _fleet(
                vllm_replicas,
                tiny_model,
                tmp_path,
                transport_url=elsewhere,
                adapter_delivery="fetch",
            ):
                pass
