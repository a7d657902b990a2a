"""Two processes share one disk store directory: one puts, the other gets and releases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specforge_core
from specforge_core.builtin import DiskStoreOptions
from specforge_core.contracts import SampleRef
from specforge_core.errors import SampleNotFoundError, StaleRefError
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.protocols import BuildContext
from specforge_core.testing.feature_store_suite import assert_same_tensors, sample_tensors

# The other process: attach to the store, read and release the sample this process put,
# re-put the shared sample, put one of its own, and report its refs as JSON lines.
CONSUMER = """
import json, sys
from specforge_core.builtin import DiskStoreOptions
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.contracts import SampleRef
from specforge_core.protocols import BuildContext
from specforge_core.testing.feature_store_suite import assert_same_tensors, sample_tensors

path, token, ref_json = sys.argv[1:4]
store = DiskFeatureStore(DiskStoreOptions(path=path, token=token, consume_once=True), BuildContext(run_id="child"))
ref = SampleRef.from_json(ref_json)
assert_same_tensors(store.get(ref), sample_tensors(seed=1))
store.release(ref)
print(store.put("shared", sample_tensors(seed=3)).to_json())
print(store.put("from-child", sample_tensors(seed=2), {"pid": 1}).to_json())
print(json.dumps(store.stats()))
"""


def run_other_process(*args: str) -> list[str]:
    repo = str(Path(specforge_core.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", CONSUMER, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_sample_put_by_one_process_is_read_and_released_by_another(tmp_path):
    store = DiskFeatureStore(DiskStoreOptions(path=str(tmp_path / "store"), token="t0k", consume_once=True),
                             BuildContext(run_id="parent"))
    ref = store.put("from-parent", sample_tensors(seed=1))
    shared_old = store.put("shared", sample_tensors(seed=0))

    shared_line, child_line, stats_line = run_other_process(str(tmp_path / "store"), "t0k", ref.to_json())

    with pytest.raises(SampleNotFoundError, match="'from-parent'.*released, aborted or never stored"):
        store.get(ref)
    shared_new = SampleRef.from_json(shared_line)
    assert shared_new.generation > shared_old.generation
    with pytest.raises(StaleRefError, match=f"{shared_old.generation}.*{shared_new.generation}"):
        store.get(shared_old)
    child_ref = SampleRef.from_json(child_line)
    assert child_ref.store == store.uri
    assert_same_tensors(store.get(child_ref), sample_tensors(seed=2))
    assert store.scan() == [child_ref, shared_new]
    assert json.loads(stats_line)["releases"] == 1
