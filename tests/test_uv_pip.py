"""tools/uv_pip.py: the Makefile's installs through uv keep this machine's pip configuration."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "uv_pip", Path(__file__).parents[1] / "tools" / "uv_pip.py"
)
assert spec and spec.loader
uv_pip = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_pip)

# `pip config list` as this machine prints it: a site file, a user file and PIP_* variables.
LISTING = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
global.timeout='60'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels /srv/more-wheels'
install.index-url='https://user:token@mirror.example/simple'
"""


def test_every_setting_uv_needs_is_read_and_a_variable_overrides_a_file() -> None:
    assert uv_pip.pip_settings(LISTING) == {
        "cert": ["/etc/ssl/certs/ca-certificates.crt"],
        "constraint": ["/etc/xdg/pip/constraints.txt"],
        "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple"],
        "find-links": ["/opt/wheels", "/srv/more-wheels"],
        "index-url": ["https://user:token@mirror.example/simple"],
    }


def test_settings_become_uv_variables_in_uvs_separators_and_a_set_variable_wins() -> None:
    env = uv_pip.uv_environment(
        uv_pip.pip_settings(LISTING), {"PATH": "/bin", "UV_CONSTRAINT": "/mine.txt"}
    )
    assert env == {
        "PATH": "/bin",
        "UV_CONSTRAINT": "/mine.txt",
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
        "UV_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "UV_FIND_LINKS": "/opt/wheels,/srv/more-wheels",
        "UV_INDEX_URL": "https://user:token@mirror.example/simple",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
    }


def test_no_pip_configuration_leaves_uv_its_own_defaults_but_pips_index_rule() -> None:
    assert uv_pip.uv_environment(uv_pip.pip_settings(""), {}) == {
        "UV_INDEX_STRATEGY": "unsafe-best-match"
    }
