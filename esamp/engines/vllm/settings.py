"""How ESamp settings travel through vLLM. Pure Python: no vLLM import.

Two channels, both public:

- Engine-wide settings (tap layers, Distiller rank/lr/optimizer/slots/seed) go in
  ``additional_config={"esamp": {...}}``. vLLM hashes that dict into its compile-cache key, so a
  change of tap layers never reuses a graph traced for other layers.
- Per-request settings go in ``SamplingParams.extra_args={"esamp": {...}}``: the group key and
  sample index (state is keyed by these, never by row), on/off, beta, mix, train, and the
  request's real temperature / top-k / top-p / min-p. An ESamp request hands vLLM *neutral*
  filters (T=1, top-k off, top-p 1, min-p 0, or T=0 for greedy) so that the processor owns the
  candidate filter and the mix is exact post-filter (DESIGN §3).
"""

from __future__ import annotations

from esamp.core.config import EsampConfig, SamplingConfig
from esamp.errors import ConfigError

KEY = "esamp"

# base architecture → the ESamp subclass registered for it
ARCHITECTURES = {
    "LlamaForCausalLM": "EsampLlamaForCausalLM",
    "Qwen2ForCausalLM": "EsampQwen2ForCausalLM",
}


def esamp_architecture(base: str) -> str:
    try:
        return ARCHITECTURES[base]
    except KeyError:
        raise ConfigError(
            f"ESamp on vLLM does not support the architecture {base!r} yet",
            hint="supported: " + ", ".join(ARCHITECTURES) + "; or use --engine reference",
        ) from None


def resolve_layer(index: int, num_layers: int, what: str) -> int:
    """A tap layer index (negative counts from the end) as 0..L-1, or a ConfigError."""
    if not -num_layers <= index < num_layers:
        raise ConfigError(
            f"{what} layer {index} is out of range for a {num_layers}-layer model",
            hint=f"choose a layer between {-num_layers} and {num_layers - 1}",
        )
    return index % num_layers


def engine_settings(esamp: EsampConfig, num_layers: int) -> dict:
    """The ``additional_config["esamp"]`` dict: taps resolved to 0..L-1 and the bank settings."""
    return {
        "source_layer": resolve_layer(esamp.source_layer, num_layers, "source"),
        "target_layer": resolve_layer(esamp.target_layer, num_layers, "target"),
        "rank": esamp.rank,
        "lr": esamp.lr,
        "optimizer": esamp.optimizer,
        "slots": esamp.slots,
        "seed": esamp.seed,
    }


def request_settings(group: str, sample: int, esamp: EsampConfig, sampling: SamplingConfig) -> dict:
    """The ``extra_args["esamp"]`` dict of one sample of a group."""
    return {
        "group": group,
        "sample": sample,
        "on": bool(esamp.enabled),
        "beta": float(esamp.beta),
        "mix": esamp.mix,
        "train": bool(esamp.train),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k),
        "top_p": float(sampling.top_p),
        "min_p": float(sampling.min_p),
    }


def vllm_filters(esamp_on: bool, sampling: SamplingConfig) -> dict:
    """The filters vLLM itself applies: the real ones when ESamp is off, neutral ones when on."""
    if not esamp_on:
        return dict(temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k, min_p=sampling.min_p)
    # The processor already divided by T and masked outside C; vLLM must only draw.
    greedy = sampling.temperature == 0
    return dict(temperature=0.0 if greedy else 1.0, top_p=1.0, top_k=0, min_p=0.0)


def parse_request_settings(extra: dict | None) -> dict | None:
    """Validate ``extra_args["esamp"]``; None when the request carries no ESamp settings."""
    if not extra or KEY not in extra:
        return None
    s = extra[KEY]
    if not isinstance(s, dict):
        raise ValueError("extra_args['esamp'] must be a dict")
    missing = [k for k in ("group", "sample") if k not in s]
    if missing:
        raise ValueError(f"extra_args['esamp'] lacks {', '.join(missing)}")
    if s.get("mix", "paper") not in ("paper", "unsharpened"):
        raise ValueError(f"extra_args['esamp']['mix'] must be 'paper' or 'unsharpened', not {s['mix']!r}")
    beta = float(s.get("beta", 0.8))
    if not 0.0 <= beta <= 10.0:
        raise ValueError(f"extra_args['esamp']['beta'] must be in [0, 10], not {beta}")
    out = {
        "group": str(s["group"]),
        "sample": int(s["sample"]),
        "on": bool(s.get("on", True)),
        "beta": beta,
        "mix": s.get("mix", "paper"),
        "train": bool(s.get("train", True)),
        "temperature": float(s.get("temperature", 1.0)),
        "top_k": int(s.get("top_k", 0)),
        "top_p": float(s.get("top_p", 1.0)),
        "min_p": float(s.get("min_p", 0.0)),
    }
    if out["temperature"] < 0 or not 0 < out["top_p"] <= 1 or not 0 <= out["min_p"] < 1 or out["top_k"] < 0:
        raise ValueError(f"extra_args['esamp'] has an invalid filter: {out}")
    return out
