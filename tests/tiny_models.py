"""Tiny models shared by test modules (on the test path: pyproject's ``pythonpath = ["tests"]``)."""

from __future__ import annotations

import torch


def tiny_llama(vocab: int):
    """A 2-layer Llama with eager attention and no window: the dense model of the rollout engines' tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def adam_step(model, seed: int, vocab: int) -> None:
    """One optimizer step (lr 1e-3) on random tokens below ``vocab``: every weight moves."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (2, 12), generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
