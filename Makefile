# The two set-up commands: `make run` and `make test`. Everything they need is installed here.
SHELL := /bin/bash
VENV := .venv
ENGINE_VENV := .venv-engine
PY := $(VENV)/bin/python
ENGINE_PY := $(ENGINE_VENV)/bin/python
VLLM_VENV := .venv-vllm
BENCH_VENV := .venv-bench
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/acs_test
# The web suite's second pytest-xdist worker (WEB_WORKERS) takes the Redis database below (14).
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# scripts/production-smoke drops and recreates this database.
SMOKE_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/acs_smoke
# The smoke runs beside the browser suite (`make test`), so it has a Redis database of its own.
SMOKE_REDIS_URL ?= redis://127.0.0.1:6379/13
# tests/vllm, a database and Redis database of its own.
VLLM_TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/acs_vllm_test
VLLM_TEST_REDIS_URL ?= redis://127.0.0.1:6379/12
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Some machines set PYTHONDONTWRITEBYTECODE=1, and then every process compiles again each
# module it imports (5 s of each engine start). What make starts writes the bytecode of what
# it imports, once: a tenth of what compiling both virtualenvs whole at install took (24 s).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-web test-engine test-kernels test-vllm test-differential-long test-browser test-deploy lint format bench bench-venv services client-wheel

# uv (pinned in requirements-installer.txt, installed with pip) installs both virtualenvs from
# the places pip is configured to use (scripts/uv-pip-install): a seventh of pip's time.
INSTALL := UV=$(VENV)/bin/uv scripts/uv-pip-install

$(VENV)/bin/uv: requirements-installer.txt
	test -x $(PY) || "$$(scripts/python-for-web)" -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-installer.txt
	touch $@

$(VENV)/.installed: requirements.txt $(VENV)/bin/uv
	$(INSTALL) $(PY) -r requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(INSTALL) $(PY) -r requirements-test.txt
	touch $@

$(ENGINE_VENV)/.installed: requirements-engine.txt requirements-engine-nodeps.txt $(VENV)/bin/uv
	test -x $(ENGINE_PY) || "$$(scripts/python-for-engine)" -m venv $(ENGINE_VENV)
	$(INSTALL) $(ENGINE_PY) -r requirements-engine.txt
	$(INSTALL) $(ENGINE_PY) --no-deps -r requirements-engine-nodeps.txt
	touch $@

# vLLM (the CPU build) with the vLLM-Lens plugin, the production upstream, for tests/vllm and
# `bench/engine.py --peer vllm` (docs/deploy.md §5 starts it). Both requirement files say why
# they are installed without resolving.
$(VLLM_VENV)/.installed: requirements-vllm.txt requirements-vllm-plugin.txt $(VENV)/bin/uv
	test -x $(VLLM_VENV)/bin/python || "$$(scripts/python-for-engine)" -m venv $(VLLM_VENV)
	$(INSTALL) $(VLLM_VENV)/bin/python --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python \
		-r requirements-vllm-plugin.txt
	touch $@

# llama.cpp for `bench/engine.py --peer llama.cpp`, in a venv of its own, compiled here (minutes
# on 2 cores). AVX2 without AVX-512 runs on every x86 CPU this project runs on.
$(BENCH_VENV)/.installed: requirements-bench.txt
	test -x $(BENCH_VENV)/bin/python || "$$(scripts/python-for-engine)" -m venv $(BENCH_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(BENCH_VENV)/bin/python -m pip install -q --no-cache-dir -r requirements-bench.txt
	touch $@

bench-venv: $(BENCH_VENV)/.installed

services:
	scripts/ensure-redis

# The client library as a wheel of its own (acs_client/pyproject.toml), in dist/.
client-wheel: $(VENV)/.installed
	$(PY) -m pip wheel -q --no-deps -w dist ./acs_client

# The settings default to production (DEBUG off, which needs real secrets): `make run` is the
# local development server.
run: export DEBUG ?= 1
run: $(VENV)/.installed $(ENGINE_VENV)/.installed services
	mkdir -p .run
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py acs_demo
	$(VENV)/bin/honcho start -f Procfile

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two pytest-xdist workers: on a quiet 2-core machine 238 web tests took 41 s instead of 110 s
# (on cores busy with other work, 1.4 times as long: docs/performance.md; `WEB_WORKERS=` runs
# one). Groups keep the fault suite and the real engine's tests each on one worker
# (tests/conftest.py).
WEB_WORKERS ?= -n 2 --dist loadgroup

test-web: $(VENV)/.installed-test $(ENGINE_VENV)/.installed services
	DATABASE_URL=$(TEST_DATABASE_URL) scripts/ensure-test-db
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(VENV)/bin/pytest $(WEB_WORKERS)

test-engine: $(ENGINE_VENV)/.installed
	$(ENGINE_PY) -m pytest tests/engine -q --ignore=tests/engine/test_vllm_fidelity.py \
		--ignore=tests/engine/test_vllm_lens_fidelity.py

# The differential suite at length (a nightly run): ten times the generated requests of
# `make test`'s, on a vLLM-Lens of its own unless `make test` left one running.
test-differential-long: $(VENV)/.installed-test $(ENGINE_VENV)/.installed $(VLLM_VENV)/.installed services
	DATABASE_URL=$(VLLM_TEST_DATABASE_URL) scripts/ensure-test-db
	ACS_DIFFERENTIAL_EXAMPLES=3000 DATABASE_URL=$(VLLM_TEST_DATABASE_URL) \
		REDIS_URL=$(VLLM_TEST_REDIS_URL) $(VENV)/bin/pytest tests/differential

# The numeric suites again under the kernels of the other CPU kinds (AVX2 only; AVX-512 BF16
# without AMX), capped by environment variables: scripts/test-kernels says what each caps.
test-kernels: $(ENGINE_VENV)/.installed
	ENGINE_PY=$(ENGINE_PY) scripts/test-kernels

# The production upstream for real: the gateway in front of vLLM with the vLLM-Lens plugin,
# answering as in front of the embedded engine (tests/vllm), and vLLM-Lens's numbers against
# the float32 model (the engine suite's fidelity cases). On the server `make test` started
# (scripts/vllm-lens), else on one of their own (two to three minutes to start).
test-vllm: $(VENV)/.installed-test $(ENGINE_VENV)/.installed $(VLLM_VENV)/.installed services
	DATABASE_URL=$(VLLM_TEST_DATABASE_URL) scripts/ensure-test-db
	DATABASE_URL=$(VLLM_TEST_DATABASE_URL) REDIS_URL=$(VLLM_TEST_REDIS_URL) $(VENV)/bin/pytest \
		tests/vllm tests/differential
	$(ENGINE_PY) -m pytest tests/engine/test_vllm_fidelity.py tests/engine/test_vllm_lens_fidelity.py -q

test-browser: $(VENV)/.installed-test $(ENGINE_VENV)/.installed services
	scripts/ensure-chromium
	DATABASE_URL=$(TEST_DATABASE_URL) scripts/ensure-test-db
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(VENV)/bin/pytest tests/browser

# docs/deploy.md on this machine: DEBUG=0, generated secrets, two web replicas, worker, beat
# and engine, used through a completion, a stream and a playground run (minutes, so not a
# pytest test).
test-deploy: $(VENV)/.installed-test $(ENGINE_VENV)/.installed services
	DATABASE_URL=$(SMOKE_DATABASE_URL) REDIS_URL=$(SMOKE_REDIS_URL) scripts/production-smoke

# vLLM-Lens starts first, in the background, so that its start-up overlaps the engine and web
# suites; it is stopped (also on failure) once its suite ran, before the browser suite. The
# production smoke (mostly waiting: release commands, then beat's first sweep a minute after
# it starts) runs beside the browser suite; each one's output is printed whole when it ends
# (--output-sync). The engine and web suites keep the machine's cores to themselves but for
# that start-up: the fault suite's bounds on waits beside a maximal request are timings.
test: $(VENV)/.installed-test $(ENGINE_VENV)/.installed $(VLLM_VENV)/.installed services
	scripts/cpu-summary
	scripts/vllm-lens start
	trap 'scripts/vllm-lens stop' EXIT; \
	$(MAKE) --no-print-directory lint test-engine test-kernels test-web test-vllm && \
	scripts/vllm-lens stop && \
	$(MAKE) --no-print-directory -j2 --output-sync=target test-browser test-deploy

bench: $(VENV)/.installed-test $(ENGINE_VENV)/.installed services
	$(ENGINE_PY) bench/engine.py
	DATABASE_URL=postgres://postgres@127.0.0.1:5432/acs_bench_gateway REDIS_URL=$(TEST_REDIS_URL) $(PY) bench/gateway.py
	REDIS_URL=$(TEST_REDIS_URL) $(PY) bench/usage.py
	$(PY) bench/dialect.py
	DATABASE_URL=postgres://postgres@127.0.0.1:5432/acs_bench_playground REDIS_URL=$(TEST_REDIS_URL) $(PY) bench/playground.py
	DATABASE_URL=postgres://postgres@127.0.0.1:5432/acs_bench_pages REDIS_URL=$(TEST_REDIS_URL) $(PY) bench/pages.py
