"""A request's route at the ingress: its prompt rendered and tokenized as a replica's ingress actor will
(motet/actors/ingress_actor.py), then its leading full blocks hashed as the engine's block manager will (keyed
by the adapter's uid and salted by tenant and cache_salt), so the router asks about exactly the blocks a replica
would find in its prefix cache, and a prefix cached for one tenant draws no other tenant's request to its replica.

Routing only: a prompt this cannot render gets no blocks (the replica answers its error), nor does one cut to
its last tokens (truncate_prompt_tokens: its leading blocks are known only once all of it is tokenized), and
a very long one is hashed from its first ROUTING_MAX_CHARS characters.
"""

from __future__ import annotations

from motet.engine.core.block_manager import chain_block_hashes, matchable_tokens, prefix_salt
from motet.engine.tokenizer import Tokenizer

ROUTING_MAX_CHARS = 65536  # enough for every block a cache is likely to hold; bounds the ingress's work


def prompt_token_ids(tokenizer: Tokenizer, spec) -> list[int]:
    """The token ids a replica will compute for a GenerateSpec's prompt (text prompts possibly cut short)."""
    if spec.messages is not None:
        text = tokenizer.render_chat(spec.messages, max_chars=ROUTING_MAX_CHARS, **spec.chat_template_kwargs)
        return _encode(tokenizer, text, add_special_tokens=spec.special_tokens)
    if isinstance(spec.prompt, str):
        return _encode(tokenizer, spec.prompt, add_special_tokens=spec.special_tokens)
    return list(spec.prompt or [])


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    ids = tokenizer.hf.encode(text[:ROUTING_MAX_CHARS], add_special_tokens=add_special_tokens)
    if len(text) > ROUTING_MAX_CHARS:  # the cut may have split the last words' tokens: drop that tail
        ids = ids[: max(0, len(ids) - 8)]
        return ids + [-1]  # a stand-in for the rest, so matchable_tokens keeps every block above
    return ids


def block_hashes(token_ids: list[int], adapter_uid: int, salt: int, block_size: int) -> tuple[int, ...]:
    """The chained hashes of the blocks a prefix-cache hit may cover, as the engine computes them."""
    upto = matchable_tokens(len(token_ids))
    return tuple(chain_block_hashes(token_ids, adapter_uid, salt, block_size, upto))


def route_hashes(tokenizer: Tokenizer, spec, block_size: int, shared_prefix_cache: bool) -> tuple[int, ...]:
    """`shared_prefix_cache`: the engines' setting (EngineConfig), on which the salt depends."""
    adapter_uid = spec.adapter.uid if spec.adapter is not None else 0
    salt = prefix_salt(spec.tenant, spec.params[0].cache_salt, shared_prefix_cache)
    if spec.truncate_prompt_tokens is not None:
        return ()
    try:
        ids = prompt_token_ids(tokenizer, spec)
    except ValueError:  # the replica will say what is wrong with the prompt
        return ()
    return block_hashes(ids, adapter_uid, salt, block_size)
