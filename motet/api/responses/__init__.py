"""OpenAI's Responses API (`/v1/responses`): routes.py the handlers, request.py the request and its
translation into a chat request, items.py the output items and their streaming events, input_items.py the
input items route, store.py the stored responses and their conversations in SQLite."""
