"""Checkpoint reading: safetensors shards, validation, dequantisation into model parameters."""
