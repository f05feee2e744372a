"""What the model code needs to know about a checkpoint, parsed once from a Hugging Face config.json.

Only the Llama family is supported: Llama (incl. SmolLM2), Mistral and Qwen2 share one decoder
(RMSNorm, rotary embeddings, grouped-query attention, SiLU-gated MLP). They differ in
  - Qwen2: bias on the q/k/v projections (not on o_proj);
  - Llama: optional `attention_bias`, which puts a bias on q/k/v *and* o_proj;
  - Mistral v0.1: a sliding attention window (see `ModelConfig.max_model_len`).
Anything we would compute wrongly (another activation, an unknown rope scaling) is refused here,
with a message that says what was found, rather than producing plausible garbage later.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# config.json files written without "architectures" still carry a model_type.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURE_BY_MODEL_TYPE.values())
SUPPORTED_ROPE_SCALING = ("llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. "linear" divides positions by `factor`; "llama3" rescales
    only the low frequencies, blending smoothly between `low_freq_factor` and `high_freq_factor`
    wavelengths of the original context (Llama 3.1's long-context recipe)."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool          # q/k/v projections carry a bias
    o_proj_bias: bool             # o_proj carries a bias (Llama attention_bias=True only)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None

    @property
    def max_model_len(self) -> int:
        """Longest sequence we serve. We attend over the full context, so with a sliding window
        (Mistral v0.1: 4096) our results equal the reference model's only up to the window's
        length; rather than diverge silently past it, we cap the context there."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any],
                  generation_config: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Parse a config.json dict. End-of-sequence ids come from config.json and, when given,
        generation_config.json (instruct models often list their end-of-turn token only there)."""
        arch = _architecture(cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported: {arch} is computed with 'silu'")
        if cfg.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (no supported checkpoint uses it)")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = _rope(cfg)
        qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        # Qwen2 configs carry a sliding_window value but only use it when use_sliding_window is set.
        window = None if qwen2 and not cfg.get("use_sliding_window") else cfg.get("sliding_window")
        eos = _token_ids(cfg.get("eos_token_id"))
        if generation_config:
            eos += tuple(t for t in _token_ids(generation_config.get("eos_token_id")) if t not in eos)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `model_dir`/config.json (and generation_config.json if present)."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist: expected a Hugging "
                                    "Face model folder with config.json and *.safetensors")
        path = model_dir / "config.json"
        if not path.is_file():
            found = sorted(p.name for p in model_dir.iterdir())
            raise FileNotFoundError(f"no config.json in {model_dir}: expected a Hugging Face model "
                                    f"folder (config.json + *.safetensors); found {found}")
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_dict(json.loads(path.read_text()), gen)


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in _ARCHITECTURE_BY_MODEL_TYPE:
        archs = [_ARCHITECTURE_BY_MODEL_TYPE[cfg["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = archs or f"no architectures (model_type={cfg.get('model_type')!r})"
    raise ValueError(f"unsupported model architecture: found {found}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers < 5 writes rope_theta + rope_scaling; 5.x writes one rope_parameters dict.
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"rope scaling type {kind!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_SCALING)} (or none)")
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    fields = {"low_freq_factor": float, "high_freq_factor": float,
              "original_max_position_embeddings": int}  # absent ones: RopeScaling's defaults
    given = {name: cast(params[name]) for name, cast in fields.items() if name in params}
    return theta, RopeScaling("llama3", float(params["factor"]), **given)


def _token_ids(value: Any) -> tuple[int, ...]:
    """None, one id, or a list of them."""
    values = () if value is None else value if isinstance(value, (list, tuple)) else (value,)
    return tuple(int(v) for v in values)
