"""One MoE-LoRA layer over several processes (``torch.distributed``: NCCL on GPUs, gloo on the CPU).

* :func:`ep_layer` (``dist.ep``): expert parallelism, pairs dispatched to the rank owning their
  expert with all-to-all and combined back;
* :func:`tp_layer` (``dist.tp``): tensor parallelism with the LoRA replicated-A or fully sharded;
* :class:`ExpertPartition`, :func:`shard_tp` (``dist.partition``): who holds which weights;
* ``dist.comm``: the bytes each step moves, next to ``profile.traffic``'s byte model;
* :func:`run_local` (``dist.launch``): W local processes in one group, from a script or a notebook;
* ``dist.agree``: both layers check every input on every rank before their first collective, and every
  rank raises the same error, naming the rank that holds the bad input.

The process group is always an argument (default: the world group).
"""
from .comm import ep_bytes, tp_bytes
from .ep import ep_layer
from .launch import run_local
from .partition import ExpertPartition, shard_tp
from .tp import tp_layer

__all__ = ["ExpertPartition", "ep_bytes", "ep_layer", "run_local", "shard_tp", "tp_bytes", "tp_layer"]
