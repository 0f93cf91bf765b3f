"""A word-level tokenizer for the random-weight checkpoints, so that text clients can talk to them.

``vllm bench serve`` (vLLM's own load generator) always needs a tokenizer: its random dataset
draws token ids, decodes them to text, re-encodes to hit each prompt's length and sends text
(vLLM 0.25.0, ``vllm/benchmarks/datasets/datasets.py``), and a server started with
``--skip-tokenizer-init`` refuses text prompts. The random checkpoints have no tokenizer of
their own; this writes one whose every id is one word: ``UNK`` 0, ``<s>`` 1, ``</s>`` 2 (the
Qwen3, Mixtral and Qwen2-MoE builders' ``bos_token_id`` and ``eos_token_id``; the DeepSeek and
gpt-oss cards name others, harmless with ``ignore_eos``), then ``t3`` ... ``t{V-1}``, split on
whitespace, no decoder (tokens joined by a space), so that decoding and re-encoding any ids in
``[3, V)`` gives them back exactly and a prompt's length in tokens is its number of words.

The unknown token's text is long on purpose. Before tokenizing, vLLM 0.25.0's server refuses a
prompt whose text has more characters than ``max_input_tokens`` times the longest vocabulary
entry (``vllm/tokenizers/hf.py``, ``max_chars_per_token``; ``vllm/renderers/params.py``,
``_text_len_check``). Every word here takes one character more in a prompt than in the
vocabulary (the space after it), so with ``<unk>`` the longest entry a prompt of about 2,000
tokens failed that check at ``--max-model-len 2560`` (HTTP 400, on the H200 on 2026-12-03);
``UNK`` is longer than any word and its space (``tokenizer_json`` checks).

``tokenizer.json`` is the format of Hugging Face's ``tokenizers`` (a ``WordLevel`` model with a
``WhitespaceSplit`` pre-tokenizer and the three special tokens added), written without the
library; ``tokenizer_config.json`` names ``PreTrainedTokenizerFast``, which must be explicit:
without it transformers picks the tokenizer class from the model type (``Qwen2Tokenizer`` for
``qwen3_moe``), which does not read this vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UNK = "<unknown-word>"
SPECIAL = (UNK, "<s>", "</s>")


def word(token_id: int) -> str:
    """The text of ``token_id``."""
    return SPECIAL[token_id] if token_id < len(SPECIAL) else f"t{token_id}"


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    if vocab_size <= len(SPECIAL):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL)}, got {vocab_size}")
    if len(UNK) < len(word(vocab_size - 1)) + 1:
        raise ValueError(
            f"vocab_size {vocab_size}: its last word {word(vocab_size - 1)!r} and a space are "
            f"longer than {UNK!r}, which vLLM's prompt length check needs to be the longest entry"
        )
    added = [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, text in enumerate(SPECIAL)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {word(i): i for i in range(vocab_size)},
            "unk_token": SPECIAL[0],
        },
    }


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": SPECIAL[0],
    "bos_token": SPECIAL[1],
    "eos_token": SPECIAL[2],
    "model_max_length": 1_000_000,
    "clean_up_tokenization_spaces": False,
}


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of ``vocab_size`` words into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab_size)) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
