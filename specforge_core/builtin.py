"""The core's built-in plugin: the embedded feature stores and control planes.

Registered through the same hooks as any installed plugin (its plugin name is
``builtin``), so it is listed by ``specforge plugins`` and can be disabled or shadowed
like any other. Implementations are named lazily; this module imports nothing heavy.
"""

from __future__ import annotations

import attrs

from . import hookimpl
from .options import non_negative, option, positive
from .specs import ControlPlaneSpec, FeatureStoreSpec


@attrs.frozen
class MemoryStoreOptions:
    """Options of the ``memory`` feature store."""

    max_bytes: int | None = option(None, "Cap on resident tensor bytes; a put beyond it raises StoreFullError "
                                         "(nothing is stored or lost). None means no cap.", check=positive)
    consume_once: bool = option(True, "release() frees the sample (online runs). False keeps every sample "
                                      "until abort/close (re-iterable, many epochs).")


@attrs.frozen
class DiskStoreOptions:
    """Options of the ``disk`` feature store."""

    path: str | None = option(None, "Directory of the store. Defaults to OUTPUT/features for a run.")
    consume_once: bool = option(False, "release() deletes the sample's file (disaggregated streaming). "
                                       "False retains files for many epochs (offline).")
    token: str | None = option(None, "Shared secret written on creation and checked on attach, so two jobs "
                                     "cannot mix up one directory.")
    fsync: bool = option(True, "fsync each file and the directory before a put returns (crash safety).")
    verify_checksums: bool = option(False, "Check each tensor's checksum (xxh3-64, or the crc32c / crc32 of files "
                                           "written by earlier releases) on every get, catching flipped bytes. Costs "
                                           "a pass over the data, cheap on the CPU's vector units; header, size and "
                                           "shape checks always run.")


@attrs.frozen
class LocalControlPlaneOptions:
    """Options of the in-process control planes (``local``, ``noop``)."""

    max_queue: int = option(0, "Bound of the in-process ref queue (0 = unbounded).", check=non_negative)


@attrs.frozen
class SqliteControlPlaneOptions:
    """Options of the ``sqlite`` control plane (durable metadata + JSONL ref channel)."""

    path: str | None = option(None, "Directory holding metadata.sqlite and refs.jsonl. Defaults to "
                                    "OUTPUT/control for a run; share it between producer and consumer.")
    high_watermark: int = option(1024, "Producer pauses when this many published refs are not yet consumed.",
                                 check=positive)
    low_watermark: int = option(256, "Paused producer resumes when the backlog falls to this.", check=non_negative)
    idle_timeout_s: float = option(600.0, "Consumer gives up with ChannelTimeoutError after this long "
                                          "without a new ref or a heartbeat.", check=positive)
    poll_interval_s: float = option(0.05, "Sleep between polls of the channel file while waiting.", check=positive)


@hookimpl
def specforge_feature_stores():
    return [
        FeatureStoreSpec(
            name="memory", factory="specforge_core.feature_stores.memory:MemoryFeatureStore",
            options=MemoryStoreOptions, capabilities={"consume_once", "retain"},
            description="In-process tensors for online colocated runs.",
        ),
        FeatureStoreSpec(
            name="disk", factory="specforge_core.feature_stores.disk:DiskFeatureStore",
            options=DiskStoreOptions, capabilities={"consume_once", "retain", "cross_process", "persistent"},
            description="A directory of safetensors files, one per sample (a finished capture's moved into ~1 GiB "
                        "packs, read through kept maps); also the shared-dir store.",
        ),
    ]


@hookimpl
def specforge_control_planes():
    return [
        ControlPlaneSpec(
            name="local", factory="specforge_core.control_planes.local:LocalControlPlane",
            options=LocalControlPlaneOptions, capabilities={"dedup"},
            description="In-memory metadata with dedup and an in-process ref queue (the default).",
        ),
        ControlPlaneSpec(
            name="noop", factory="specforge_core.control_planes.local:NoopControlPlane",
            options=LocalControlPlaneOptions, capabilities=set(),
            description="No bookkeeping: an in-process ref queue only.",
        ),
        ControlPlaneSpec(
            name="sqlite", factory="specforge_core.control_planes.sqlite:SqliteControlPlane",
            options=SqliteControlPlaneOptions, capabilities={"dedup", "durable", "cross_process"},
            description="Durable SQLite metadata (WAL) plus an fsynced JSONL ref channel on a shared directory.",
        ),
    ]
