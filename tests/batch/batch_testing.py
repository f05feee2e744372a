"""What every batch test shares (a named module: `conftest` is ambiguous across test folders)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# fp32: greedy tokens must not depend on which rows share a step (bf16 can flip a token).
ENGINE = dict(dtype="float32", kv_memory_mb=32, max_model_len=512, max_num_seqs=16)
