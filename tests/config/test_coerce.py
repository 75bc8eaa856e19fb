"""Values checked against their fields: ranges and choices, however a config was built."""

from __future__ import annotations

import pytest

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.errors import ConfigError


def test_check_fields_names_the_rule_and_allows_none() -> None:
    from asyncgrpo.config.trainer import TrainerConfig
    from asyncgrpo.serve import ServeConfig

    with pytest.raises(ConfigError, match=r"^trainer\.max_steps=0: must be >= 1$"):
        TrainerConfig(max_steps=0)
    with pytest.raises(ConfigError, match=r"^trainer\.token_budget=0: must be >= 1, or None$"):
        TrainerConfig(token_budget=0)
    assert TrainerConfig(token_budget=None).token_budget is None
    with pytest.raises(ConfigError, match=r"^trainer\.dtype='fp8': use one of 'auto'"):
        TrainerConfig(dtype="fp8")  # a Literal is checked on direct construction too
    with pytest.raises(ConfigError, match=r"^serve\.nice=20: must be <= 19$"):
        ServeConfig(model="m", nice=20)
    with pytest.raises(ConfigError, match=r"^proxy\.connect_timeout_s=0: must be > 0$"):
        ProxyConfig(connect_timeout_s=0)
