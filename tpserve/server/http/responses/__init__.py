"""OpenAI's Responses API (``POST /v1/responses``) over the chat-completions machinery: a
request becomes a chat request (``request.py``), the chat answer becomes a response object
(``output.py``), and the chat chunks become the Responses stream's events (``events.py``).
Responses are not stored: ``previous_response_id`` and the like are refused."""
