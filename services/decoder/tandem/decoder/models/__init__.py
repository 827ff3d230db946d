"""The models (Qwen3, Llama), their layers and attention, and the checkpoint loader: a leaf package."""
