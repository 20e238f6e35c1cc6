"""What the endpoints answered by the chat machinery (``responses/``, ``messages/``) share
when they build their chat request: a function tool in chat's shape, and the validation
of the chat request with errors that name the endpoint's own field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """A chat ``tools`` entry."""
    function = {"name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def validated_chat(body: dict[str, Any], names: Mapping[str, str]) -> ChatCompletionRequest:
    """``body`` (None values dropped) as a chat request; a validation error is a 400 whose
    ``param`` is the endpoint's name (``names``: chat field -> the field it came from)."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        head = where.split(".")[0]
        raise APIError.bad_request(f"{where}: {first['msg']}",
                                   names.get(head, where)) from None


def renamed_error(exc: APIError, names: Mapping[str, str]) -> APIError:
    """``exc`` (raised by the chat machinery) naming the endpoint's own field (``names``:
    chat field -> the field it came from), in its ``param`` and its message."""
    if exc.param is None:
        return exc
    head, _, rest = exc.param.partition(".")
    name = names.get(head)
    if name is None:
        return exc
    exc.message = exc.message.replace(head, name)
    exc.param = name + ("." + rest if rest else "")
    exc.args = (exc.message,)
    return exc
