"""Small models LazyTrain builds from a config with no download (the default job and the tests)."""
from .decoder import DecoderConfig, TinyDecoder, build_causal_lm

__all__ = ["DecoderConfig", "TinyDecoder", "build_causal_lm"]
