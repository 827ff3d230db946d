# The OpenAI-compatible HTTP gateway's image: `tandem serve openai`. It holds no model and imports
# neither torch nor numpy (tests/unit/test_architecture.py), so it installs only its own two units:
# common/ (the torch-free contract and the `tandem` command) and services/gateway/, each with the
# dependencies its pyproject.toml names. No setup.py, so no C compiler and no kernels.
# Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t tandem-gateway:local .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY common ./common
COPY services/gateway ./services/gateway
RUN pip install -e ./common -e ./services/gateway \
    && useradd --create-home --uid 10001 tandem
USER tandem

EXPOSE 8000
# Its health check is docker-compose.yml's (GET /health through urllib: no curl here).
CMD ["tandem", "serve", "openai", "--host", "0.0.0.0", "--port", "8000"]
