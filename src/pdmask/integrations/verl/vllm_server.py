"""verl's vLLM server and replica with the top-K capture of :mod:`.rollout`.

Imports verl's vLLM server module, which imports vLLM at module level: load it through
the replica registry (``rollout.name=pdmask_vllm``), not directly.
"""

from __future__ import annotations

import argparse

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from ...formats.vllm import check_sampling_semantics
from .rollout import TopKEngine, check_max_logprobs, topk_from_config


class PdmaskVLLMHttpServer(vLLMHttpServer):
    """verl's server; ``generate`` also returns the rollout top-K in ``extra_fields``."""

    def _validate_configs(self) -> None:
        super()._validate_configs()
        self._pdmask_k = topk_from_config(self.config)
        if getattr(self.config, "disaggregation", None) is not None and self.config.disaggregation.enabled:
            raise ValueError("rollout.disaggregation.enabled: prefill/decode disaggregation is not supported "
                             "by the pdmask_vllm rollout (the decode peer would not capture the top-K)")
        # Refuses *_logits; warns for raw_logprobs with temperature != 1 or truncation.
        check_sampling_semantics(logprobs_mode=self.config.logprobs_mode, temperature=self.config.temperature,
                                 top_p=self.config.top_p, top_k=self.config.top_k)

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        check_max_logprobs(engine_kwargs, topk_from_config(self.config))

    async def run_server(self, args: argparse.Namespace):
        await super().run_server(args)
        self.engine = TopKEngine(self.engine, topk_from_config(self.config))

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        engine = self.engine
        if isinstance(engine, TopKEngine):
            fields = engine.pop_fields(request_id, logprobs_mode=self.config.logprobs_mode)
            if fields and out.stop_reason != "aborted":
                out.extra_fields.update(fields)
        return out


class PdmaskVLLMReplica(vLLMReplica):
    """``rollout.name=pdmask_vllm``: verl's vLLM replica running :class:`PdmaskVLLMHttpServer`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(PdmaskVLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        return "pdmask_vllm_"
