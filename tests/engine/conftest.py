"""Engine tests on the real default model (SmolLM2-135M-Instruct, fp32, CPU)."""
from __future__ import annotations

import pytest

from engine_prompts import PROMPTS



@pytest.fixture(scope="session")
def llm(default_model_dir):
    from raypaged import LLM

    return LLM(str(default_model_dir), dtype="float32", kv_memory_mb=128, max_model_len=1024)


@pytest.fixture(scope="session")
def hf_greedy(default_model_dir, llm):
    """Hugging Face transformers' greedy continuation (32 tokens, EOS not special) of each prompt.

    A plain argmax loop over the HF model with its KV cache: generate()'s min_new_tokens would
    mask EOS, which pure greedy decoding (our ignore_eos) does not."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            res = model(ids, use_cache=True)
            toks = []
            for _ in range(32):
                nxt = int(res.logits[0, -1].argmax())
                toks.append(nxt)
                res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
            out.append(toks)
    return out
