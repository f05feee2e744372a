"""The bytes a token stands for: chat logprobs' `bytes`, which OpenAI gives so that a client can
join the bytes of consecutive tokens into the text when one character spans several tokens.

Byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen) splits UTF-8 sequences, and such a
token decoded alone is U+FFFD, whose bytes are not the token's: its vocabulary string is the
bytes, each drawn as one printable character (`bytes_to_unicode`). SentencePiece's byte
fallback names a lone byte `<0xE6>`. Any other token is its decoded text."""
from __future__ import annotations

import functools
import re
from typing import Callable

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable bytes stand for themselves, the other
    68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """token id -> the bytes it stands for (cached: a vocabulary is small)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    added = set(tokenizer.get_added_vocab().values()) if byte_level else set()
    table = _byte_of_char()
    piece_of = getattr(tokenizer, "convert_ids_to_tokens", lambda token_id: "")

    @functools.lru_cache(maxsize=65536)
    def of(token_id: int) -> bytes:
        piece = piece_of(token_id)
        if byte_level and token_id not in added and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece or "")
        if fallback:
            return bytes([int(fallback[1], 16)])
        return tokenizer.decode([token_id]).encode()
    return of
