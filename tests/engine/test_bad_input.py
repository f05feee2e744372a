"""Bad input gets a clear error that names the problem, and the engine keeps serving others."""
import pytest

from raypaged import LLM, SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, r"max_tokens must be an integer >= 1 .*got 0"),
    ({"max_tokens": -5}, r"max_tokens must be an integer >= 1 .*got -5"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_k": -3}, "top_k must be -1"),
    ({"n": 0}, "n must be an integer >= 1"),
    ({"min_tokens": 9, "max_tokens": 4}, r"min_tokens must be <= max_tokens \(4\)"),
    ({"logprobs": 50}, r"logprobs must be an integer in \[0, 20\]"),
])
def test_invalid_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_folder_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        LLM(str(missing))


def test_unsupported_architecture_says_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_unknown_llm_argument_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown LLM argument\(s\) \['gpu_memory'\]"):
        LLM(gpu_memory=0.5)


def test_prompt_longer_than_max_model_len_is_refused_and_others_still_run(llm):
    long_prompt = {"prompt_token_ids": [42] * 1024}
    with pytest.raises(ValueError, match=r"prompt 1: the prompt is 1024 tokens but max_model_len is 1024"):
        llm.generate(["Hello", long_prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the accepted prompt 0 was withdrawn, not leaked
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.stats().memory.blocks_used == 0


def test_prompt_plus_max_tokens_over_the_limit_says_both(llm):
    with pytest.raises(ValueError, match=r"maximum context length is 1024 tokens.*1000 in the prompt, 100 max_tokens"):
        llm.generate({"prompt_token_ids": [7] * 1000}, SamplingParams(max_tokens=100), use_tqdm=False)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 49152\)"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, use_tqdm=False)


def test_mismatched_sampling_params_list():
    from raypaged.llm import LLM as _LLM  # noqa: F401 - the check runs before any model work
    with pytest.raises(ValueError, match="got 2 sampling_params for 3 prompts"):
        _LLM.generate(object.__new__(_LLM), ["a", "b", "c"], [SamplingParams()] * 2)
