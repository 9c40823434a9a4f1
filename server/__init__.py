"""cai-dllm server: the OpenAI-compatible HTTP front end and the command line. Knows no tensors."""
