"""Seeded serving workloads, as token ids (exact lengths): each item is
(prompt token ids, output tokens, index of the request that must finish first, or None).

    random             input and output lengths drawn from ranges
    prefix_repetition  --num-prefixes shared prefixes x suffixes, behind a short head all share
    system_prompt      one long shared system prompt (>= 512 tokens) + a distinct user turn each
    multi_turn         conversations of several turns; each turn's prompt is the whole history
                       so far (previous prompt + an assistant reply + the new user turn) and is
                       sent only after the previous turn finished. The reply in the history is
                       synthetic (fixed tokens), so the cache can match up to the previous prompt,
                       not through the reply: the prefix a router must keep together.
    zipf               --num-prefixes prefixes picked by a Zipf law (a few hot, many cold) + suffix
"""
from __future__ import annotations

import random

VOCAB = (100, 10_000)  # token ids drawn from here: inside every Llama-family vocabulary
DATASETS = ("random", "prefix_repetition", "system_prompt", "multi_turn", "zipf")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def make_dataset(ns) -> list[tuple[list[int], int, int | None]]:
    rng = random.Random(ns.seed)
    n, out = ns.num_prompts, ns.output_len
    if ns.dataset == "random":
        return [(tokens(rng, rng.randint(*ns.input_len)), out, None) for _ in range(n)]
    if ns.dataset == "prefix_repetition":
        common = tokens(rng, ns.common_prefix_len)
        prefixes = [common + tokens(rng, ns.prefix_len) for _ in range(ns.num_prefixes)]
        reqs = [(prefixes[i % ns.num_prefixes] + tokens(rng, ns.suffix_len), out, None)
                for i in range(n)]
        rng.shuffle(reqs)
        return reqs
    if ns.dataset == "system_prompt":
        system = tokens(rng, max(512, ns.prefix_len))
        return [(system + tokens(rng, rng.randint(32, 2 * ns.suffix_len)), out, None)
                for _ in range(n)]
    if ns.dataset == "multi_turn":
        turns = max(4, ns.turns)
        conversations = max(1, n // turns)
        reqs: list[tuple[list[int], int, int | None]] = []
        for _ in range(conversations):
            history = tokens(rng, ns.common_prefix_len)  # the chat template's shared head
            previous = None
            for _ in range(turns):
                history = history + tokens(rng, ns.suffix_len)  # the user's turn
                reqs.append((history, out, previous))
                previous = len(reqs) - 1
                history = history + [VOCAB[0]] * out  # the assistant's reply (synthetic)
        return reqs
    if ns.dataset == "zipf":
        prefixes = [tokens(rng, ns.prefix_len) for _ in range(ns.num_prefixes)]
        weights = [1 / (k + 1) ** 1.1 for k in range(ns.num_prefixes)]
        return [(rng.choices(prefixes, weights)[0] + tokens(rng, ns.suffix_len), out, None)
                for _ in range(n)]
    raise ValueError(f"unknown dataset {ns.dataset!r}; choices: {', '.join(DATASETS)}")
