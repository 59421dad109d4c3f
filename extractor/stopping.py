"""When a request's output ends: end-of-sequence, stop token ids, stop strings, max_tokens, the model's length.

    Stopping(tokenizer, eos_ids, max_model_len)
        .finish_reason(request, token)   "stop" / "length" / None once `token` was appended to the output
        .room(request)                   tokens the request may still generate
        .cut_at_stop(request, text)      the output text up to its stop string (records which in stop_reason)

Stop strings are searched in text decoded token by token (tokenizers' DecodeStream) where that is the text decode()
gives: a fast tokenizer that does not clean up spaces afterwards (transformers' own step); else the whole output
is decoded again per token.
"""

from __future__ import annotations

from extractor.request import Request


class Stopping:
    def __init__(self, tokenizer, eos_ids, max_model_len: int) -> None:
        self.tokenizer, self.eos, self.max_model_len = tokenizer, eos_ids, max_model_len
        self._incremental_text = (getattr(tokenizer, "backend_tokenizer", None) is not None
                                  and not getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def room(self, r: Request) -> int:
        """Tokens r may still generate (>= 1 while it is active)."""
        return min(r.params.max_tokens - len(r.output_ids),
                   self.max_model_len - len(r.prompt_token_ids) - len(r.output_ids))

    def finish_reason(self, r: Request, token: int) -> str | None:
        if not r.params.ignore_eos and token in self.eos:
            return "stop"
        if token in r.params.stop_token_ids:
            r.stop_reason = token
            return "stop"
        if r.params.stop and self._hit_stop_string(r):
            return "stop"
        if len(r.output_ids) >= r.params.max_tokens:
            return "length"
        if len(r.prompt_token_ids) + len(r.output_ids) >= self.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, r: Request) -> bool:
        """Whether the output text now contains one of r's stop strings. The text grows by each token's piece (the
        tokenizers library's incremental decoder; a whole re-decode per token made a long output cost O(n^2)), and
        the search covers only where the new text could complete a stop string."""
        start = self._advance_text(r)
        if start is None or not any(stop in r.text[max(0, start - len(stop) + 1):] for stop in r.params.stop):
            return False
        r.stop_hit = True
        return True

    def _advance_text(self, r: Request) -> int | None:
        """Bring r.text up to r's newest output token; where it changed (None: not at all). As vLLM, text ending
        inside a multi-byte character is held back until the character is whole."""
        if r.detok is not False and self._incremental_text:
            if r.detok is None:  # the request's first token: its decoder (the import only then, not per token)
                from tokenizers.decoders import DecodeStream

                r.detok = DecodeStream(skip_special_tokens=True)
            try:
                piece = r.detok.step(self.tokenizer.backend_tokenizer, r.output_ids[-1])
            except Exception:  # noqa: BLE001 - a byte-fallback decoder rewrote text it had already given
                r.detok = False  # ("Invalid prefix encountered"): whole decodes for this request from here on
            else:
                if not piece:
                    return None
                r.text += piece
                return len(r.text) - len(piece)
        # a slow tokenizer, one that cleans up spaces, or a failed stream: the whole output decoded again
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or text == r.text:
            return None
        start = next((i for i, (a, b) in enumerate(zip(text, r.text)) if a != b), min(len(text), len(r.text)))
        r.text = text
        return start

    def cut_at_stop(self, r: Request, text: str) -> str:
        """The output text up to the first stop string (and it, with include_stop_str_in_output); records which."""
        hits = [(i, stop) for stop in r.params.stop if (i := text.find(stop)) >= 0]
        if not hits:  # the whole-output decode differs from the incremental one (space clean-up): cut the latter
            return self.cut_at_stop(r, r.text) if text != r.text else text
        i, stop = min(hits)
        r.stop_reason = stop
        return text[:i + len(stop)] if r.params.include_stop_str_in_output else text[:i]
