"""The machine shared by formats whose calls are bare JSON objects after a start the parser
recognizes (Llama 3's, Mistral's); llama3_json.py and mistral.py say where the calls start and
what may stand between two of them.

    Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    ^^^^^ content    ^ the calls start: from here on nothing is content
                                  ^ name known -> header delta (index, id, type, name)
                                                      ^..............^ arguments, in the
                                                      pieces they arrive in

Before the start, text streams as `content`, held back only while its tail could still begin
the start (and whitespace, trimmed before a call). Each call object goes through
CallListScanner as one more entry of a list whose "[" is fed once. An object is a call only if
its "name" is one of the request's tools and it has the arguments key (vLLM's llama3_json
requires it too): `{"name": "Alice", "age": 30}` is an answer, not a call. Between objects only
whitespace and the separator may come: anything else, or an object that is no call, ends the
calls and, with what follows, is dropped (as text after Hermes tags is).
"""
from __future__ import annotations

from raypaged.serve.tool_call_stream import CallsStream, merged

OBJECT, SKIP, END = "object", "skip", "end"  # what a character between two objects is


class JsonCallsStream(CallsStream):
    """A subclass defines start(buf): (where the calls start in `buf`, how long their marker
    is) or (None, how much of `buf` can go out as content now)."""

    need_args = True
    separator = ","

    def __init__(self, tool_names=None) -> None:
        super().__init__(tool_names)
        self._object = ""               # the current object's text
        self._done = False              # the calls ended: the rest is dropped

    def between(self, ch: str) -> str:
        """What a character outside any call object is, once the calls started."""
        if ch == "{":
            return OBJECT
        return SKIP if ch.isspace() or ch == self.separator else END

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content, deltas = "", []
        if not self._calling:
            at, n = self.start(self._buf)
            if at is None:
                content, self._buf = self._buf[:n], self._buf[n:]
                return content, []
            content = self._buf[:at].rstrip()  # the space before the calls is not content
            self._after = self._buf[len(content):at + n]
            self._buf = self._buf[at + n:]
            self._calling = True
        self._body(deltas)
        return content, merged(deltas)

    def _body(self, deltas: list[dict]) -> None:
        buf, self._buf = self._buf, ""
        for i, ch in enumerate(buf):
            if self._done:
                self._after += buf[i:]
                break
            self._after += ch
            if self.scanner.at_top:  # between two objects
                kind = self.between(ch)
                self._done = kind == END
                if kind != OBJECT:
                    continue
                self._object = ""
            self.scanner.step(ch, deltas)
            self._object += ch
            if self.scanner.at_top:
                self._close_object(deltas)
        self.scanner.pending(deltas)

    def _close_object(self, deltas: list[dict]) -> None:
        """An object that is no call ends the calls; a call whose arguments were no object or
        list gets them when its object closes (a string as it is, anything else as JSON)."""
        if self.scanner.calls[-1][0] is None:
            self._done = True
        else:
            self.scanner.close_object(self._object, deltas)
