"""The models (Qwen3, Qwen2, Llama, Mistral), their layers, attention and loader: a leaf package."""
