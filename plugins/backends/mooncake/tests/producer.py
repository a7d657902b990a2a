"""The producer side of the two-process test: run as a script, never collected by pytest.

``python producer.py MASTER METADATA_URL NAMESPACE COUNT [SEGMENT_BYTES]`` puts sample ``s0``
once (its ref is printed as ``stale``), then ``s0`` .. ``s<COUNT-1>`` (``s0`` again, which
makes the first ref stale), printing one JSON line per ref and then ``ready``. It keeps
running, so the samples its segment holds stay available, until a ``done`` line on stdin;
then it prints its stats and exits. ``SEGMENT_BYTES`` is the memory it lends (32 MiB by
default; 0 places its samples in other processes' segments).
"""

import json
import sys

from specforge_core.protocols import BuildContext
from specforge_core.testing.feature_store_suite import sample_tensors
from specforge_plugin_mooncake import MooncakeStoreOptions
from specforge_plugin_mooncake.store import MooncakeStore


def main(master: str, metadata: str, namespace: str, count: int, segment_bytes: int = 32 * 2**20) -> None:
    options = MooncakeStoreOptions(master_address=master, metadata_server=metadata, namespace=namespace,
                                   global_segment_size=segment_bytes, local_buffer_size=16 * 2**20)
    with MooncakeStore(options, BuildContext(run_id="producer", role="producer")) as store:
        first = store.put("s0", sample_tensors(tokens=2, seed=99))
        print(json.dumps({"kind": "stale", "ref": first.to_json()}), flush=True)
        for index in range(count):
            ref = store.put(f"s{index}", sample_tensors(tokens=3 + index, seed=index))
            print(json.dumps({"kind": "ref", "ref": ref.to_json()}), flush=True)
        print(json.dumps({"kind": "ready"}), flush=True)
        if sys.stdin.readline().strip() != "done":
            raise SystemExit("expected 'done' on stdin")
        stats = store.stats()
        print(json.dumps({"kind": "stats", "samples": stats["samples"], "puts": stats["puts"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *map(int, sys.argv[5:6]))
