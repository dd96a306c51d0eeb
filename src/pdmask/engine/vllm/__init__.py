"""vLLM rollout backend of the built-in trainer (``engine: vllm``); see :mod:`.engine`.

Importing this package registers the ``vllm`` factory with :mod:`pdmask.engine.registry`;
vLLM itself is imported only when an engine is built."""

from ..registry import register_engine
from .engine import VLLMEngine, make_vllm_engine
from .support import INSTALL_HINT, PRECISIONS, check_installed, import_vllm, parse_flat_prompt_logprobs, request_seeds

__all__ = ["INSTALL_HINT", "PRECISIONS", "VLLMEngine", "check_installed", "import_vllm", "make_vllm_engine",
           "parse_flat_prompt_logprobs", "request_seeds"]

register_engine("vllm", make_vllm_engine)
