"""The service's session, capability, model-creation and future routes, through the real SDK."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_capabilities_and_health_name_the_served_model(served) -> None:
    import tinker

    rest = tinker.RestClient(base_url=served.url)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [served.model]
    assert caps.supported_models[0].trainable is True


def test_a_training_client_reports_its_model_and_tokenizer(service_client, served) -> None:
    training = service_client.create_lora_training_client(
        base_model=served.model, rank=4, seed=3
    ).result()
    info = training.get_info()
    assert info.lora_rank == 4 and info.is_lora and info.model_name == served.model
    tokenizer = training.get_tokenizer()  # loaded from the served directory, offline
    assert tokenizer.decode(tokenizer.encode("12 + 7")) == "12 + 7"
    other = service_client.create_lora_training_client(base_model=served.model, rank=2).result()
    assert other.model_id != training.model_id


def test_an_unknown_base_model_is_a_bad_request_naming_the_served_one(service_client, served):
    import tinker

    with pytest.raises(
        tinker.BadRequestError, match=rf"'Qwen/Qwen3-8B' is not served.*{served.model}"
    ):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_a_rank_above_the_bound_is_a_bad_request(service_client, served) -> None:
    import tinker

    with pytest.raises(tinker.BadRequestError, match=r"rank=64: .* ranks 1 to 8"):
        service_client.create_lora_training_client(base_model=served.model, rank=64).result()


def test_heartbeats_and_futures_through_the_sdk_client(service_client, served) -> None:
    import anyio
    import tinker
    from tinker import types
    from tinker._client import AsyncTinker

    plain = types.ClientConfigResponse(use_pyqwest_transport=False)

    async def body() -> None:
        key = os.environ["TINKER_API_KEY"]
        async with AsyncTinker(base_url=served.url, api_key=key, _client_config=plain) as client:
            session = await client.service.create_session(
                request=types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="test")
            )
            await client.service.session_heartbeat(session_id=session.session_id)
            with pytest.raises(tinker.APIStatusError) as gone:
                await client.service.session_heartbeat(session_id="s-never-made")
            assert gone.value.status_code == 410  # the SDK's heartbeat loop stops on 410
            with pytest.raises(tinker.NotFoundError, match="no request 'req-nope'"):
                await client.futures.retrieve(
                    request=types.FutureRetrieveRequest(request_id="req-nope")
                )

    anyio.run(body)


def test_a_key_is_required_when_configured(tiny_model: Path, start_service, monkeypatch) -> None:
    import tinker

    with start_service(tiny_model, api_key="tml-the-right-key") as served:
        monkeypatch.setenv("TINKER_API_KEY", "tml-a-wrong-key")
        with pytest.raises(tinker.AuthenticationError, match="wrong API key"):
            tinker.ServiceClient(base_url=served.url).create_lora_training_client(
                base_model=served.model, rank=1
            ).result()
        monkeypatch.setenv("TINKER_API_KEY", "tml-the-right-key")
        client = tinker.ServiceClient(base_url=served.url)
        training = client.create_lora_training_client(base_model=served.model, rank=1).result()
        assert training.get_info().lora_rank == 1
        client.close("success").result()


def test_requests_from_web_pages_are_refused(served) -> None:
    import anyio
    import httpx

    async def body() -> None:
        async with httpx.AsyncClient() as client:
            r = await client.get(
                f"{served.url}/api/v1/healthz", headers={"Origin": "https://evil.example"}
            )
            assert r.status_code == 403
            assert (await client.get(f"{served.url}/api/v1/healthz")).json() == {"status": "ok"}

    anyio.run(body)


def test_config_refuses_a_public_bind_without_a_key() -> None:
    from asyncgrpo.errors import ConfigError
    from asyncgrpo.tinker import TinkerConfig

    with pytest.raises(ConfigError, match="set TINKER_API_KEY"):
        TinkerConfig(model="m", host="0.0.0.0")
    with pytest.raises(ConfigError, match="must start with 'tml-'"):
        TinkerConfig(model="m", api_key="sk-abc")
    assert "tml-x" not in repr(TinkerConfig(model="m", host="0.0.0.0", api_key="tml-x"))
