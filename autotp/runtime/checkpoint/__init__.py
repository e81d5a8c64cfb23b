"""Checkpoints: a parallel module's weights read from, and written to, files on every rank.

Input: a :class:`~autotp.runtime.module.ParallelModule` (and its optimizer), or a HuggingFace
folder. Output: files, or this rank's shards. Every rank reads or writes only its own slices,
and whatever a rank meets alone (a missing file, a damaged shard, a failed rename) is agreed by
all of them, so a checkpoint is published whole or not at all and a failure is raised on every
rank, never a hang.

- :mod:`.hf`          HuggingFace safetensors: read this rank's slices of a folder; gather one folder
  (``gather_to_hf``) that transformers loads; the retired per-rank ``save_sharded`` / ``load_sharded``
- :mod:`.loading`     ``from_pretrained``'s reading: the model on the meta device, the buffers the
  checkpoint lacks, each rank's weights from :mod:`.hf`
- :mod:`.dcp`         training checkpoints through torch.distributed.checkpoint (``save``, ``async_save``,
  ``load``), loadable at another tp (``autotp.runtime.dcp``, the path the README shows, is this module)
- :mod:`.dcp_safety`  what makes those safe across ranks: agreed failures, atomic publication, verification
"""
from .hf import CheckpointReader, gather_to_hf, load_sharded, save_sharded

__all__ = ["CheckpointReader", "gather_to_hf", "save_sharded", "load_sharded"]
