"""The word-level tokenizer of tools/vllm/word_tokenizer.py: the same file Hugging Face's
``tokenizers`` saves for that tokenizer, exact round trips of any ids, and the builder's
``--tokenizer``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from tools.vllm import make_moe_checkpoint as mk
from tools.vllm import word_tokenizer as wt


def _library_built(vocab_size: int) -> dict[str, object]:
    vocab = {wt.word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=wt.UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in wt.SPECIAL])
    found: dict[str, object] = json.loads(tokenizer.to_str())
    return found


def test_the_file_is_the_librarys(tmp_path: Path) -> None:
    assert wt.tokenizer_json(64) == _library_built(64)
    wt.write_tokenizer(tmp_path, 64)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == _library_built(64)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")


def test_any_ids_round_trip_and_a_prompt_is_its_words(tmp_path: Path) -> None:
    wt.write_tokenizer(tmp_path, 4096)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 4096
    rng = random.Random(0)
    for length in (1, 7, 128, 2048):
        ids = [rng.randrange(3, 4096) for _ in range(length)]
        text = tokenizer.decode(ids)
        assert len(text.split()) == length
        assert tokenizer.encode(text).ids == ids
    assert tokenizer.decode([1, 5, 2], skip_special_tokens=True) == "t5"


def test_too_small_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab_size must exceed 3, got 3"):
        wt.tokenizer_json(3)


def test_the_builder_writes_it_with_the_checkpoint(tmp_path: Path) -> None:
    assert mk.main([str(tmp_path / "m"), "--arch", "mixtral", "--layers", "1", "--tokenizer"]) == 0
    vocab = json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"]
    written = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    assert len(written["model"]["vocab"]) == vocab


@pytest.mark.parametrize("vocab_size", [64, 4096, 102_400, 201_088])
def test_prompts_pass_vllms_character_bound(vocab_size: int) -> None:
    """vLLM 0.25.0 refuses a prompt text longer than ``max_input_tokens`` times its tokenizer's
    longest vocabulary entry (``hf.py``: ``max(len(tok) for tok in vocab)``), before it
    tokenizes: a prompt of n words must be at most n times that long."""
    vocab = wt.tokenizer_json(vocab_size)["model"]["vocab"]  # type: ignore[index]
    longest = max(len(text) for text in vocab)
    rng = random.Random(1)
    for n in (1, 2, 2048):
        ids = [rng.randrange(3, vocab_size) for _ in range(n)] + [vocab_size - 1]
        text = " ".join(wt.word(i) for i in ids)
        assert len(text) <= len(ids) * longest
    # The bound that failed on the H200: the longest word and its space against <unk>.
    assert len(wt.word(4095)) + 1 > len("<unk>")


def test_a_vocabulary_too_large_for_the_unknown_token_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than '<unknown-word>'"):
        wt.tokenizer_json(10**14)
