"""`POST /v1/embeddings`: one vector per input, each a pooling request (a prefill that samples nothing) pooled by
the server's `--pooler-config`.

Taught in docs/phases/09-appendix-endpoints.md.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import Request, Response
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from tinyvllm.api.errors import bad_request
from tinyvllm.api.fields import RequestModel
from tinyvllm.api.protocol import UsageInfo
from tinyvllm.api.serving_engine import OpenAIServing, base_request_id, wait_for_disconnect
from tinyvllm.pooling_params import PoolingParams

Ids = Annotated[list[StrictInt], Field(min_length=1, fail_fast=True)]
Texts = Annotated[list[StrictStr], Field(min_length=1, fail_fast=True)]


class EmbeddingRequest(RequestModel):
    model: StrictStr | None = None
    input: StrictStr | Texts | Ids | Annotated[list[Ids], Field(min_length=1, fail_fast=True)] | None = None
    # vLLM's chat form: one conversation, rendered by the chat template, embedded as one input
    messages: Annotated[list[dict], Field(min_length=1)] | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    # vLLM's "bytes": the vectors back to back as the body, a `metadata` header says where; "bytes_only": no header
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # vLLM's: the base64 or bytes' type
    endianness: Literal["native", "little", "big"] = "native"
    truncate_prompt_tokens: StrictInt | None = None  # only each input's last N tokens (-1: the context length)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first N instead
    user: StrictStr | None = None
    normalize: StrictBool | None = None  # None: the server's default (True)
    priority: StrictInt = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(EmbeddingResponse):  # vLLM's /pooling: the same vectors, named as pooler output
    data: list[PoolingData]

    @classmethod
    def of(cls, embeddings: dict) -> dict:
        data = [PoolingData(index=item["index"], data=item["embedding"]) for item in embeddings["data"]]
        return cls(**{**embeddings, "data": data}).model_dump()


class OpenAIServingEmbedding(OpenAIServing):
    def __init__(self, *args, pooler: PoolingParams | None = None, chat=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pooler = pooler or PoolingParams()
        self.chat = chat  # OpenAIServingChat: renders `messages`

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response | dict:
        model = self.check_model(request.model)
        if (request.input is None) == (request.messages is None):
            raise bad_request("give input (texts or token ids) or messages (a conversation), not both and not "
                              "neither", "input" if request.messages is None else "messages")
        given = request.input
        if request.messages is not None:
            if self.chat is None:
                raise bad_request("this server embeds input only: no chat template to render messages", "messages")
            given = self.chat.tokenize(self.chat.render_text(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs, check_length=request.truncate_prompt_tokens is None))
        inputs = self.inputs(given, request.truncate_prompt_tokens, request.truncation_side)
        if len(inputs) > 1:
            self.engine.check_can_accept(len(inputs))
        params = PoolingParams(self.pooler.pooling_type,
                               self.pooler.normalize if request.normalize is None else request.normalize)
        request_id, created = f"embd-{base_request_id(raw_request)}", int(time.time())
        streams = [self.engine.add_request(request_id if len(inputs) == 1 else f"{request_id}-{i}", ids, params,
                                           request.priority) for i, ids in enumerate(inputs)]
        finals = await self.finals(raw_request, streams)
        if finals is None:
            return Response(status_code=499)
        num_tokens = sum(len(final.prompt_token_ids) for final in finals)
        usage = UsageInfo(prompt_tokens=num_tokens, completion_tokens=0, total_tokens=num_tokens)
        if request.encoding_format in ("bytes", "bytes_only"):
            return self.bytes_response(finals, request, {"id": request_id, "created": created, "model": model,
                                                         "usage": usage.model_dump(include={"prompt_tokens",
                                                                                            "total_tokens"})})
        data = [EmbeddingData(index=i, embedding=self.encode(final.pooled, request.encoding_format,
                                                             request.embed_dtype, request.endianness))
                for i, final in enumerate(finals)]
        return EmbeddingResponse(id=request_id, created=created, model=model, data=data, usage=usage).model_dump()

    def bytes_response(self, finals: list, request: EmbeddingRequest, head: dict) -> Response:
        """vLLM's binary embeddings: the vectors' bytes back to back; the `metadata` header (not with bytes_only)
        says where each lies: {index, embed_dtype, endianness, start, end, shape}."""
        vectors = [self.to_bytes(final.pooled, request.embed_dtype, request.endianness) for final in finals]
        items, start = [], 0
        for i, (final, raw) in enumerate(zip(finals, vectors)):
            items.append({"index": i, "embed_dtype": request.embed_dtype, "endianness": request.endianness,
                          "start": start, "end": start + len(raw), "shape": [len(final.pooled)]})
            start += len(raw)
        metadata = {"metadata": json.dumps({**head, "data": items})}
        return Response(content=b"".join(vectors), media_type="application/octet-stream",
                        headers=None if request.encoding_format == "bytes_only" else metadata)

    def inputs(self, given: str | list, keep: int | None = None, side: str | None = "left") -> list[list[int]]:
        """Token ids of each input: a text, a list of texts, a list of ids, or a list of lists of ids; only `keep`
        of each when set (its last, or first with `side` "right")."""
        if isinstance(given, str):
            given = [given]
        elif given and isinstance(given[0], int):
            given = [given]
        ids = []
        for one in given:
            if isinstance(one, str):
                if not one:
                    raise bad_request("input must not hold an empty string", "input")
                if keep is None:
                    self.check_prompt_chars(one, "input")
                one = self.tokenizer.encode(one)
            ids.append(self.check_token_ids(self.truncate_prompt(one, keep, side), "input"))
        return ids

    @staticmethod
    async def finals(raw_request: Request, streams: list) -> list | None:
        """Each request's last output, or None if the client left first (then every request is aborted)."""

        async def last(stream):
            final = None
            async for final in stream:
                pass
            return final

        gathered = asyncio.ensure_future(asyncio.gather(*(last(stream) for stream in streams)))
        disconnect = asyncio.ensure_future(wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({gathered, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not gathered.done():
                gathered.cancel()
                await asyncio.gather(gathered, return_exceptions=True)
        return None if gathered.cancelled() else gathered.result()

    @staticmethod
    def encode(vector: list[float], encoding_format: str, embed_dtype: str = "float32",
               endianness: str = "native") -> list[float] | str:
        """float: the list; base64: the vector's bytes as `embed_dtype` in `endianness` order (the openai client
        decodes the default, float32 little-endian on every common machine)."""
        if encoding_format == "float":
            return vector
        return base64.b64encode(OpenAIServingEmbedding.to_bytes(vector, embed_dtype, endianness)).decode("ascii")

    @staticmethod
    def to_bytes(vector: list[float], embed_dtype: str = "float32", endianness: str = "native") -> bytes:
        """The vector as `embed_dtype` values in `endianness` byte order."""
        order = {"native": "=", "little": "<", "big": ">"}[endianness]
        x = np.asarray(vector, dtype=np.float32)
        if embed_dtype == "bfloat16":  # the top half of each float32, rounded to nearest even
            bits = x.view(np.uint32).astype(np.uint64)
            raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(f"{order}u2")
        else:
            raw = x.astype(f"{order}f{2 if embed_dtype == 'float16' else 4}")
        return raw.tobytes()
