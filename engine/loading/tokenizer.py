"""Loading a checkpoint's tokenizer with transformers' fast tokenizer, never running remote code.

A `tokenizer.json` is loaded directly. Without one, a byte-level BPE (`vocab.json` + `merges.txt`)
is built by the standard transformers class that the checkpoint's custom class copies; the added
tokens keep the ids their files give them and the chat template is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.errors import CheckpointError
from engine.loading.checkpoint import CheckpointFiles

# Custom (remote-code) tokenizer classes that are renamed copies of a standard one.
STANDARD_TOKENIZER_FOR: dict[str, str] = {
    "DreamTokenizer": "Qwen2TokenizerFast",  # Dream's tokenization_dream.py is Qwen2's BPE tokenizer
}


def load_tokenizer(path: Union[str, Path]) -> PreTrainedTokenizerBase:
    checkpoint = CheckpointFiles.open(path)
    root = checkpoint.path
    declared = (checkpoint.tokenizer_config or {}).get("tokenizer_class") or ""
    if (root / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(root))
    elif (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
        class_name = STANDARD_TOKENIZER_FOR.get(declared, declared)
        tokenizer_cls = getattr(transformers, class_name, None) if class_name else None
        if tokenizer_cls is None:
            raise CheckpointError(f"tokenizer class {declared!r} in {root} needs remote code; add a "
                                  "tokenizer.json to the checkpoint directory")
        tokenizer = tokenizer_cls.from_pretrained(str(root))
    else:
        raise CheckpointError(f"no tokenizer in {root}: expected tokenizer.json, or vocab.json and merges.txt")
    _check_added_token_ids(tokenizer, checkpoint)
    return tokenizer


def _check_added_token_ids(tokenizer: PreTrainedTokenizerBase, checkpoint: CheckpointFiles) -> None:
    """A token whose id moved would silently corrupt every prompt; refuse such a tokenizer."""
    declared = {entry["content"]: int(i) for i, entry in
                ((checkpoint.tokenizer_config or {}).get("added_tokens_decoder") or {}).items()}
    # Where both files name one id, transformers follows `added_tokens_decoder`; `added_tokens.json`
    # can be stale there (SDAR's calls the mask `<MASK>`, its tokenizer config `<|MASK|>`).
    decoder_ids = set(declared.values())
    declared.update({content: token_id for content, token_id in (checkpoint.added_tokens or {}).items()
                     if token_id not in decoder_ids})
    for content, token_id in declared.items():
        got = tokenizer.convert_tokens_to_ids(content)
        if got != token_id:
            raise CheckpointError(f"tokenizer in {checkpoint.path} maps {content!r} to {got}, but its "
                                  f"files declare id {token_id}")


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of `text` with no special tokens added: `tokenizer.encode(text, add_special_tokens=False)`.

    A fast tokenizer is asked through its Rust backend's single-text `encode`: transformers' own
    `encode` goes through the batch call, which releases the GIL, and in the server the event loop
    then waits for the engine thread, which holds the GIL for most of a step, to give it back. Where
    the backend carries state that transformers' call would reset first (truncation, padding, split
    special tokens), the transformers path is taken.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return backend.encode(text, add_special_tokens=False).ids
