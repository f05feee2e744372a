"""The Hermes tool-call format (Qwen2.5, Hermes 2/3, SmolLM3 templates), read as the text streams.

    Let me check.\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    ^^^^^^^^^^^^^ content  ^ a call begins: from here on nothing is content
                                         ^ name known -> header delta (index, id, type, name)
                                                                  ^..............^ arguments,
                                                                  in the pieces they arrive in

Text before the first <tool_call> streams as `content`, held back only while its tail could
still begin the tag, or is whitespace (trimmed before a call). Inside a tag, the JSON object
goes through CallListScanner, as one more entry of a call list; the tag ends at </tool_call>
once the object is closed (a "</tool_call>" inside a string is text). Text outside the tags
after the first call is dropped, as vLLM's Hermes parser does. A tag's object is a call when
its "name" is one of the request's tools (no arguments: {}); a tag that holds none is dropped.
"""
from __future__ import annotations

from raypaged.serve.tool_call_stream import CallsStream, marker_tail, merged

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(CallsStream):
    def __init__(self, tool_names=None) -> None:
        super().__init__(tool_names)    # each tag's object: one entry of the scanner's list
        self._tag = ""                  # the text inside the current tag
        self._in_tag = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content: list[str] = []
        deltas: list[dict] = []
        while self._buf:
            if self._in_tag:
                if not self._tag_body(deltas):
                    break  # the buffer ends in what may be the start of </tool_call>
                continue
            at = self._buf.find(OPEN)
            if at < 0:
                out = self._buf[:len(self._buf) - marker_tail(self._buf, OPEN,
                                                              not self._calling)]
                if self._calling:  # between or after calls: dropped unless no call is named
                    self._after += out
                else:
                    content.append(out)
                self._buf = self._buf[len(out):]
                break
            before = self._buf[:at]
            if not self._calling:  # the space before the first tag is not content
                content.append(before.rstrip())
                before = before[len(before.rstrip()):]
            self._after += before + OPEN
            self._calling = self._in_tag = True
            self._tag = ""
            self._buf = self._buf[at + len(OPEN):]
        return "".join(content), merged(deltas)

    def _ended(self, deltas: list[dict]) -> None:
        if self._in_tag:  # the sample ended inside a tag (no </tool_call>)
            self._close_tag(deltas)

    def _tag_body(self, deltas: list[dict]) -> bool:
        """Feed the tag's text to the scanner up to </tool_call>; False when the buffer ends
        in a possible start of it."""
        buf = self._buf
        for i, ch in enumerate(buf):
            if self.scanner.at_top:  # the object is closed (or not begun): the tag may end
                rest = buf[i:]
                if rest.startswith(CLOSE):
                    self._took(buf[:i], deltas)
                    self._after += CLOSE
                    self._buf = buf[i + len(CLOSE):]
                    self._close_tag(deltas)
                    return True
                if CLOSE.startswith(rest):
                    self._took(buf[:i], deltas)
                    self._buf = rest
                    return False
            self.scanner.step(ch, deltas)
        self._took(buf, deltas)
        self._buf = ""
        return True

    def _took(self, text: str, deltas: list[dict]) -> None:
        self.scanner.pending(deltas)
        self._tag += text
        self._after += text

    def _close_tag(self, deltas: list[dict]) -> None:
        """A call whose arguments were no object or list (or absent) gets them when its tag
        ends."""
        self._in_tag = False
        self.scanner.close_object(self._tag, deltas)
