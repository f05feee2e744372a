"""Input files for the batch tests."""
from __future__ import annotations

import json
from pathlib import Path


def openai_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def numbered_prompts(n: int, max_tokens: int = 6) -> list[str]:
    """n completion lines, ids r0..r{n-1}, two shared prefixes (every second row)."""
    shared = ["You are a terse assistant. Answer with one word. " * 3,
              "Reply in French, politely and briefly, to the user. " * 3]
    return [openai_line(f"r{i}", "/v1/completions",
                        {"prompt": f"{shared[i % 2]}Question {i}: name a colour.",
                         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            for i in range(n)]
