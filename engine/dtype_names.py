"""The dtype names a user may write, without importing torch (the CLI's --help must not wait for it)."""

# alias -> the canonical name, which is also torch's attribute for the dtype
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
CANONICAL_DTYPES = ("float32", "bfloat16", "float16")
