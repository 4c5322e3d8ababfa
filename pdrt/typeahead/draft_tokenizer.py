"""Tokens of a prompt that is still being typed: which can no longer change, and the exact ones at submit.

The prompt is rendered the way a `Generate` would render it (the chat
template around the conversation, or the plain text), so the tokens at
submit are *by construction* those of tokenizing the final text in one go.

Before submit only a prefix is trusted. Appending text changes tokens only
near the end: BPE merges do not reach across the pre-tokenizer's word
boundaries, so only the last word or two can still merge differently. The
stable prefix is therefore the tokenization of the rendered text up to the
last word boundary at least `margin_chars` before the end, minus a window of
`window` tokens. Whatever the tokenizer, nothing relies on this being right:
prefilled tokens are compared with the next stable prefix (and with the
final tokens) and rolled back to the longest common prefix when they differ.
"""

from typing import Any

SENTINEL = "\u2063pdrt-draft\u2063"  # invisible separator around a marker no one types
DEFAULT_WINDOW = 4
DEFAULT_MARGIN_CHARS = 16


class DraftTokenizer:
    def __init__(self, tokenizer: Any, messages: list[dict[str, str]] | None, window: int = DEFAULT_WINDOW,
                 margin_chars: int = DEFAULT_MARGIN_CHARS) -> None:
        """`messages` is the conversation before the turn being typed (None: a plain prompt, no template)."""
        self.tokenizer = tokenizer
        self.messages = messages
        self.window = window
        self.margin_chars = margin_chars
        self.text = ""
        if messages is None:
            self.prefix_text, self.add_special_tokens = "", True
        else:
            rendered = self._render(SENTINEL)
            if rendered.count(SENTINEL) != 1:
                raise ValueError("the chat template does not place the user's text exactly once")
            self.prefix_text = rendered[: rendered.index(SENTINEL)]
            self.add_special_tokens = False

    @property
    def num_chars(self) -> int:
        """The characters tokenizing the draft reads: the conversation so far, rendered, and the typed text."""
        return len(self.prefix_text) + len(self.text)

    def _render(self, text: str) -> str:
        chat = [*(self.messages or []), {"role": "user", "content": text}]
        return self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)

    def stable_ids(self) -> list[int]:
        """A prefix of the final tokens for any text typed after `self.text` (see the module docstring)."""
        cut = len(self.text) - self.margin_chars
        while cut > 0 and not self.text[cut - 1].isspace():
            cut -= 1
        if cut <= 0 and not self.prefix_text:
            return []
        ids = self.tokenizer(self.prefix_text + self.text[: max(cut, 0)],
                             add_special_tokens=self.add_special_tokens)["input_ids"]
        return ids[: max(0, len(ids) - self.window)]

    def final_ids(self, tokenizer: Any = None) -> list[int]:
        """The prompt's tokens for the text as it is now, exactly as a one-shot `Generate` renders them.

        `tokenizer` (default: the draft's) is an equal copy for a thread of its own: a fast tokenizer is not
        safe to use from two threads at once."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        if self.messages is None:
            return tokenizer(self.text)["input_ids"]
        chat = [*self.messages, {"role": "user", "content": self.text}]
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
