"""Stored responses (``--responses-store-size N``): the Responses API's ``store``,
``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``.

A response is kept (when the server keeps any, and the request did not say ``store:
false``) once it is complete or incomplete, with its conversation: the items it was
answered from (the previous response's conversation, then its own input; ``instructions``
are not carried over, as OpenAI's API does not) and its output items. A request naming
``previous_response_id`` is answered from that conversation followed by its own input.

Invariants: at most ``max_size`` responses are held, the least recently stored or read
one dropped first; the store lives in the HTTP process and is touched only by its event
loop, so it needs no lock. Nothing is written to disk: a restart forgets every response.
The count bounds it, not the bytes: each response holds its whole conversation, though a
follow-up shares its earlier items (the same objects) with the response it continues.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tpserve.server.http.http_errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as its answer sent it
    inputs: tuple[dict[str, Any], ...]  # the items it was answered from

    @property
    def outputs(self) -> tuple[dict[str, Any], ...]:
        """Its output items (the response object's)."""
        return tuple(self.response["output"])

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up continues: its inputs, then its outputs."""
        return [*self.inputs, *self.outputs]


class ResponseStore:
    """The last ``max_size`` stored responses, by id (module docstring)."""

    def __init__(self, max_size: int):
        if max_size < 1:
            raise ValueError(f"a response store holds at least 1 response, got {max_size}")
        self.max_size = max_size
        self._held: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def put(self, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        """Keeps ``response`` (its output items with it), answered from ``inputs``."""
        self._held[response["id"]] = StoredResponse(response, tuple(inputs))
        self._held.move_to_end(response["id"])
        while len(self._held) > self.max_size:
            self._held.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response ``response_id``; 404 (naming ``param``) when none is."""
        held = self._held.get(response_id)
        if held is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param)
        self._held.move_to_end(response_id)
        return held

    def delete(self, response_id: str) -> None:
        """Forgets ``response_id``; 404 when it is not held."""
        if self._held.pop(response_id, None) is None:
            raise APIError(404, f"Response with id '{response_id}' not found.")
