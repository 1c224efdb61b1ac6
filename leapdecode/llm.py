"""The offline Python API (mirrors vLLM): ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from leapdecode.config import EngineConfig
from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.models.hub import model_ref
from leapdecode.models.tokenizer import chat_token_ids
from leapdecode.outputs import RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.speculative.registry import parse_config
from leapdecode.speculative.speculator import Speculator

Prompt = str | dict[str, Any]


class LLM:
    """An engine with a model loaded.

    ``LLM()`` loads the bundled SmolLM2-135M-Instruct; ``model`` may be an HF folder, a ``.gguf`` file or a Hugging
    Face repo id (``"org/name"``, ``"org/name:Q4_K_M"`` for one GGUF quantization of a GGUF repo; ``revision`` and
    ``gguf_file`` name a branch/tag/commit and a file of the repo; models/hub.py).
    ``speculative_config`` turns on a lossless speculative method, e.g. ``{"method": "ngram"}``.
    """

    def __init__(self, model: str | None = None, speculative_config: dict[str, Any] | None = None,
                 revision: str | None = None, gguf_file: str | None = None, **kwargs: Any) -> None:
        """``kwargs``: any ``EngineConfig`` field (``dtype``, ``device``, ``block_size``, ``kv_cache_blocks``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ...), whose defaults are declared there alone."""
        if model is None and (revision or gguf_file):
            raise ValueError("revision and gguf_file need a Hugging Face repo id as model")
        if model is not None:
            model = model_ref(str(model), revision, gguf_file)  # "org/name@revision:file.gguf"
        known = set(EngineConfig.__dataclass_fields__) - {"model", "speculative_config"}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        self.config = EngineConfig(model=model, speculative_config=parse_config(speculative_config), **kwargs)
        self.engine = LLMEngine(self.config, drafting=Speculator)

    @classmethod
    def from_engine_of(cls, other: LLM, speculative_config: dict[str, Any] | None = None, **overrides: Any) -> LLM:
        """A second LLM that shares ``other``'s loaded weights and tokenizer (its own KV cache and scheduler),
        e.g. to compare decoding methods without loading the model twice."""
        from dataclasses import replace

        if other.config.tensor_parallel_size > 1:
            raise ValueError("from_engine_of shares one process's weights; with tensor_parallel_size > 1 the shards "
                             "live in the workers: build another LLM instead")
        cfg = replace(other.config, speculative_config=parse_config(speculative_config), **overrides)
        llm = cls.__new__(cls)
        llm.config = cfg
        e = other.engine
        llm.engine = LLMEngine(cfg, model=e.model, tokenizer=e.tokenizer, model_path=e.model_path, drafting=Speculator)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    # --------------------------------------------------------------------------------------------- inputs
    def _tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise TypeError('a prompt must be a string or a dict with "prompt_token_ids" (or "prompt")')

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        escape_special_tokens: bool = False,
        chat_template: str | None = None,
    ) -> list[int]:
        """``conversation``'s token ids through the chat template (the model's, or ``chat_template``: Jinja text);
        ``tools``: OpenAI-style function definitions for templates that show them to the model;
        ``chat_template_kwargs``: extra template variables (e.g. Qwen3's ``{"enable_thinking": False}``). A special
        token's text in a message becomes that control token (as in HF transformers and vLLM) unless
        ``escape_special_tokens`` (untrusted text: it stays text)."""
        if not isinstance(conversation, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in conversation
        ):
            raise TypeError('a conversation is a list of {"role": ..., "content": ...} dicts')
        return chat_token_ids(self.engine.tokenizer, conversation, tools, chat_template_kwargs, escape_special_tokens,
                              chat_template)

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return params

    # ---------------------------------------------------------------------------------------------- calls
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in order, each with ``SamplingParams.n`` completions."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [self._tokenize(p) for p in prompts]
        return self._run(encoded, self._params_list(sampling_params, len(encoded)), use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per conversation, through the model's chat template or ``chat_template``
        (vLLM's arguments; see :meth:`apply_chat_template`)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        encoded = [(self.apply_chat_template(c, tools, chat_template_kwargs, chat_template=chat_template), None)
                   for c in conversations]
        return self._run(encoded, self._params_list(sampling_params, len(encoded)), use_tqdm)

    def _run(self, encoded, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for (tokens, text), p in zip(encoded, params):
                ids.append(engine.add_request(tokens, p, prompt=text))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2, leave=False)
        try:
            while any(r is None for r in results):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
                raise_failed(engine, order)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def stream(
        self, prompt: Prompt | list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a cumulative ``RequestOutput`` each time the request produces tokens (last one ``finished``).

        A list of role/content dicts is treated as a chat conversation."""
        if isinstance(prompt, list):
            tokens, text = self.apply_chat_template(prompt), None
        else:
            tokens, text = self._tokenize(prompt)
        rid = self.engine.add_request(tokens, sampling_params or SamplingParams(), prompt=text)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
                raise_failed(self.engine, (rid,))
        finally:
            self.engine.abort_request(rid)


def raise_failed(engine: LLMEngine, request_ids: Iterable[str]) -> None:
    """Raise the error of the first of ``request_ids`` that a step failed (the engine aborted it)."""
    for err in engine.take_failed(request_ids).values():
        raise err
