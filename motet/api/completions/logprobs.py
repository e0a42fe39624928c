"""Token logprobs in the OpenAI wire formats: chat (`content` entries) and legacy completions; and vLLM's
`prompt_logprobs`. With vLLM's `return_tokens_as_token_ids` a token is named "token_id:N" instead of by its
text (whose bytes chat logprobs still carry), so that tokens that are not whole characters stay apart."""

from __future__ import annotations

from motet.api.completions import protocol as P
from motet.api.state import ServerState
from motet.engine.outputs import TokenLogprob

# A token the grammar (or a penalty) masked out has logprob -inf, which JSON cannot carry: it is reported
# as this floor instead (vLLM's convention).
LOGPROB_FLOOR = -9999.0


def _finite(lp: float | None) -> float | None:
    return None if lp is None else max(lp, LOGPROB_FLOOR)


def token_name(state: ServerState, token_id: int, as_id: bool) -> str:
    return f"token_id:{token_id}" if as_id else state.token_text(token_id)


def chat_logprobs(
    state: ServerState, lps: list[TokenLogprob], k: int, as_ids: bool = False
) -> P.ChatLogprobs:
    def entry(token_id, lp):
        return {
            "token": token_name(state, token_id, as_ids),
            "logprob": _finite(lp),
            "bytes": list(state.token_text(token_id).encode()),
        }

    return P.ChatLogprobs(
        content=[
            P.ChatTokenLogprob(
                **entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top[:k]]
            )
            for lp in lps
        ]
    )


def completion_logprobs(
    state: ServerState,
    lps: list[TokenLogprob],
    prompt_ids: list[int] | None,
    prompt_lps,
    offset: int = 0,
    as_ids: bool = False,
    k: int | None = None,
) -> P.CompletionLogprobs:
    """Legacy logprobs; with `prompt_ids` (echo) the prompt's tokens come first, the first one without. `k`:
    the alternatives shown per token (the prompt's may have been computed for more: prompt_logprobs)."""
    text = state.token_text
    out = P.CompletionLogprobs()
    pos = offset

    def add(token_id, lp, top):
        nonlocal pos
        s = text(token_id)
        name = token_name(state, token_id, as_ids)
        out.text_offset.append(pos)
        pos += len(s)
        out.tokens.append(name)
        out.token_logprobs.append(_finite(lp))
        if top is None:
            out.top_logprobs.append(None)
        else:
            d = {token_name(state, t, as_ids): _finite(v) for t, v in top[:k]}
            d.setdefault(name, _finite(lp))
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


def prompt_logprobs(state: ServerState, prompt_ids: list[int], lps: list[TokenLogprob | None]) -> list:
    """vLLM's `prompt_logprobs`: None for the first token (nothing predicts it), then per token
    {token_id: {"logprob", "rank", "decoded_token"}} for the token itself and the top alternatives."""
    lps = list(lps or [])
    if len(lps) == len(prompt_ids):
        lps = lps[1:]
    out: list[dict | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], lps, strict=False):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(token_id): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": state.token_text(token_id),
            }
        }
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(
                str(t), {"logprob": _finite(v), "rank": rank, "decoded_token": state.token_text(t)}
            )
        out.append(entry)
    return out
