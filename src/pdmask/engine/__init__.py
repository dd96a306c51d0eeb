"""Rollout engines: the shared interface (:mod:`.base`), the transformers backend
(:mod:`.hf`), precisions (:mod:`.precision`) and the backend factory (:mod:`.registry`)."""

from .base import RolloutBatch, RolloutEngine
from .registry import ENGINES, build_engine, make_engine, register_engine

__all__ = ["ENGINES", "RolloutBatch", "RolloutEngine", "build_engine", "make_engine", "register_engine"]
