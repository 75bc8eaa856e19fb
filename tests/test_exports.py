"""The public namespace: sorted, importable, and light (no torch for the proxy's users)."""

import subprocess
import sys

import asyncgrpo


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert asyncgrpo.__all__ == sorted(asyncgrpo.__all__)
    for name in asyncgrpo.__all__:
        assert getattr(asyncgrpo, name) is not None, name


def test_proxy_and_transports_do_not_load_torch() -> None:
    code = (
        "import sys, asyncgrpo;"
        "asyncgrpo.serve_proxy; asyncgrpo.ProxyConfig; asyncgrpo.open_transport;"
        "asyncgrpo.AdapterStore; asyncgrpo.TrainingConfig; import asyncgrpo.proxy.__main__;"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
