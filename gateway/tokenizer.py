"""The served model's tokenizer: prompt encoding, the chat template, vocabulary checks."""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from gateway.errors import invalid


class PromptTokenizer:
    """Wraps the Hugging Face tokenizer of a checkpoint folder. Methods are synchronous and
    CPU-bound; the app calls them in a worker thread so long prompts do not stall the loop."""

    def __init__(self, model_dir: str | Path):
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self.hf)  # includes added tokens such as <|im_end|>

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` DecodeStream steps with."""
        return self.hf.backend_tokenizer

    def encode_text(self, text: str) -> list[int]:
        """A /v1/completions prompt: special tokens (BOS) added the way the model expects."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the chat template with the assistant's generation prompt, then tokenize.
        The template already writes any BOS, so no special tokens are added again."""
        if not self.hf.chat_template:
            raise invalid("This model has no chat template; use /v1/completions.", param="messages")
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:  # e.g. a template that insists roles alternate
            raise invalid(f"The chat template rejected the messages: {exc}", param="messages") from exc
        return list(self.hf.encode(text, add_special_tokens=False))

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"Token id {bad} in '{param}' is out of the vocabulary "
                          f"(valid ids are 0..{self.vocab_size - 1}).", param=param,
                          code="invalid_token_id")

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

