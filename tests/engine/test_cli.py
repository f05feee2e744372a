"""`raypaged generate` and `raypaged plan`, run in-process through the console entry point."""
from raypaged.cli import main


def test_generate_answers_the_readme_question(capsys, default_model_dir):
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "16",
               "--kv-memory-mb", "64", "--max-model-len", "512"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_plan_prints_what_fits(capsys, default_model_dir):
    assert main(["plan", "--kv-context-len", "4096", "--max-model-len", "2048", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "bytes per token      46,080" in out
    assert "tokens that fit      4,096" in out
    assert "sequences of max_model_len that fit concurrently  2" in out


def test_plan_refuses_a_max_model_len_that_cannot_fit(capsys, default_model_dir):
    rc = main(["plan", "--max-model-len", "8192", "--kv-memory-mb", "100", "--dtype", "float32"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "set max_model_len <= 2272" in err and "kv_memory_mb=360.0" in err
