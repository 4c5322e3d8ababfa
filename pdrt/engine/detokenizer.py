"""Incremental, UTF-8 safe detokenization and stop-string detection."""

from typing import Any

# Decoding a few prompt tokens before the output gives tokenizers that strip
# a leading space at the start of a text (SentencePiece, byte-level BPE) the
# context they need to render the first output token as it reads in context.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character.

    It keeps two offsets into its token list: text before `prefix_offset` is
    settled, and `read_offset` marks what has been emitted. A delta is emitted
    only when the decoded text grows and does not end in U+FFFD (a partial
    multi-byte character), so a character spread over several byte tokens
    appears once, whole.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop = stop or []
        self.max_stop_chars = max((len(s) for s in self.stop), default=0)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token and return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The text still held back at the end of the output (a character cut short renders as U+FFFD)."""
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def find_stop(self, num_new_chars: int) -> str | None:
        """Look for a stop string that ends in the last `num_new_chars` characters.

        On a match the text is cut just before the stop string, which may span
        any number of tokens.
        """
        if not self.stop or num_new_chars == 0:
            return None
        window_start = max(0, len(self.text) - num_new_chars - self.max_stop_chars + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]
