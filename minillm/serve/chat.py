"""Chat messages to one prompt: the tokenizer's chat template, or a plain play-script template.

A model whose tokenizer has a chat template (Qwen, Llama instruct) gets its own. The shipped
Shakespeare model has none, so it gets ``PLAIN_TEMPLATE``, written like the plays it learned from:

    SYSTEM:                    <- only when a system message is given
    You are a courtier.

    USER:                      <- a message's ``name`` replaces the role: "ROMEO:"
    What light through yonder window breaks?

    ASSISTANT:                 <- the generation prompt; the reply ends at a blank line

Each turn is ``NAME:\\n`` + content + ``\\n\\n``; the reply is cut at its first blank line (the
end of a speech: ``PLAIN_STOP``), where the model would start the next speaker's turn.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

PLAIN_STOP = ["\n\n"]


def _text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts are joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("messages[].content: only text parts ({'type': 'text', 'text': ...}) are served")
        parts.append(part["text"])
    return "".join(parts)


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def plain_template(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The documented plain template (see the module's docstring)."""
    out = []
    for m in messages:
        speaker = (m.get("name") or m["role"]).upper()
        out.append(f"{speaker}:\n{_text(m.get('content'))}\n\n")
    if add_generation_prompt:
        out.append("ASSISTANT:\n")
    return "".join(out)


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> tuple[str, Optional[list[str]]]:
    """(prompt text, default stop strings): the tokenizer's template, else the plain one."""
    if not messages:
        raise ValueError("messages: at least one message is needed")
    msgs = [{**m, "content": _text(m.get("content"))} for m in messages]
    if has_chat_template(tokenizer):
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        return prompt, None
    return plain_template(msgs, add_generation_prompt), list(PLAIN_STOP)
