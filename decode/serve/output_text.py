"""Incremental detokenization and stop strings of one request.

Decoding every output token again each step costs O(length) per token; `OutputText` decodes only a short
window (the tokens since the last complete character, as transformers' TextStreamer and vLLM do) and emits the
new characters once they no longer end in a partial UTF-8 sequence ("\\ufffd"). With stop strings it holds back
the last ``max(len(stop)) - 1`` characters (they may be the start of a stop string), so the streamed deltas
never contain text that the final output cuts; the concatenated deltas always equal `text`.
"""


class OutputText:
    """Text of a request's output tokens, fed one token at a time (`add`), with stop-string detection."""

    def __init__(self, tokenizer, stop: tuple = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0           # ids[prefix_offset:read_offset] decode to text already produced
        self.read_offset = 0
        self.decoded = ""                # everything decoded so far (not yet cut at a stop string)
        self.emitted = 0                 # characters of `decoded` handed out in deltas
        self.stopped_by = None           # the stop string found, if any

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        """Append one token; finds a stop string completed by it (`stopped_by`, the text cut before it)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return                                           # a partial character: wait for the next token
        start = len(self.decoded)
        self.decoded += window[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            self._find_stop(max(0, start - self.hold))

    def _find_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            at = self.decoded.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self.decoded = self.decoded[:best[0]]
            self.stopped_by = best[1]

    def flush(self) -> None:
        """The request ended: decode a trailing partial character too (as the full decode would)."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            window = self._decode(self.ids[self.prefix_offset:])
            self.decoded += window[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.ids)

    def delta(self, finished: bool) -> str:
        """The characters not handed out yet (all of them once ``finished``; else all but the held-back tail)."""
        upto = len(self.decoded) if finished or self.stopped_by else max(self.emitted, len(self.decoded) - self.hold)
        out = self.decoded[self.emitted:upto]
        self.emitted = upto
        return out

    @property
    def text(self) -> str:
        """The text handed out so far (the concatenated deltas)."""
        return self.decoded[:self.emitted]
