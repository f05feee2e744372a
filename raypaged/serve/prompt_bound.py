"""The most bytes of text one token can stand for, so a prompt too long to fit in max_model_len
tokens, whatever its tokens turn out to be, is refused before it is tokenized.

Tokenizing a multi-MB prompt costs the router seconds of CPU and stalls its event loop, only
for the prompt to be refused as over max_model_len. Each token of a BPE tokenizer covers at most
the bytes of its own vocabulary string, so a text of more than (max_model_len - 1) x
max_token_bytes bytes cannot fit: refusing it needs only its length.

That holds only while the tokenizer never drops or shrinks text on the way to its tokens, so
its pipeline is checked against steps known to keep every byte; for anything else there is no
bound (None) and every prompt is tokenized.
"""
from __future__ import annotations

import json

# Normalizers and pre-tokenizers that keep every byte of the input (possibly widening it).
KEEPING_NORMALIZERS = {"Prepend", "Replace", "ByteLevel", "Sequence"}
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation",
                          "Sequence"}


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the character a byte-level vocabulary writes for
    each byte (printable bytes stand for themselves, the others are shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return alphabet


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of input one token can cover, or None where the tokenizer gives no such
    bound (not a Hugging Face fast tokenizer, or a step that can drop text)."""
    if (backend := getattr(tokenizer, "backend_tokenizer", None)) is None:
        return None
    model = backend.model
    if type(model).__name__ != "BPE" or (model.unk_token and not model.byte_fallback):
        return None  # an unknown token (fused, in WordPiece: a whole word) covers any length
    normalizer, pre_tokenizer = _state(backend.normalizer), _state(backend.pre_tokenizer)
    if not (_keeps_text(normalizer, KEEPING_NORMALIZERS)
            and _keeps_text(pre_tokenizer, KEEPING_PRE_TOKENIZERS)):
        return None
    added = list(backend.get_added_tokens_decoder().values())
    if any(t.lstrip or t.rstrip for t in added):
        return None  # such a token absorbs any run of whitespace beside it
    # A byte-level vocabulary spells bytes in its own alphabet: count the bytes they stand for.
    # Other vocabularies are counted in UTF-8, which can only overstate (▁ for a space, <0x0A>).
    byte_level = "ByteLevel" in {s.get("type") for s in _steps(normalizer) + _steps(pre_tokenizer)}
    alphabet = byte_level_alphabet() if byte_level else {}
    longest = max((sum(1 if ch in alphabet else len(ch.encode()) for ch in piece)
                   for piece in backend.get_vocab(with_added_tokens=False)), default=0)
    # added tokens are matched in the text as written, not in the byte-level alphabet
    return max([longest, *(len(t.content.encode()) for t in added)])


def _state(component) -> dict | None:
    """A normalizer's or pre-tokenizer's settings as tokenizer.json writes them."""
    return None if component is None else json.loads(component.__getstate__())


def _steps(node: dict | None) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        children = node.get("normalizers") or node.get("pretokenizers") or []
        return [step for child in children for step in _steps(child)]
    return [node]


def _keeps_text(node: dict | None, keeping: set[str]) -> bool:
    for step in _steps(node):
        kind = step.get("type")
        if kind not in keeping or step.get("behavior") == "Removed":
            return False
        if kind == "Replace":  # only a plain string replaced by one at least as long
            pattern = step.get("pattern", {})
            if "String" not in pattern or len(step.get("content", "").encode()) < len(
                    pattern["String"].encode()):
                return False
    return True
