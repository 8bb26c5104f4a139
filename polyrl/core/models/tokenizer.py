"""A tiny word-level tokenizer built offline with the ``tokenizers`` library, for tests and tiny recipes.

Whitespace-separated symbols map one-to-one to ids: ``"1 2 + 3"`` -> 4 tokens. Special tokens come first
and the tiny model presets rely on their ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3 (WordLevel needs an
unknown token). No post-processor: callers add <bos>/<eos> themselves.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_TOKENS = (*"0123456789", "+", "-", "*", "/", "=", "(", ")", ",", ".", ":", "?")


def build_tiny_tokenizer(tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast over ``tokens`` (default: digits and a few symbols) plus the specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(DEFAULT_TOKENS if tokens is None else tokens)
    bad = [t for t in tokens if not t or any(c.isspace() for c in t) or t in SPECIAL_TOKENS]
    dupes = sorted(t for t, n in Counter(tokens).items() if n > 1)
    if bad or dupes:
        raise ValueError(f"tokens must be unique, non-empty, whitespace-free and not special: bad={bad} dupes={dupes}")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *tokens))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
