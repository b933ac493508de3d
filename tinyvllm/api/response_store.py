"""The Responses API's stored responses (`store`, `previous_response_id`, `GET /v1/responses/{id}`, `cancel`), each
with the messages it came from; at most `max_entries`, the oldest finished one out first, running ones never
(docs/phases/09-appendix-endpoints.md)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from tinyvllm.api.errors import OpenAIError, bad_request
from tinyvllm.api.protocol_responses import ResponsesResponse

RUNNING = ("queued", "in_progress")
DEFAULT_MAX_STORED_RESPONSES = 1000  # --max-stored-responses


@dataclass
class StoredResponse:
    response: ResponsesResponse
    messages: list[dict]  # the chat messages it came from (vLLM's msg_store)
    task: asyncio.Task | None = None  # a background generation, until it ends


class ResponseStore:
    def __init__(self, max_entries: int):
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0 (0: store nothing), got {max_entries}")
        self.max_entries = max_entries
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response: ResponsesResponse, messages: list[dict], task: asyncio.Task | None = None) -> None:
        self.entries[response.id] = StoredResponse(response, messages, task)
        self.entries.move_to_end(response.id)
        while len(self.entries) > self.max_entries:
            oldest = next((rid for rid, entry in self.entries.items() if entry.response.status not in RUNNING), None)
            if oldest is None:  # all running
                break
            del self.entries[oldest]

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 400 for an id not a response's, 404 for one not kept (vLLM's errors)."""
        if not response_id.startswith("resp_"):
            raise bad_request(f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                              param)
        entry = self.entries.get(response_id)
        if entry is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found. This server keeps the last "
                              f"{self.max_entries} stored responses (--max-stored-responses), and only those "
                              "created with store=true.", param)
        return entry

    def save(self, response: ResponsesResponse, messages: list[dict]) -> None:
        """Store a response's final form; a cancelled one stays "cancelled"."""
        entry = self.entries.get(response.id)
        if entry is None:
            self.put(response, messages)
        elif entry.response.status != "cancelled":
            entry.response, entry.task = response, None

    def set_status(self, response_id: str, status: str) -> None:
        """A running background response's new status (queued -> in_progress)."""
        entry = self.entries.get(response_id)
        if entry is not None and entry.response.status in RUNNING:
            entry.response.status = status
