"""``POST /v1/embeddings`` for decoder models (as vLLM's ``--task embed`` serves them): each input's final-norm
hidden states pooled into one vector, L2-normalised. ``last`` pooling (the default) takes the last token's state,
which has attended to the whole input; ``mean`` averages every position's.

The pass runs the target's layers in a worker thread over a KV pool of its own (one input at a time, so its size
is bounded by the context length), never through the engine's pool or schedule: it adds CPU work beside the
generation streams but takes none of their KV blocks.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, get_args

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.train.data import TargetPasses

Pooling = Literal["last", "mean"]
POOLINGS: tuple[str, ...] = get_args(Pooling)
MAX_EMBEDDING_INPUTS = 256


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    input: (
        StrictStr
        | Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]],
                    Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(strict=True, ge=1)] | None = None
    user: StrictStr | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]  # type: ignore[list-item]
        return list(x)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def pool(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One input's [T, d] hidden states as one unit-length [d] vector."""
    v = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(v.float(), dim=0)


@torch.inference_mode()
def embed(model: LlamaForCausalLM, token_lists: list[list[int]], pooling: Pooling) -> list[torch.Tensor]:
    """The pooled, normalised embedding of each token list (one pass each, over a KV pool of its own)."""
    out = []
    n = model.config.num_hidden_layers
    for tokens in token_lists:
        passes = TargetPasses.own_pool(model, len(tokens), [len(tokens)])
        hidden, _ = passes.run([tokens], n, final_norm=True)
        out.append(pool(hidden, pooling).cpu())
    return out


def encode(vector: torch.Tensor, fmt: Literal["float", "base64"]) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or the float32 bytes in base64."""
    if fmt == "base64":
        return base64.b64encode(vector.numpy().astype(np.float32).tobytes()).decode("ascii")
    return vector.tolist()


def truncate(vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """``dimensions``: the first that many components, normalised again (how OpenAI's shortened embeddings are
    made); more than the model has is refused by the route."""
    if dimensions is None or dimensions >= vector.numel():
        return vector
    return torch.nn.functional.normalize(vector[:dimensions], dim=0)


def response(name: str, vectors: list[torch.Tensor], n_tokens: int, req: EmbeddingRequest) -> dict[str, Any]:
    data = [Embedding(index=i, embedding=encode(truncate(v, req.dimensions), req.encoding_format))
            for i, v in enumerate(vectors)]
    usage = EmbeddingUsage(prompt_tokens=n_tokens, total_tokens=n_tokens)
    return EmbeddingResponse(data=data, model=name, usage=usage).model_dump()
