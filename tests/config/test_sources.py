"""Settings from the environment and from overrides: typed by the fields, a misspelt key named
with its close match."""

from __future__ import annotations

import pytest

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.config.sources import env_overrides
from asyncgrpo.errors import ConfigError


def test_environment_list_and_errors() -> None:
    env = {"P_UPSTREAMS": "http://a:1,http://b:2", "P_PORT": "x"}
    with pytest.raises(ConfigError, match="P_PORT='x': expected an integer"):
        env_overrides(ProxyConfig, {}, "P_", env)
    data = env_overrides(ProxyConfig, {}, "P_", {"P_UPSTREAMS": env["P_UPSTREAMS"]})
    assert data == {"upstreams": ["http://a:1", "http://b:2"]}


def test_a_misspelt_key_names_the_close_match_from_every_source(tmp_path) -> None:
    """One message for a YAML key, an override and an environment variable: the valid keys and
    the one meant, spelt as the user would type it."""
    from asyncgrpo.config.training import TrainingConfig

    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndataset: {prompts: [hi]}\ntrainer: {learnig_rate: 0.1}\n")
    typo = r"unknown key 'trainer.learnig_rate'; valid keys are: .*learning_rate.*"
    with pytest.raises(ConfigError, match=typo + r"; did you mean 'learning_rate'\?$"):
        TrainingConfig.from_yaml(path, environ={})
    path.write_text("model: m\ndataset: {prompts: [hi]}\n")
    with pytest.raises(ConfigError, match=typo + r"; did you mean 'learning_rate'\?$"):
        TrainingConfig.from_yaml(path, ["trainer.learnig_rate=0.1"], environ={})
    env = {"ASYNCGRPO_TRAINER__LEARNIG_RATE": "0.1"}
    with pytest.raises(
        ConfigError,
        match=r"^ASYNCGRPO_TRAINER__LEARNIG_RATE is set, but "
        + typo
        + r"; did you mean ASYNCGRPO_TRAINER__LEARNING_RATE\?$",
    ):
        TrainingConfig.from_yaml(path, environ=env)
    with pytest.raises(ConfigError, match=r"valid keys are: [a-z0-9_, ]*$"):
        TrainingConfig.from_yaml(path, ["trainer.zzzzzz=1"], environ={})  # nothing close


def test_variables_that_name_no_section_or_are_empty_are_not_refused(tmp_path) -> None:
    """Other programs' ASYNCGRPO_ variables (the job's config, the debug switch) and an empty
    value (unset, to a shell) are not settings; a flat config shares its prefix, so is not
    checked."""
    from asyncgrpo.config.training import TrainingConfig

    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndataset: {prompts: [hi]}\n")
    env = {
        "ASYNCGRPO_CONFIG": "x",
        "ASYNCGRPO_DEBUG": "1",
        "ASYNCGRPO_TRAINER__LEARNIG_RATE": "",
        "ASYNCGRPO_NOSECTION__X": "1",
    }
    assert TrainingConfig.from_yaml(path, environ=env).model == "m"
    assert env_overrides(ProxyConfig, {}, "ASYNCGRPO_PROXY_", {"ASYNCGRPO_PROXY__X": "1"}) == {}
