"""What a tool-call parser's stream sends, piece by piece, for the per-parser tests."""
from __future__ import annotations


def chunks_of(stream_class, pieces) -> list[tuple[str, list[dict]]]:
    """(content, deltas) for each piece fed, then for the sample's end."""
    s = stream_class()
    return [s.feed(p) for p in pieces] + [s.finish()]


def without_ids(chunks):
    """The chunks with each delta's random call id left out (the tests compare the rest)."""
    return [(text, [{k: v for k, v in d.items() if k != "id"} for d in deltas])
            for text, deltas in chunks]


def calls_sent(chunks) -> list[tuple[str, str]]:
    """(name, arguments) of each call, as a client adds up its deltas: the name from the delta
    that carries the id, the arguments from every delta of that index, in index order."""
    names, args = {}, {}
    for _, deltas in chunks:
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return [(names[k], args[k]) for k in sorted(args)]
