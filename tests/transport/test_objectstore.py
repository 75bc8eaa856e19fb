"""The shared obstore base: error text never carries a credential."""

from __future__ import annotations

from asyncgrpo.config.redaction import redact_text as redact


def test_redact_blanks_signatures_and_keys() -> None:
    text = (
        "Error performing GET https://a.blob.core.windows.net/c/k?sv=2024&sig=AbC%2B%3D&se=x "
        "X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA/1 AccountKey=a2V5==;AccountName=a"
    )
    out = redact(text)
    for secret in ("AbC%2B%3D", "deadbeef", "AKIA/1", "a2V5=="):
        assert secret not in out
    assert "sig=REDACTED" in out and "sv=2024" in out and "AccountName=a" in out
