"""A run's booking on the proxy is held by a token kept in its run directory."""

from __future__ import annotations

import stat
from pathlib import Path

from asyncgrpo.run.training import _booking_token


def test_the_token_is_drawn_once_kept_private_and_read_back_on_restart(tmp_path: Path) -> None:
    token = _booking_token(tmp_path)
    assert len(token) >= 32 and token.isprintable() and " " not in token
    path = tmp_path / "proxy-booking-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _booking_token(tmp_path) == token  # a restarted run takes its booking back


def test_an_empty_token_file_gets_a_new_token(tmp_path: Path) -> None:
    (tmp_path / "proxy-booking-token").write_text("")
    assert len(_booking_token(tmp_path)) >= 32
