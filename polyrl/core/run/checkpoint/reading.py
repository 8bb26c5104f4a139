"""Reading DCP checkpoints without unpickling arbitrary objects: DCP's ``.metadata`` (a pickle) through an
allow-listed unpickler (polyrl.core.run.integrity), its non-tensor values through ``torch.load(weights_only=True)``."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyrl.core import distributed as D
from polyrl.core.run.integrity import MetadataUnpickler, read_metadata


def _safe_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(Path(self.path) / name, "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def _safe_planner() -> Any:
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP stores non-tensor values (optimizer hyper-parameters) as torch.save bytes; read them safely."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``dcp.load`` in place, with the safe reader and planner. Works with or without a process group."""
    import torch.distributed.checkpoint as dcp

    # Read the metadata once up front so a refused or corrupt file surfaces as a plain CheckpointRefused
    # (inside dcp.load it would come back wrapped in a per-rank CheckpointException).
    read_metadata(Path(path) / ".metadata")
    with quiet_single_process():
        dcp.load(state_dict, storage_reader=_safe_reader(Path(path)), planner=_safe_planner(),
                 no_dist=not D.is_distributed())


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group that it assumes a single process: that is our
    # intended single-process mode, not news.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
