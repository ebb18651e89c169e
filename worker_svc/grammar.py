"""Structured output on the worker: a grammar matcher per constrained request, and the
batched token mask the sampler applies (llguidance).

    compile   Grammar{kind, spec} → llguidance grammar (proto/grammars.py) → LLMatcher, one per
              request (built from a cached template by deep_copy: a schema is compiled
              once per worker, however many requests use it)
    mask      every constrained row's next-token bitmask filled into one int32 [S, V/32]
              tensor (llguidance's parallel executor), unpacked with tensor ops into the
              bool [S, V] `SamplingBatch.allowed`; unconstrained rows allow everything
    advance   each sampled token is consumed by its request's matcher; once the matcher
              is stopped (the JSON is complete, the choice made) the request finishes
              with "stop"

A request re-added after a preemption replays its output tokens into a fresh matcher.
The tokenizer is loaded on the first constrained request only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch as llg_torch
import torch

from proto.grammars import grammar_text

log = logging.getLogger(__name__)

_TEMPLATE_CACHE_SIZE = 64


class GrammarMatcher:
    """One request's position in its grammar; `matcher` is None when the grammar could not
    be compiled (`error` says why)."""

    __slots__ = ("matcher", "_error")

    def __init__(self, matcher: llguidance.LLMatcher | None, error: str = ""):
        self.matcher = matcher
        self._error = error

    @property
    def error(self) -> str:
        if self._error or self.matcher is None:
            return self._error or "no grammar"
        return self.matcher.get_error() if self.matcher.is_error() else ""

    @property
    def done(self) -> bool:
        """Complete: nothing but EOS may follow (also true in the error state)."""
        return self.matcher is None or self.matcher.is_stopped()

    def advance(self, token_id: int) -> bool:
        return self.matcher is not None and self.matcher.consume_token(token_id)


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self._model_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size,
                                                           eos_token=self._eos or None)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def matcher(self, kind: str, spec: str, output_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher, advanced over `output_ids` (a resumed request's outputs). Never
        raises for a bad grammar: the matcher is then in its error state (see `.error`)."""
        key = (kind, spec)
        template = self._templates.get(key)
        if template is None:
            try:
                text = grammar_text(kind, spec)
            except ValueError as exc:
                return GrammarMatcher(None, str(exc))
            template = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0)
            self._templates[key] = template
            if len(self._templates) > _TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        state = GrammarMatcher(template.deep_copy())
        if output_ids:
            state.matcher.consume_tokens(list(output_ids))
        return state

    def allowed(self, rows: Sequence[GrammarMatcher | None], vocab_size: int,
                device: torch.device) -> torch.Tensor | None:
        """bool [len(rows), vocab_size]: the tokens each row may sample next (all of them
        for rows without a grammar); None when no row has one."""
        constrained = [(row.matcher, i) for i, row in enumerate(rows)
                       if row is not None and row.matcher is not None and not row.error]
        if not constrained:
            return None
        bitmask = llg_torch.allocate_token_bitmask(len(rows), self._vocab_size)  # -1: all allowed
        assert self._executor is not None
        llg_torch.fill_next_token_bitmask_par(self._executor, constrained, bitmask)
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(rows), -1)[:, :vocab_size]
        return allowed.to(device, non_blocking=True)
