"""Prompt formats: the token ids a prompt becomes before generation (``data.prompt_format``).

- ``raw``: the prompt text, tokenized as is, after the tokenizer's BOS (the tiny recipes' synthetic tasks).
- ``chat``: the conversation (a data row's message list, or one user message) in the model's chat format,
  ending where the assistant's answer starts. In order of preference, all offline:
  1. the tokenizer's own chat template (a GPT-OSS or DeepSeek-V3 checkpoint ships one);
  2. the Harmony renderer of ``openai-harmony`` / ``oss-harmony`` when one is installed and loads its
     encoding without the network (``openai-harmony`` fetches its vocabulary at first use and then fails
     offline: it is skipped);
  3. a fallback: Harmony's message layout written out, ``<|start|>ROLE<|message|>TEXT<|end|>`` per message,
     then ``<|start|>assistant`` (GPT-OSS's tokenizer knows these special tokens; no system preamble, no
     channels).
"""

from __future__ import annotations

from typing import Any

PROMPT_FORMATS = ("raw", "chat")


def messages_of(prompt: str, meta: dict | None) -> list[dict[str, str]]:
    """The conversation of a prompt: a data row's message list when it has one, else one user message."""
    messages = (meta or {}).get("messages")
    return list(messages) if messages else [{"role": "user", "content": prompt}]


def harmony_fallback_text(messages: list[dict[str, str]]) -> str:
    """Harmony's message layout, ending at the start of the assistant's turn (the documented fallback)."""
    body = "".join(f"<|start|>{m['role']}<|message|>{m['content']}<|end|>" for m in messages)
    return body + "<|start|>assistant"


def _harmony_ids(messages: list[dict[str, str]]) -> list[int] | None:
    """Token ids from an installed Harmony package, or None (not installed, or it needs the network)."""
    try:
        from openai_harmony import Conversation, HarmonyEncodingName, Message, Role, load_harmony_encoding

        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        roles = {"system": Role.SYSTEM, "developer": Role.DEVELOPER, "user": Role.USER, "assistant": Role.ASSISTANT}
        convo = Conversation.from_messages(
            [Message.from_role_and_content(roles[m["role"]], m["content"]) for m in messages])
        return list(encoding.render_conversation_for_completion(convo, Role.ASSISTANT))
    except Exception:  # not installed, an unknown role, or the vocabulary download failed offline
        return None


def chat_source(tokenizer: Any) -> str:
    """Which of the three ``chat`` sources this tokenizer gets: "template", "harmony" or "fallback"."""
    if getattr(tokenizer, "chat_template", None):
        return "template"
    return "harmony" if _harmony_ids([{"role": "user", "content": "1"}]) is not None else "fallback"


def encode_prompt(tokenizer: Any, prompt: str, *, fmt: str = "raw", meta: dict | None = None) -> list[int]:
    """The token ids of ``prompt`` in format ``fmt`` (module docstring)."""
    if fmt == "raw":
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + list(ids)
    if fmt != "chat":
        raise ValueError(f"unknown prompt format {fmt!r} (known: {', '.join(PROMPT_FORMATS)})")
    messages = messages_of(prompt, meta)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids = _harmony_ids(messages)
    if ids is not None:
        return ids
    return list(tokenizer.encode(harmony_fallback_text(messages), add_special_tokens=False))
