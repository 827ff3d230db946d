"""Scheduling, pure Python: which positions run next, KV blocks, admission order, LoRA slots."""
