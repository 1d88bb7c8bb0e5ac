"""Target models: the HF adapter (features, frozen embedding and lm_head) and the embedded offline default."""
