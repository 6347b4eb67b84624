"""Checkpoint formats on the file route: safetensors and ``.npy``."""
