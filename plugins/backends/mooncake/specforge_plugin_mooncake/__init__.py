"""specforge-plugin-mooncake: the ``mooncake`` feature store.

This module is what the ``specforge`` entry point loads, so it stays cheap: neither torch
nor mooncake is imported here. The store lives in :mod:`specforge_plugin_mooncake.store`
and is imported only when a run asks for it.
"""

import attrs

from specforge_core import hookimpl
from specforge_core.options import non_negative, option, positive
from specforge_core.specs import FeatureStoreSpec

__version__ = "0.1.0"

MIB = 2**20


@attrs.frozen
class MooncakeStoreOptions:
    """Options of the ``mooncake`` feature store."""

    master_address: str = option("127.0.0.1:50051", "host:port of the mooncake_master RPC service.")
    metadata_server: str = option("http://127.0.0.1:8080/metadata",
                                  "Transfer-engine metadata server: the master's own HTTP metadata server "
                                  "(mooncake_master --enable_http_metadata_server=true) or another URL Mooncake "
                                  "accepts (etcd://..., P2PHANDSHAKE).")
    local_hostname: str = option("127.0.0.1", "Address other nodes reach this process's transfer engine at; "
                                              "set it to this node's IP when producer and consumer run on "
                                              "different nodes.")
    protocol: str = option("tcp", "Transfer protocol. Only tcp is supported (and tested) by this plugin.",
                           choices=("tcp",))
    namespace: str | None = option(None, "Key prefix of this store's objects; producer and consumer of one run "
                                         "must use the same. Defaults to the run id.")
    global_segment_size: int = option(2048 * MIB, "Bytes of this process's memory lent to the Mooncake cluster "
                                                  "(samples of any process may be placed there); 0 lends none. "
                                                  "Objects in it vanish when this process exits.",
                                      check=non_negative)
    local_buffer_size: int = option(128 * MIB, "Bytes of the client's registered transfer buffer.", check=positive)
    consume_once: bool = option(True, "release() deletes the sample (disaggregated streaming). False keeps it "
                                      "until abort (several epochs over one producer's output).")
    pin: bool = option(True, "Hard-pin stored objects so Mooncake never evicts them: a put into full segments "
                             "raises StoreFullError instead. False lets Mooncake evict samples under memory "
                             "pressure; a get of an evicted sample then raises SampleNotFoundError.")
    checksums: bool = option(True, "Record an xxh3-64 checksum of every tensor at put and check it at get. "
                                   "The size, shape and identity checks always run.")
    token: str | None = option(None, "Shared secret recorded in the namespace on first use and checked on "
                                     "attach, so two jobs cannot mix up one namespace.")
    connect_timeout_s: float = option(5.0, "How long to wait for the master and metadata server to accept a "
                                           "connection before failing (Mooncake's own setup would block "
                                           "for about 90 s).", check=positive)
    lease_wait_s: float = option(15.0, "How long close() keeps retrying deletions the master refused because "
                                       "the object was read recently (its read lease, --default_kv_lease_ttl).",
                                 check=non_negative)


@hookimpl
def specforge_feature_stores():
    return [
        FeatureStoreSpec(
            name="mooncake",
            factory="specforge_plugin_mooncake.store:MooncakeStore",
            options=MooncakeStoreOptions,
            capabilities={"cross_process", "consume_once", "retain"},
            description="Mooncake Store objects (one per sample) shared by processes on several nodes.",
        )
    ]
