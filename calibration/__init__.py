"""`cai-dllm calibrate`: choose CAI's knobs for a model on validation items (docs/cai.md)."""
