"""From what a client asked (text, chat messages or token ids) to the prompt's token ids, checked."""

from typing import Any

from pdrt.errors import InvalidRequestError, PromptTooLongError
from pdrt.wire import Generate


class PromptRenderer:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def render(self, message: Generate) -> list[int]:
        """The prompt's token ids; chat messages go through the model's chat template."""
        given = [x is not None for x in (message.prompt, message.messages, message.token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages or token_ids")
        if message.token_ids is not None:
            ids = message.token_ids
            if any(t < 0 for t in ids):
                raise InvalidRequestError("token ids must be non-negative")
        elif message.prompt is not None:
            ids = self.tokenizer(message.prompt)["input_ids"]
        else:
            if not self.tokenizer.chat_template:
                raise InvalidRequestError("this model has no chat template; send a prompt instead of messages")
            chat = [{"role": m.role, "content": m.content} for m in message.messages or []]
            ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        return self.check(list(ids))

    def check(self, ids: list[int]) -> list[int]:
        """`ids`, when they make a prompt this model can continue."""
        if not ids:
            raise InvalidRequestError("the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; this model's context is "
                                     f"{self.max_model_len} tokens, including at least one generated token")
        return ids
