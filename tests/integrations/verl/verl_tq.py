"""TransferQueue's SimpleStorage backend in one process, for the v1 data-path test.

verl 0.9.1's v1 trainer moves every sample through TransferQueue (``transfer_queue``
0.1.x): the agent loop ``async_kv_batch_put`` s the fields of each trajectory, the trainer
``kv_batch_get`` s / ``kv_batch_put`` s columns (old log-probs, advantages), and the actor
worker's ``tqbridge`` turns the ``KVBatchMeta`` it is handed into a ``TensorDict``. The real
backend runs a controller and storage units as Ray actors talking over ZMQ; Ray does not
start in this sandbox, so :class:`InProcessTQ` keeps TransferQueue's own data handling and
drops only the actors and sockets:

- put: the storage manager's column slicing
  (``AsyncSimpleStorageManager._select_by_positions``), the request encoded and decoded with
  TransferQueue's wire codec (``ZMQMessage.serialize`` / ``deserialize``: msgpack with its
  tensor / numpy / pickle extensions), stored per sample and field in the storage unit's
  own ``StorageUnitData``;
- get: ``StorageUnitData.get_data``, the response through the same codec, the columns
  re-packed by ``AsyncSimpleStorageManager._pack_field_values`` (nested jagged tensors for
  ragged tensor columns, ``NonTensorStack`` for everything else);
- a worker's output (decoupled mode's old-log-prob pass): the bridge's ``async_put``, as a put.

The object stands in for the ``transfer_queue`` module (``tq``) in the verl modules that
import it, and for the client ``tq.get_client()`` returns.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict


@dataclass
class _Meta:
    """The part of TransferQueue's ``BatchMeta`` that verl's bridge reads."""

    keys: list[str]
    partition_id: str
    fields: list[str] | None = None
    extra_info: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.size

    def select_fields(self, fields: list[str]) -> "_Meta":
        return _Meta(self.keys, self.partition_id, list(fields), copy.deepcopy(self.extra_info))

    # what verl's bridge reads of the BatchMeta an output put returns (batch_meta2kv_batch_meta);
    # the stand-in's global indexes are the keys themselves (async_kv_retrieve_keys)
    @property
    def partition_ids(self) -> list[str]:
        return [self.partition_id] * len(self.keys)

    @property
    def global_indexes(self) -> list[str]:
        return list(self.keys)

    @property
    def field_names(self) -> list[str] | None:
        return self.fields


class InProcessTQ:
    def __init__(self):
        from transfer_queue.storage.simple_storage import StorageUnitData

        self._unit_cls = StorageUnitData
        self.units: dict[str, Any] = {}          # partition -> StorageUnitData
        self.index: dict[str, dict[str, int]] = {}  # partition -> key -> global index
        self.tags: dict[str, dict[str, dict]] = {}
        self.puts: list[tuple[str, list[str]]] = []  # (partition, field names) of every put

    # ----------------------------------------------------------------- storage
    @staticmethod
    def _wire(body: dict, request: str) -> dict:
        from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

        msg = ZMQMessage.create(request_type=getattr(ZMQRequestType, request), sender_id="client",
                                receiver_id="unit", body=body)
        return ZMQMessage.deserialize(msg.serialize()).body

    def _put(self, keys: list[str], partition_id: str, fields: TensorDict) -> list[str]:
        from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager as Manager

        idx = self.index.setdefault(partition_id, {})
        gi = [idx.setdefault(k, len(idx)) for k in keys]
        positions = list(range(len(keys)))
        data = {f: Manager._select_by_positions(fields[f], positions) for f in fields.keys()}
        body = self._wire({"global_indexes": gi, "data": data, "data_parser": None}, "PUT_DATA")
        unit = self.units.setdefault(partition_id, self._unit_cls())
        unit.put_data(body["data"], body["global_indexes"])
        self.puts.append((partition_id, sorted(fields.keys())))
        return sorted(unit.field_data)

    def _get(self, keys: list[str], partition_id: str, select_fields=None) -> TensorDict:
        from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager as Manager

        unit = self.units[partition_id]
        gi = [self.index[partition_id][k] for k in keys]
        if isinstance(select_fields, str):
            select_fields = [select_fields]
        # BatchMeta.select_fields keeps only the fields that exist (verl asks for optional
        # columns such as ref_log_prob and values whether or not they were written)
        names = [f for f in select_fields if f in unit.field_data] if select_fields is not None \
            else sorted(unit.field_data)
        body = self._wire({"data": unit.get_data(names, gi)}, "GET_DATA_RESPONSE")
        return TensorDict({f: Manager._pack_field_values(v) for f, v in body["data"].items()},
                          batch_size=len(keys))

    def _kv_meta(self, keys, partition_id, tags, fields):
        from transfer_queue import KVBatchMeta

        store = self.tags.setdefault(partition_id, {})
        for k, t in zip(keys, tags or [None] * len(keys), strict=True):
            if t is not None:
                store.setdefault(k, {}).update(t)
        return KVBatchMeta(keys=list(keys), tags=[dict(store.get(k, {})) for k in keys], partition_id=partition_id,
                           fields=fields)

    # ----------------------------------------------------------------- the tq API verl calls
    def init(self, *args, **kwargs):
        return None

    def get_client(self):
        return self

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        names = self._put(keys, partition_id, fields) if fields is not None else None
        return self._kv_meta(keys, partition_id, tags, names)

    async def async_kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        return self.kv_batch_put(keys, partition_id, fields=fields, tags=tags)

    async def async_kv_put(self, key, partition_id, fields=None, tag=None):
        return self.kv_batch_put([key], partition_id, fields=fields, tags=[tag])

    def kv_batch_get(self, keys, partition_id, select_fields=None) -> TensorDict:
        return self._get(keys, partition_id, select_fields)

    # client side of verl.utils.transferqueue_utils (the actor worker's bridge)
    async def async_kv_retrieve_meta(self, keys, partition_id, create=False) -> _Meta:
        return _Meta(list(keys), partition_id)

    async def async_get_data(self, meta: _Meta) -> TensorDict:
        return self._get(meta.keys, meta.partition_id, meta.fields)

    async def async_put(self, data: TensorDict, metadata: _Meta) -> _Meta:
        """A worker's output written back (``tqbridge``: every tensor field of the TensorDict)."""
        names = self._put(metadata.keys, metadata.partition_id, data)
        return _Meta(list(metadata.keys), metadata.partition_id, names)

    async def async_kv_retrieve_keys(self, global_indexes, partition_id) -> list[str]:
        return list(global_indexes)


def install(monkeypatch) -> InProcessTQ:
    """Point every verl module that talks to TransferQueue at one in-process store."""
    import verl.trainer.ppo.v1.agent_loop_tq as agent_loop_tq
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    import verl.utils.transferqueue_utils as tqu

    store = InProcessTQ()
    for mod in (agent_loop_tq, trainer_base, tqu):
        monkeypatch.setattr(mod, "tq", store)
    monkeypatch.setattr(tqu, "TQ_INITIALIZED", True)
    return store
