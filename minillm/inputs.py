"""Prompts as vLLM's programs write them: a string, token ids, or a prompt dict.

vLLM's ``LLM.generate`` takes, besides a string, a ``TextPrompt`` (``{"prompt": "ROMEO:"}``) or a
``TokensPrompt`` (``{"prompt_token_ids": [1, 2, 3]}``); both are plain dicts (``TypedDict``), so
``from minillm.inputs import TextPrompt, TokensPrompt`` reads as vLLM's ``vllm.inputs``. The other keys
vLLM knows (``multi_modal_data``, ``mm_processor_kwargs``, ``cache_salt``) ask for what this engine does
not do: left out or None they mean nothing; a value there is refused, naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, Union

try:  # Python 3.11+
    from typing import NotRequired
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str  # the text, tokenized by the model's tokenizer


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]  # the prompt as token ids
    prompt: NotRequired[str]  # its text, when the caller has it (not read)


# vLLM's keys for what this engine does not do (images and audio, their processor, a prefix-cache salt).
NOT_SERVED = ("multi_modal_data", "mm_processor_kwargs", "cache_salt", "token_type_ids", "prompt_embeds")


def parse_prompt(prompt: Any, where: str = "prompt") -> Union[str, Any]:
    """What the engine takes (a str or token ids) for one vLLM-style prompt; anything but a dict is
    returned as it is (``LLMEngine.add_request`` checks it). ``where`` names the prompt in errors."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = set(prompt)
    for key in sorted(keys & set(NOT_SERVED)):
        if prompt[key] is not None:
            raise ValueError(
                f"{where}[{key!r}]: not supported (minillm serves text-only models, without "
                "a prefix-cache salt); leave it out"
            )
    unknown = sorted(keys - {"prompt", "prompt_token_ids"} - set(NOT_SERVED), key=str)
    if unknown:
        raise TypeError(
            f"{where}: unknown key(s) {unknown}; a prompt dict has 'prompt' (text) "
            "or 'prompt_token_ids' (token ids), as vLLM's TextPrompt and TokensPrompt"
        )
    if "prompt_token_ids" in keys:
        return prompt["prompt_token_ids"]
    if "prompt" in keys:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(
                f"{where}['prompt']={prompt['prompt']!r}: must be a str (token ids go in 'prompt_token_ids')"
            )
        return prompt["prompt"]
    raise TypeError(f"{where}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
