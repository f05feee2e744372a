"""One definition per setting: flags, Serve arguments and validation all come from the fields."""
import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from raypaged.batch.options import BatchOptions
from raypaged.config import EngineArgs
from raypaged.serve.config import ServeArgs, ServeOptions
from raypaged.settings import add_cli_args, flag, from_namespace, settings_of


@pytest.mark.parametrize("cls", [EngineArgs, ServeOptions])
def test_every_setting_has_a_flag_and_a_serve_argument_unless_marked_otherwise(cls):
    parser = argparse.ArgumentParser()
    add_cli_args(parser, cls)
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in settings_of(cls):
        assert (flag(f.name) in flags) == f.metadata["cli"], f.name
        assert (f.name in ServeArgs.model_fields) == f.metadata["serve"], f.name
        if f.metadata["serve"]:
            assert ServeArgs.model_fields[f.name].default == f.default, f.name


def test_flags_parse_back_into_the_dataclass_with_its_defaults():
    parser = argparse.ArgumentParser()
    add_cli_args(parser, EngineArgs)
    args = from_namespace(EngineArgs, parser.parse_args(
        ["--kv-memory-mb", "64", "--no-enable-prefix-caching", "--block-size", "32"]))
    assert args == EngineArgs(kv_memory_mb=64.0, enable_prefix_caching=False, block_size=32)
    assert from_namespace(EngineArgs, parser.parse_args([])) == EngineArgs()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
    ({"max_num_seqs": True}, "max_num_seqs must be a positive integer, got True"),
    ({"kv_memory_mb": math.nan}, "kv_memory_mb must be > 0, got nan"),
    ({"kv_memory_mb": math.inf}, "kv_memory_mb must be > 0, got inf"),
    ({"enforce_eager": "yes"}, "enforce_eager must be a bool, got 'yes'"),
    ({"attention_backend": "cuda"}, r"attention_backend must be one of \['torch', 'triton'\]"),
    ({"dtype": "fp16"}, r"dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\]"),
])
def test_engine_settings_are_checked_where_they_are_defined(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("args, field", [
    ({"workers": 0}, "workers"),
    ({"kv_memory_mb": 0}, "kv_memory_mb"),
    ({"kv_memory_fraction": 1.5}, "kv_memory_fraction"),
    ({"block_size": 12}, "block_size"),
    ({"route_load_factor": float("nan")}, "route_load_factor"),
    ({"enable_prefix_cache": False}, "enable_prefix_cache"),  # a typo is refused, not ignored
    ({"app_name": "my app"}, "app_name"),
])
def test_serve_arguments_are_checked_by_the_same_definitions(args, field):
    with pytest.raises(ValueError, match=field):
        ServeArgs(**args).split()


def test_two_kv_budgets_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="set at most one KV budget"):
        ServeArgs(kv_memory_mb=64, kv_context_len=4096).split()


def test_serve_arguments_split_into_options_and_the_engine_settings():
    options, engine = ServeArgs(workers=2, kv_memory_mb=64, num_threads=1).split()
    assert options == ServeOptions(workers=2)
    assert engine == dataclasses.replace(EngineArgs(), kv_memory_mb=64.0, num_threads=1)



def test_the_readme_names_every_flag():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [flag(f.name) for cls in (EngineArgs, ServeOptions, BatchOptions)
               for f in settings_of(cls)
               if f.metadata["cli"] and flag(f.name) not in readme]
    assert missing == []


def test_batch_reuses_the_serve_fleet_settings_under_its_own_group():
    serve_fields = {f.name: f for f in dataclasses.fields(ServeOptions)}
    for name in ("workers", "cpus_per_worker", "gpus_per_worker"):
        batch, serve = BatchOptions.__dataclass_fields__[name], serve_fields[name]
        assert batch.default == serve.default, name
        assert {**batch.metadata, "group": None} == {**serve.metadata, "group": None}, name
        assert batch.metadata["group"] == "batch"
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        BatchOptions(workers=0)
    assert BatchOptions().group_prefix_blocks == ServeOptions().route_prefix_blocks == 4
