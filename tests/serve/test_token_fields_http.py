"""vLLM's token-level request fields over the HTTP layer (in-process fleet, one token per byte):
`return_token_ids` and `add_special_tokens`."""
from __future__ import annotations

import json

from local_fleet import LocalFleet
from local_fleet import run_against as run

BODY = {"model": "fake-model", "prompt": "a prompt long enough for a block or two of bytes",
        "max_tokens": 8, "ignore_eos": True}


def test_return_token_ids_gives_the_served_prompt_and_each_choices_ids_as_vllm_places_them():
    """One token per byte: a choice's ids are its text's bytes; the prompt's ids are what was
    served (after truncate_prompt_tokens). Completions put the prompt's ids in each choice,
    chat beside the choices; a stream sends them once per choice, with its first chunk, and
    each chunk's ids are that chunk's tokens."""
    chat_prompt = list(b"<user>hi</user>\n<assistant>")
    body = {**BODY, "prompt": ["first prompt", "second one"], "n": 2, "return_token_ids": True,
            "truncate_prompt_tokens": 6}
    chat = {"model": "fake-model", "max_tokens": 5, "ignore_eos": True, "n": 2,
            "return_token_ids": True, "messages": [{"role": "user", "content": "hi"}]}

    async def ask(client):
        events = []
        for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            r = await client.post(path, json={**b, "stream": True})
            events.append([json.loads(line[6:]) for line in r.text.splitlines()
                           if line.startswith("data: {")])
        return (await client.post("/v1/completions", json=body),
                await client.post("/v1/chat/completions", json=chat),
                await client.post("/v1/completions", json=BODY), *events,
                await client.post("/v1/completions", json={**BODY, "return_token_ids": 1}))
    (whole, chat_whole, plain, streamed, chat_streamed, bad), _ = run(LocalFleet(), ask)
    choices = whole.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [list(b"prompt")] * 2 + [list(b"nd one")] * 2
    for c in choices + chat_whole.json()["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        assert bytes(c["token_ids"]).decode() == text and len(c["token_ids"]) in (8, 5)
    assert chat_whole.json()["prompt_token_ids"] == chat_prompt
    assert "prompt_token_ids" not in chat_whole.json()["choices"][0]
    assert "token_ids" not in plain.json()["choices"][0]  # only when asked
    assert "prompt_token_ids" not in plain.json()

    for chunks, n_choices, length in ((streamed, 4, 8), (chat_streamed, 2, 5)):
        ids = {i: [] for i in range(n_choices)}
        texts = {i: "" for i in range(n_choices)}
        prompts = {i: [] for i in range(n_choices)}
        for chunk in chunks:
            for c in chunk["choices"]:
                ids[c["index"]] += c.get("token_ids", [])
                texts[c["index"]] += c.get("text") or c.get("delta", {}).get("content") or ""
                if "prompt_token_ids" in c:
                    prompts[c["index"]].append(c["prompt_token_ids"])
            if "prompt_token_ids" in chunk:  # chat's: beside the choice
                (c,) = chunk["choices"]
                prompts[c["index"]].append(chunk["prompt_token_ids"])
        assert all(bytes(ids[i]).decode() == texts[i] and len(ids[i]) == length for i in ids)
        expected = ([[list(b"prompt")]] * 2 + [[list(b"nd one")]] * 2 if n_choices == 4
                    else [[chat_prompt]] * 2)
        assert [prompts[i] for i in range(n_choices)] == expected  # once per choice
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_token_ids"


def test_add_special_tokens_is_vllms_true_for_completions_false_for_chat_and_can_be_flipped():
    """A tokenizer that adds a BOS (id 1) when asked, as Llama's does: a completion's text gets
    it unless add_special_tokens is false; a chat's rendered text only when it is true (the
    template writes its own); token ids given as the prompt are never touched; /tokenize the
    same."""
    fleet = LocalFleet()
    tokenizer = next(iter(fleet.workers.values())).engine.tokenizer  # the frontend's
    tokenizer.encode = lambda text, add_special_tokens=True: (
        [1] * add_special_tokens + list(text.encode()))
    chat = {"model": "fake-model", "max_tokens": 1, "return_token_ids": True,
            "messages": [{"role": "user", "content": "hi"}]}
    chat_ids = list(b"<user>hi</user>\n<assistant>")

    async def ask(client):
        out = []
        for path, body in (("/v1/completions", {**BODY, "prompt": "abc"}),
                           ("/v1/completions", {**BODY, "prompt": "abc",
                                                "add_special_tokens": False}),
                           ("/v1/completions", {**BODY, "prompt": [97, 98]}),
                           ("/v1/chat/completions", chat),
                           ("/v1/chat/completions", {**chat, "add_special_tokens": True})):
            r = await client.post(path, json={**body, "return_token_ids": True})
            assert r.status_code == 200, r.text
            out.append(r.json().get("prompt_token_ids") or r.json()["choices"][0]["prompt_token_ids"])
        for body in ({"prompt": "abc"}, {"prompt": "abc", "add_special_tokens": False},
                     {"messages": chat["messages"]}):
            out.append((await client.post("/tokenize", json=body)).json()["tokens"])
        return out
    got, _ = run(fleet, ask)
    assert got == [[1, 97, 98, 99], [97, 98, 99], [97, 98], chat_ids, [1, *chat_ids],
                   [1, 97, 98, 99], [97, 98, 99], chat_ids]
