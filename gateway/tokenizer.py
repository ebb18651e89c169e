"""The served model's tokenizer: prompt encoding, the chat template, vocabulary checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from gateway.errors import invalid


class PromptTokenizer:
    """Wraps the Hugging Face tokenizer of a checkpoint folder. Methods are synchronous and
    CPU-bound; the app calls them in a worker thread so long prompts do not stall the loop."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:  # vLLM's --chat-template: a file, or the template itself
            path = Path(chat_template).expanduser()
            if path.is_file():
                self.hf.chat_template = path.read_text()
            elif "{{" in chat_template or "{%" in chat_template:
                self.hf.chat_template = chat_template
            else:
                raise ValueError(f"--chat-template {chat_template!r}: no such file (and not a Jinja template)")
        self.vocab_size = len(self.hf)  # includes added tokens such as <|im_end|>
        self.special_ids = frozenset(self.hf.all_special_ids)  # BOS, EOS, pad, <|im_end|>, ...

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` DecodeStream steps with."""
        return self.hf.backend_tokenizer

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A /v1/completions prompt: special tokens (BOS) added the way the model expects."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (how tool definitions reach the
        prompt); a template without it would drop them silently."""
        template = self.hf.chat_template
        if isinstance(template, dict):  # several named templates
            template = template.get("tool_use") or template.get("default") or ""
        return bool(template) and "tools" in template

    def encode_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """Render the chat template (by default with the assistant's generation prompt), then
        tokenize. The template already writes any BOS, so no special tokens are added again."""
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return self.encode_text(text, add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template's text for `messages` (a 400 when the template refuses them)."""
        if not self.hf.chat_template:
            raise invalid("This model has no chat template; use /v1/completions.", param="messages")
        if tools and not self.template_supports_tools:
            raise invalid("'tools' is not supported: this model's chat template has no tool support.",
                          param="tools", code="unsupported_parameter")
        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **(template_kwargs or {}))
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # e.g. a template that insists roles alternate, or chat_template_kwargs it trips on
            raise invalid(f"The chat template rejected the messages: {exc}", param="messages",
                          code="chat_template_error") from exc
        if not isinstance(text, str):
            raise invalid("The chat template did not render to text.", param="messages")
        return text

    def text_with_offsets(self, ids: list[int]) -> tuple[str, list[int]]:
        """`ids` decoded (special tokens skipped) and where each token's text starts in it."""
        stream = DecodeStream(skip_special_tokens=True)
        pieces, offsets, length = [], [], 0
        for token_id in ids:
            offsets.append(length)
            piece = stream.step(self.backend, token_id) or ""
            pieces.append(piece)
            length += len(piece)
        return "".join(pieces), offsets

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"Token id {bad} in '{param}' is out of the vocabulary "
                          f"(valid ids are 0..{self.vocab_size - 1}).", param=param,
                          code="invalid_token_id")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

