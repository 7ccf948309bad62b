"""Inference-server clients, prompt sets, load generation and the server launcher."""
