"""OpenAI's chat completions and completions (`/v1/chat/completions`, `/v1/completions`): routes.py the
handlers, protocol.py their wire format, chat_output.py a chat choice's text split into reasoning, content
and tool calls, logprobs.py the token logprobs in OpenAI's and vLLM's shapes."""
