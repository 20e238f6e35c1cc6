"""Anthropic's Messages API (``POST /v1/messages``, as vLLM serves it) over the
chat-completions machinery: a request becomes a chat request (``request.py``), and the chat
answer a message object or the Messages stream's events (``answer.py``). Text, tools and,
with ``--reasoning-parser``, thinking; image and document blocks and server tools are
refused with 400."""
