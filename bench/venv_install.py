"""The Makefile's virtualenv, side by side in one run: pip against uv (``tools/uv_pip.py``).

Each round builds ``.venv``'s install twice into fresh virtualenvs in a temporary directory,
the two tools taking turns: ``pip install -e '.[EXTRAS]'`` as the Makefile used to, and ``pip
install uv`` then ``uv pip install --compile-bytecode -e '.[EXTRAS]'`` as it does now (both
compile bytecode, both under this machine's pip configuration). Each tool keeps its own
download cache between rounds, as on a machine that has installed before; the first round
shows a cold uv cache where there was none. Prints the seconds per round and uv's speed-up.

Run: ``python bench/venv_install.py [--rounds 2]`` (pip takes minutes a round).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "train,serve-cpu,s3,gcs,azure,hf,math,fast,envs,wandb,tinker,dev"


def install(tool: str, venv: Path) -> float:
    """Seconds to create ``venv`` and install the main extras into it with ``tool``."""
    py = str(venv / "bin" / "python")
    spec = f"{ROOT}[{EXTRAS}]"
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    if tool == "pip":
        steps.append([py, "-m", "pip", "install", "-q", "-e", spec])
    else:
        steps.append([py, "-m", "pip", "install", "-q", "uv"])
        uv_pip = str(ROOT / "tools" / "uv_pip.py")
        steps.append(
            [py, uv_pip, "install", "-q", "--compile-bytecode", "--python", py, "-e", spec]
        )
    start = time.monotonic()
    for step in steps:
        subprocess.run(step, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    seconds: dict[str, list[float]] = {"pip": [], "uv": []}
    with tempfile.TemporaryDirectory(prefix="venv-install-") as tmp:
        for r in range(args.rounds):
            order = ("pip", "uv") if r % 2 == 0 else ("uv", "pip")
            for tool in order:
                seconds[tool].append(install(tool, Path(tmp) / f"{tool}-{r}"))
                print(f"round {r}: {tool} {seconds[tool][-1]:.0f} s", flush=True)
    print("\n| tool | seconds per round | median |\n|---|---|---|")
    for tool, values in seconds.items():
        cells = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {tool} | {cells} | {statistics.median(values):.0f} |")
    ratios = [a / b for a, b in zip(seconds["pip"], seconds["uv"], strict=True)]
    print(f"\nuv is {statistics.median(ratios):.1f}x faster (median of the rounds' ratios)")


if __name__ == "__main__":
    main()
