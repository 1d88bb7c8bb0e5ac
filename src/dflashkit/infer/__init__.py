"""Inference: the speculative draft/verify loop, the autoregressive baseline, evaluation."""
