"""Inference: paged KV cache, continuous-batching scheduler, sampling and the engine."""
