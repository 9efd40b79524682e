"""When a request stops: the one stop check, run on each token as it is appended to the output.

EOS, a stop token, a stop string (matched on the incremental text), ``max_tokens``, ``max_model_len``, and in the
simulator the trace's output length; ``min_tokens`` holds all but the length limits back (vLLM's ``check_stop``).
"""

from __future__ import annotations

from typing import Optional

from ..detokenizer import find_stop
from .request import Request


class StopChecker:
    """The stop check of one engine: its ``max_model_len``, its tokenizer (for stop strings) and
    whether it simulates (a trace's output length then stands in for EOS)."""

    def __init__(self, config, tokenizer=None):
        self.max_model_len = config.max_model_len
        self.tokenizer = tokenizer
        self.simulated = not config.runs_model

    def check(self, req: Request, tok: int) -> Optional[str]:
        """Does ``tok`` (just appended) end the request? "stop", "length" or None. Before
        ``min_tokens`` tokens only the length limits end it; a stop token or string that ends
        it is kept in ``req.stop_reason`` (EOS leaves it None, as in vLLM)."""
        sp = req.sampling_params
        max_tokens = sp.max_tokens
        assert max_tokens is not None, "unresolved max_tokens (see Request.max_tokens)"
        n_out = req.num_output_tokens
        early = n_out < sp.min_tokens
        if tok == req.eos_token_id and not sp.ignore_eos and not early:
            return "stop"
        if sp.stop_token_ids and tok in sp.stop_token_ids and not early:
            req.stopped_by(tok)
            return "stop"
        if sp.stop and self.tokenizer is not None and self._stop_string(req, early):
            return "stop"
        if n_out >= max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            return "length"
        if self.simulated and req.expected_output_len is not None and n_out >= req.expected_output_len:
            return "stop"  # the simulator's stand-in for the model emitting EOS at the trace length
        return None

    def _stop_string(self, req: Request, early: bool) -> bool:
        """Extend the output's text by its newest token; True if a stop string now appears in it
        (the text is then cut before it, or after it with ``include_stop_str_in_output``)."""
        d = req.text_decoder(self.tokenizer)
        new = d.update(req.output_token_ids)
        hit = find_stop(d.text, len(new), req.sampling_params.stop) if new and not early else None
        if hit is None:
            return False
        i, stop = hit
        req.stopped_by(stop, d.text[: i + len(stop)] if req.sampling_params.include_stop_str_in_output else d.text[:i])
        return True

    def num_tokens_before_stop(self, req: Request, tok: int) -> int:
        """How many more ``tok`` tokens ``req`` can append with ``check`` certain to return None
        after each: the output stays below its length limits (``max_tokens``, ``max_model_len``, the
        simulator's trace length). 0 when ``tok`` may end it (EOS, a stop token) or stop strings are
        matched. The simulator's fast-forward (``minillm/sim/fast_forward.py``) advances that far
        without a check per token."""
        sp = req.sampling_params
        if (
            (sp.stop and self.tokenizer is not None)
            or tok in sp.stop_token_ids
            or (tok == req.eos_token_id and not sp.ignore_eos)
        ):
            return 0
        limit = min(req.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        if self.simulated and req.expected_output_len is not None:
            limit = min(limit, req.expected_output_len)
        return max(0, limit - len(req.output_token_ids) - 1)
