"""Token logprobs in the OpenAI wire formats: chat (`content` entries) and legacy completions."""

from __future__ import annotations

from motet.api import protocol as P
from motet.api.state import ServerState
from motet.engine.sequence import TokenLogprob

# A token the grammar (or a penalty) masked out has logprob -inf, which JSON cannot carry: it is reported
# as this floor instead (vLLM's convention).
LOGPROB_FLOOR = -9999.0


def _finite(lp: float | None) -> float | None:
    return None if lp is None else max(lp, LOGPROB_FLOOR)


def chat_logprobs(state: ServerState, lps: list[TokenLogprob], k: int) -> P.ChatLogprobs:
    text = state.token_text

    def entry(token_id, lp):
        s = text(token_id)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}

    return P.ChatLogprobs(
        content=[
            P.ChatTokenLogprob(
                **entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top[:k]]
            )
            for lp in lps
        ]
    )


def completion_logprobs(
    state: ServerState, lps: list[TokenLogprob], prompt_ids: list[int] | None, prompt_lps, offset: int = 0
) -> P.CompletionLogprobs:
    """Legacy logprobs; with `prompt_ids` (echo) the prompt's tokens come first, the first one without."""
    text = state.token_text
    out = P.CompletionLogprobs()
    pos = offset

    def add(token_id, lp, top):
        nonlocal pos
        s = text(token_id)
        out.text_offset.append(pos)
        pos += len(s)
        out.tokens.append(s)
        out.token_logprobs.append(_finite(lp))
        if top is None:
            out.top_logprobs.append(None)
        else:
            d = {text(t): _finite(v) for t, v in top}
            d.setdefault(s, _finite(lp))
            out.top_logprobs.append(d)

    if prompt_ids is not None:
        plps = list(prompt_lps or [])
        if len(plps) == len(prompt_ids):  # an entry for the first token too (None)
            plps = plps[1:]
        add(prompt_ids[0], None, None)
        for token_id, lp in zip(prompt_ids[1:], plps, strict=False):
            if lp is None:
                add(token_id, None, None)
            else:
                add(token_id, lp.logprob, lp.top)
    for lp in lps:
        add(lp.token_id, lp.logprob, lp.top)
    return out
