"""Incremental detokenization and stop strings.

A stop string (``SamplingParams.stop``) is matched on the *text* of the output, which grows
token by token. Decoding the whole output after every token costs O(n) per token; vLLM
decodes incrementally instead: it keeps two offsets into the output's token ids and decodes
only a short window each time. ``prefix_offset..read_offset`` is text already emitted (it
gives the window its context, since many tokenizers render a token differently at the start
of a string), ``read_offset..end`` is new. The new text is the window's decoding minus the
prefix's; while it ends in an incomplete UTF-8 character ("\\ufffd") nothing is emitted and
the window grows by one token.

``find_stop`` then searches only the end of the text the new piece could complete: a stop
string of length L that was not there before must end inside the new piece, so it starts at
most L - 1 characters before it.

A front end that streams the text (``AsyncLLM``) reads it from here too, so stop strings are
handled once, in the engine. While a sequence runs, the last ``stop_buffer_length`` characters
are held back: they may be the start of a stop string, which the final text will not show
(vLLM's ``IncrementalDetokenizer.get_next_output_text`` does the same).
"""

from __future__ import annotations

from typing import Callable, Optional

from .sampling_params import SamplingParams

# transformers' fast tokenizers (v5's name, v4's): their decode is the Rust backend's, then an
# optional clean-up of spaces.
_BACKEND_DECODES = {"TokenizersBackend._decode", "PreTrainedTokenizerFast._decode"}


def plain_decode(tokenizer) -> Callable[[list[int], bool], str]:
    """``tokenizer.decode(ids, skip_special_tokens=skip)`` as a function of (ids, skip). For a Hugging
    Face fast tokenizer that cleans up no spaces that is its Rust ``tokenizers`` backend's ``decode``
    with the same arguments, called straight: the Python around it costs about 15 times the
    decoding itself, and a stream decodes twice per token."""
    decode = getattr(type(tokenizer), "_decode", None)
    if getattr(decode, "__qualname__", None) in _BACKEND_DECODES and not tokenizer.clean_up_tokenization_spaces:
        backend = tokenizer.backend_tokenizer
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """The text of one sequence's output, extended one token at a time."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._decode = plain_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens  # SamplingParams.skip_special_tokens
        self.text = ""
        self.num_tokens = 0  # output tokens already taken in
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, token_ids: list[int]) -> str:
        """Take in the output's tokens not seen yet; returns the text they add (possibly "")."""
        added = []
        decode, skip = self._decode, self.skip_special_tokens
        for n in range(self.num_tokens + 1, len(token_ids) + 1):
            prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip)
            window = decode(token_ids[self.prefix_offset : n], skip)
            if len(window) > len(prefix) and not window.endswith("\ufffd"):
                added.append(window[len(prefix) :])
                self.prefix_offset, self.read_offset = self.read_offset, n
        self.num_tokens = len(token_ids)
        new = "".join(added)
        self.text += new
        return new

    def rewind(self, token_ids: list[int]) -> None:
        """The output was cut back to ``token_ids`` (a step undone): the text becomes theirs again,
        decoded from the start, one token at a time as ``update`` takes them in, so the offsets are
        the ones it had after the last of them."""
        self.__init__(self.tokenizer, self.skip_special_tokens)
        self.update(token_ids)


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> Optional[tuple[int, str]]:
    """The earliest stop string that ends inside the last ``num_new_chars`` characters of
    ``text``: (its start index in ``text``, the string), or None."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def stop_buffer_length(sp: SamplingParams) -> int:
    """How many trailing characters of a running sequence's text a stream holds back: one less
    than the longest stop string (a match cuts at most that many already-seen characters), or
    none when there are no stop strings or the matched one stays in the output."""
    if not sp.stop or sp.include_stop_str_in_output:
        return 0
    return max(len(s) for s in sp.stop) - 1


def next_output_text(text: str, num_sent: int, finished: bool, hold_back: int) -> str:
    """The part of ``text`` a stream hands out now, after the ``num_sent`` characters it has
    already sent: the rest of it once the sequence has finished, else all but the last
    ``hold_back`` characters."""
    end = len(text) if finished else max(num_sent, len(text) - hold_back)
    return text[num_sent:end]
