"""Chat templates: where a template puts a user message, so that a prompt can be split around it."""

from __future__ import annotations

_MARK = "\u2063keepkv-user-message\u2063"


def split_template(tokenizer, chat: bool) -> tuple[str, str]:
    """(before, after): the text the chat template puts around a user message, so that a prompt is
    ``before + message + after``; ("", "") without a template (or ``chat=False``)."""
    if not (chat and getattr(tokenizer, "chat_template", None)):
        return "", ""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
    )
    if rendered.count(_MARK) != 1:
        raise ValueError("the tokenizer's chat template does not render the user message once: use chat=False")
    before, after = rendered.split(_MARK)
    return before, after
