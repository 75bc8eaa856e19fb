"""``AdapterStore.export`` and ``asyncgrpo export``: a published version as a plain PEFT
directory that PEFT and vLLM load as it is."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from asyncgrpo.errors import AlreadyExists, NotFound
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.bundle import LOCAL_MANIFEST
from asyncgrpo.store.run_documents import RunStore
from asyncgrpo.transport import open_transport

pytestmark = pytest.mark.anyio


async def _published(root: Path, adapter: Path, name: str = "run-1a2b", versions=(1, 2)) -> Path:
    """A run directory whose store holds ``versions`` of ``adapter`` and a policy.json."""
    async with open_transport(str(root / "store")) as transport:
        store = AdapterStore(transport)
        for v in versions:
            await store.publish(name, v, adapter, step=v)
        await RunStore(transport).run_id("run")
        await RunStore(transport).write_policy(f"{name}-v{versions[-1]}", versions[-1])
    return root


async def test_export_writes_the_files_and_nothing_of_asyncgrpos(tmp_path, lora_adapter):
    run_dir = await _published(tmp_path / "run", lora_adapter)
    async with open_transport(str(run_dir / "store")) as transport:
        dest = await AdapterStore(transport).export("run-1a2b", 2, tmp_path / "out" / "final")
    expected = sorted(p.name for p in lora_adapter.iterdir() if p.name != LOCAL_MANIFEST)
    assert sorted(p.name for p in dest.iterdir()) == expected
    for name in expected:
        assert (dest / name).read_bytes() == (lora_adapter / name).read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["final"]  # no staging left beside it


async def test_export_refuses_a_non_empty_destination_and_names_missing_versions(
    tmp_path, lora_adapter
):
    run_dir = await _published(tmp_path / "run", lora_adapter)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    async with open_transport(str(run_dir / "store")) as transport:
        store = AdapterStore(transport)
        with pytest.raises(AlreadyExists, match="not an empty directory"):
            await store.export("run-1a2b", 1, taken)
        with pytest.raises(NotFound, match=r"published versions: 1, 2"):
            await store.export("run-1a2b", 7, tmp_path / "seven")
    assert (taken / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "seven").exists()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncgrpo", "export", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


async def test_export_command_takes_a_run_directory_and_loads_in_peft(
    tmp_path, tiny_model, lora_adapter
):
    from asyncgrpo.testing.tiny import reference_logprobs

    await _published(tmp_path / "run", lora_adapter)
    done = _cli("run", "exported", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "exported run-1a2b version 2 to" in done.stdout
    prompt, completion = [1, 2, 3, 4], [5, 6, 7]
    assert reference_logprobs(
        tiny_model, tmp_path / "exported", prompt, completion
    ) == reference_logprobs(tiny_model, lora_adapter, prompt, completion)
    again = _cli("run", "exported", "--version", "1", cwd=tmp_path)
    assert again.returncode == 2 and "not an empty directory" in again.stderr
    assert "Traceback" not in again.stderr
    missing = _cli("run", "v9", "--version", "9", cwd=tmp_path)
    assert missing.returncode == 2 and "published versions: 1, 2" in missing.stderr
    assert "Traceback" not in missing.stderr
    nowhere = _cli("nowhere", "x", cwd=tmp_path)
    assert nowhere.returncode == 2 and "no run here" in nowhere.stderr


@pytest.mark.vllm
async def test_an_exported_version_loads_in_vllm_as_a_directory(
    tmp_path, tiny_model, lora_adapter, vllm_replicas
):
    from asyncgrpo.testing.tiny import reference_logprobs
    from asyncgrpo.vllm.client import VLLMClient

    run_dir = await _published(tmp_path / "run", lora_adapter)
    async with open_transport(str(run_dir / "store")) as transport:
        dest = await AdapterStore(transport).export("run-1a2b", 2, tmp_path / "final")
    name = f"exported-{uuid.uuid4().hex[:8]}"
    prompt = [1, 2, 3, 4, 5]
    async with VLLMClient(vllm_replicas[0].url) as client:
        await client.load_lora_adapter(name, str(dest))  # vLLM's loader of --lora-modules
        try:
            body = await client.completions(
                {
                    "model": name,
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                    "seed": 0,
                }
            )
        finally:
            await client.unload_lora_adapter(name)
    choice = body["choices"][0]
    served = choice["logprobs"]["token_logprobs"]
    reference = reference_logprobs(tiny_model, lora_adapter, prompt, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4


async def test_an_exported_adapter_names_its_base_model_portably(
    tmp_path, tiny_model, lora_adapter
):
    """Not this machine's absolute path: the model's name by default, its path relative to the
    export, the path as trained, or a value given."""
    import json

    await _published(tmp_path / "run", lora_adapter)
    trained = json.loads((lora_adapter / "adapter_config.json").read_text())
    assert trained["base_model_name_or_path"] == str(tiny_model)  # absolute, as trained

    def base(dest: str, *flags: str) -> str:
        done = _cli("run", dest, "--version", "1", *flags, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        config = json.loads((tmp_path / dest / "adapter_config.json").read_text())
        assert f"its base model: {config['base_model_name_or_path']})" in done.stdout
        return config["base_model_name_or_path"]

    assert base("by-name") == tiny_model.name
    relative = base("nested/by-path", "--base-model", "relative")
    assert not Path(relative).is_absolute()
    assert (tmp_path / "nested" / "by-path" / relative).resolve() == tiny_model.resolve()
    assert base("as-trained", "--base-model", "as-trained") == str(tiny_model)
    assert base("given", "--base-model", "Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
