"""Server-flag checks against /server_info documents shaped like vLLM 0.32's."""

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.vllm_client import check_lora_capacity


def info(lora: dict | None, block_size: int = 128) -> dict:
    return {"vllm_config": {"lora_config": lora, "cache_config": {"block_size": block_size}}}


def test_accepts_enough_slots_and_returns_block_size() -> None:
    assert (
        check_lora_capacity(
            info({"max_lora_rank": 8, "max_loras": 4}), lora_rank=8, max_staleness=2
        )
        == 128
    )


@pytest.mark.parametrize(
    ("lora", "flag"),
    [
        (None, "--enable-lora"),
        ({"max_lora_rank": 8, "max_loras": 6}, "--max-lora-rank"),
        ({"max_lora_rank": 16, "max_loras": 3}, "--max-loras"),
    ],
)
def test_refuses_naming_the_flag(lora: dict | None, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        check_lora_capacity(info(lora), lora_rank=16, max_staleness=2)
