"""Prefix grouping: rows that share a prompt prefix go out together, and to the same engine.

A row's key is the router's (raypaged.serve.routing.routing_key): core's chain hash of its
prompt's first `prefix_blocks` full blocks, the hash the engines' prefix caches use. Within one
read-ahead window the rows are reordered group by group (groups in order of first appearance,
rows of a group in input order); the router then sends each key to the same engine, so the
second row of a group finds the shared blocks cached instead of evicted by other rows.
"""
from __future__ import annotations

from raypaged.batch.rows import CHAT_URL, Row
from raypaged.chat import chat_token_ids
from raypaged.core.block_hash import BlockHash
from raypaged.serve.protocol import ChatCompletionRequest
from raypaged.serve.routing import routing_key


class PrefixKeys:
    def __init__(self, tokenizer, block_size: int, prefix_blocks: int):
        self.tokenizer, self.block_size, self.prefix_blocks = tokenizer, block_size, prefix_blocks

    def key(self, row: Row) -> BlockHash | None:
        if row.error is not None:
            return None
        try:
            tokens = self._tokens(row)
        except Exception:  # noqa: BLE001 - a hint only; the frontend refuses the row itself
            return None
        salt = row.body.get("cache_salt")
        return routing_key(tokens, self.block_size, self.prefix_blocks,
                           salt if isinstance(salt, str) else None)

    def _tokens(self, row: Row) -> list[int]:
        body = row.body
        if row.url == CHAT_URL:
            req = ChatCompletionRequest.model_validate(body)
            return chat_token_ids(self.tokenizer, req.conversation(), req.add_generation_prompt,
                                  req.tool_dicts())
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first one's prefix
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)


def group_by_prefix(rows: list[Row], keys: list[BlockHash | None]) -> list[Row]:
    """`rows` reordered group by group, groups in order of first appearance (stable)."""
    first: dict[BlockHash | None, int] = {}
    for k in keys:
        first.setdefault(k, len(first))
    order = sorted(range(len(rows)), key=lambda i: (first[keys[i]], i))
    return [rows[i] for i in order]
