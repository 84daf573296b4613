"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat
route's machinery, as server/responses/ does for OpenAI's Responses API:
protocol.py  the request bodies, and what of the API kvserve refuses;
inputs.py    system, messages, tools, tool_choice and thinking in chat terms;
output.py    the chat view's output as content blocks and stream events;
errors.py    Anthropic's error shape and status codes on these routes only;
service.py   the two routes' work, through ChatService.prepare."""
