"""The redactor hides credentials and nothing else: a list of accepted URL forms stays whole
beside real-looking secrets in the same text."""

from __future__ import annotations

import pytest

from asyncgrpo.config.redaction import REDACTED, has_credentials, redact_text, redact_url
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport import open_transport
from asyncgrpo.transport.registry import ACCEPTED_FORMS

# Real-looking, not real: AWS's documented example pair, a Hugging Face token's shape.
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
HF_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345678"
SECRETS = {
    AWS_KEY_ID: f"key id {AWS_KEY_ID}",
    AWS_SECRET: f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}",
    HF_TOKEN: f"token {HF_TOKEN} and HF_TOKEN={HF_TOKEN}",
    "hunter2": "upstream https://alice:hunter2@replica.example:8000/v1",
    "sv0ZtL%2Bk%3D": "sas https://acct.blob.core.windows.net/c?sv=2024-01-01&sig=sv0ZtL%2Bk%3D",
    "p4ss": "ASYNCGRPO_PROXY__API_KEY=p4ss",
}


def test_the_accepted_forms_survive_beside_real_looking_credentials() -> None:
    forms = ", ".join(ACCEPTED_FORMS)
    text = f"cannot open ftp://x; accepted: {forms}; " + "; ".join(SECRETS.values())
    out = redact_text(text)
    assert forms in out, out  # every scheme example intact: s3://bucket[/prefix], gs://, az://
    for secret in SECRETS:
        assert secret not in out, secret
    assert "https://alice:REDACTED@replica.example:8000/v1" in out
    assert "sv=2024-01-01&sig=REDACTED" in out and "AWS_SECRET_ACCESS_KEY=REDACTED" in out
    assert out.count(REDACTED) == 7


def test_an_unknown_scheme_error_lists_every_scheme() -> None:
    """The issue's message: the transport's own error, redacted as every error is."""
    with pytest.raises(ConfigError) as info:
        open_transport("ftp://x")
    shown = redact_text(str(info.value))
    for form in ("s3://bucket[/prefix]", "gs://bucket[/prefix]", "az://container[/prefix]"):
        assert form in shown, shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("s3://bucket[/prefix]", "s3://bucket[/prefix]"),  # urlsplit refuses the bracket
        ("https://u:pa[ss@host/p", f"https://u:{REDACTED}@host/p"),  # and hid it all
        ("https://[::1]:8000/x?token=t#frag", f"https://[::1]:8000/x?token={REDACTED}#{REDACTED}"),
        ("/plain/path?sig=s", f"/plain/path?sig={REDACTED}"),
        ("http://h/p?", "http://h/p?"),
    ],
)
def test_a_url_keeps_all_but_its_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert has_credentials(url) is (shown != url)


def test_prose_and_tokenizer_settings_are_not_secrets() -> None:
    text = "pad_token=<eos> max_tokens=32 a bearer credential hf_jobs_backend model=org/name"
    assert redact_text(text) == text
