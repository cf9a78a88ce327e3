"""The real node's files, checked without starting it: the pause image archive is a valid OCI
layout, and the node's configuration keeps every pod inside this process's own cgroup."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from devtools.cluster import realnode


def test_the_pause_archive_is_an_oci_layout_whose_digests_and_layer_hold(tmp_path):
    program = tmp_path / "pause"
    program.write_bytes(b"\x7fELF not really, but bytes")
    archive = tarfile.open(fileobj=io.BytesIO(realnode.pause_archive(program)))
    files = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == realnode.pause_image()
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    (layer,) = manifest["layers"]
    layer_bytes = files[f"blobs/sha256/{layer['digest'].split(':')[1]}"]
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]  # uncompressed: diff ID = digest
    assert config["config"]["Entrypoint"] == ["/pause"] and config["config"]["User"] == "65535:65535"
    (member,) = tarfile.open(fileobj=io.BytesIO(layer_bytes)).getmembers()
    assert member.name == "pause" and member.mode == 0o755 and member.size == program.stat().st_size


def test_every_pod_cgroup_lies_below_this_process(tmp_path):
    node = realnode.RealNode(tmp_path, tmp_path / "bin", tmp_path / "node-bin", tmp_path / "pki")
    own, v1 = realnode.own_cgroup()
    config = node.kubelet_config()
    assert config["cgroupRoot"] == f"{own.rstrip('/')}/specdecode-node"
    # QoS cgroups are how kubelet gives a pod a cgroup parent (below cgroupRoot); no limits on them.
    assert config["cgroupsPerQOS"] is True and config["enforceNodeAllocatable"] == []
    assert ("failCgroupV1" in config) == v1 and config.get("failCgroupV1", False) is False
    assert config["address"] == realnode.IP and config["authentication"]["anonymous"]["enabled"] is False
    for top in node._cgroup_tops():
        assert str(top).endswith(own.rstrip("/") + "/specdecode-node")


def test_containerd_keeps_its_state_sockets_and_network_namespaces_in_the_nodes_folder(tmp_path):
    node = realnode.RealNode(tmp_path, tmp_path / "bin", tmp_path / "node-bin", tmp_path / "pki")
    config = node.containerd_config()
    assert f'state = "{tmp_path / "state"}"' in config and f'address = "{tmp_path / "state"}/containerd.sock"' in config
    assert "netns_mounts_under_state_dir = true" in config and "restrict_oom_score_adj = true" in config
    assert f'sandbox = "{realnode.pause_image()}"' in config
    bridge = realnode.CNI_CONFIG["plugins"][0]
    assert bridge["bridge"] == realnode.BRIDGE
    assert bridge["ipam"]["ranges"][0][0] == {"subnet": realnode.POD_SUBNET, "gateway": realnode.IP}


def test_image_names_are_qualified_as_containerd_names_them():
    assert realnode._qualified("busybox") == "docker.io/library/busybox"
    assert realnode._qualified("me/app:1") == "docker.io/me/app:1"
    assert realnode._qualified("localhost/specdecode-worker:0.1.0") == "localhost/specdecode-worker:0.1.0"
    assert realnode._qualified("ghcr.io/specdecode/worker:0.1.0") == "ghcr.io/specdecode/worker:0.1.0"


def test_the_node_advertises_gpu_feature_discovery_labels_for_its_cpu_product():
    labels = realnode.node_labels()
    assert labels["nvidia.com/gpu.product"] == realnode.GPU_PRODUCT
    assert int(labels["nvidia.com/gpu.count"]) == realnode.GPUS
    assert int(labels["nvidia.com/gpu.memory"]) == realnode.GPU_MEMORY_MIB
    assert Path(realnode.HERE / "node.env").read_text().count("PAUSE_VERSION=") == 1
