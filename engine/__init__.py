"""kvsentry engine: paged KV cache, continuous batching, DP/EP ranks, NaN sentinel."""
from engine.config import EngineConfig
from engine.paging import NULL_BLOCK_ID, PAD_SLOT_ID
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and the models; import it lazily so light users stay light.
    if name == "LLM":
        from engine.frontend.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "PAD_SLOT_ID", "NULL_BLOCK_ID"]
