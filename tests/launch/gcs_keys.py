"""Google service-account key files for launch tests: obstore parses a key's RSA private key
when a GCS store is built, so a made-up string would not open one."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


@functools.cache
def private_key() -> str:
    """One real RSA key (PEM, PKCS#8) per test session."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem.decode()


def key_file(path: Path, kind: str = "service_account") -> Path:
    """A key file of ``kind`` (``authorized_user``: what ``gcloud auth application-default
    login`` writes) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "type": kind,
        "project_id": "p",
        "private_key_id": "k1",
        "private_key": private_key(),
        "client_email": "sa@p.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    path.write_text(json.dumps(data))
    return path
