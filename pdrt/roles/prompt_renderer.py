"""From what a client asked (text, chat messages or token ids) to the prompt's token ids, checked.

A prompt is refused by its size before any tokenizing when it cannot fit
the context: no token covers more characters than the longest entry of the
vocabulary, so text longer than `max_model_len` such tokens would need more
tokens than the context holds (`max_chars`). That bounds what one request
can cost the gateway before it is refused.
"""

from typing import Any

from pdrt.errors import InvalidRequestError, PromptTooLongError
from pdrt.wire import Generate


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry, at least 1)."""
    try:
        return max(1, max(map(len, tokenizer.get_vocab())))
    except (AttributeError, TypeError, ValueError):
        return 1 << 20  # no vocabulary to read: a bound that refuses nothing a frame can carry


def text_chars(message: Generate) -> int:
    """The characters of a request's text (its prompt, or its messages' roles and contents, each message one
    more: the template gives it at least a token); 0 for token ids."""
    if message.prompt is not None:
        return len(message.prompt)
    return sum(len(m.role) + len(m.content) + 1 for m in message.messages or [])


class PromptRenderer:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_chars = max_model_len * longest_token_chars(tokenizer)

    def check_chars(self, num_chars: int) -> None:
        """Refuse text that could not fit the context, whatever its tokens."""
        if num_chars > self.max_chars:
            raise PromptTooLongError(f"the prompt has {num_chars} characters; this model's context of "
                                     f"{self.max_model_len} tokens holds at most {self.max_chars}")

    def render(self, message: Generate) -> list[int]:
        """The prompt's token ids; chat messages go through the model's chat template."""
        given = [x is not None for x in (message.prompt, message.messages, message.token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages or token_ids")
        self.check_chars(text_chars(message))
        if message.token_ids is not None:
            ids = message.token_ids
        elif message.prompt is not None:
            ids = self.tokenizer(message.prompt)["input_ids"]
        else:
            ids = self.render_chat([{"role": m.role, "content": m.content} for m in message.messages or []])
        return self.check(list(ids))

    def render_chat(self, chat: list[dict[str, str]]) -> list[int]:
        """The token ids of a conversation under the chat template, ready for the assistant's answer."""
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; send a prompt instead of messages")
        if not chat:
            raise InvalidRequestError("messages must hold at least one message")
        try:
            rendered = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
        except Exception as exc:  # the template's own checks (roles, order) are the model's rules for a request
            raise InvalidRequestError(f"the chat template refused the messages: {exc}") from None
        return rendered["input_ids"]

    def check(self, ids: list[int]) -> list[int]:
        """`ids`, when they make a prompt this model can continue."""
        if not ids:
            raise InvalidRequestError("the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; this model's context is "
                                     f"{self.max_model_len} tokens, including at least one generated token")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")
        return ids
