"""`decode_threads`: decode-only steps run with fewer torch threads, every other step with all."""
from __future__ import annotations

import torch

from raypaged import LLM, SamplingParams


def test_decode_steps_switch_to_decode_threads_and_prefill_steps_back(default_model_dir,
                                                                      monkeypatch):
    before = torch.get_num_threads()
    llm = LLM(str(default_model_dir), dtype="float32", kv_memory_mb=32, max_model_len=256,
              num_threads=2, decode_threads=1)
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(["The capital of France is"], greedy, use_tqdm=False)
        llm.generate(["One more prompt"], greedy, use_tqdm=False)
    finally:
        real(before)
    # prompt step with 2 (already set: no call), 3 decode steps with 1; the next prompt back to 2
    assert calls == [1, 2, 1]
