"""The node agent's pure parts: the Node it registers, what a pod references, the volume a
claim gets, and the Service table from watched objects."""

from pathlib import Path

from kvfleet_localcluster.node_agent import NodeSpec
from kvfleet_localcluster.node_pods import references
from kvfleet_localcluster.provisioner import volume_for
from kvfleet_localcluster.services import table_of


def test_a_gpu_node_offers_its_gpus_and_names_their_product() -> None:
    spec = NodeSpec("gpu-a", gpus=8, gpu_product="NVIDIA-A100-SXM4-80GB", labels={"zone": "z1"})
    labels = spec.node_object()["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["kubernetes.io/hostname"] == "gpu-a" and labels["zone"] == "z1"
    status = spec.status(kubelet_port=10250)
    assert status["capacity"]["nvidia.com/gpu"] == "8"
    assert status["allocatable"] == status["capacity"]
    assert status["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 10250}}
    ready = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


def test_a_cpu_node_has_no_gpu_resource_or_product_label() -> None:
    spec = NodeSpec("cpu-a", gpus=0)
    assert "nvidia.com/gpu.product" not in spec.node_object()["metadata"]["labels"]
    assert "nvidia.com/gpu" not in spec.status(1)["capacity"]


def test_every_secret_configmap_and_claim_a_pod_uses_is_referenced() -> None:
    spec = {
        "volumes": [
            {"name": "keys", "secret": {"secretName": "api-keys"}},
            {"name": "conf", "configMap": {"name": "gw"}},
            {"name": "cache", "persistentVolumeClaim": {"claimName": "models"}},
            {"name": "proj", "projected": {"sources": [{"secret": {"name": "tok"}}]}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
        "containers": [
            {
                "envFrom": [{"configMapRef": {"name": "env"}}],
                "env": [
                    {"name": "A", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}},
                    {"name": "B", "value": "plain"},
                ],
            }
        ],
    }
    assert sorted(references(spec)) == [
        ("ConfigMap", "env"),
        ("ConfigMap", "gw"),
        ("PersistentVolumeClaim", "models"),
        ("Secret", "api-keys"),
        ("Secret", "hf"),
        ("Secret", "tok"),
    ]


def test_a_claim_gets_a_volume_of_its_class_size_and_modes_bound_to_it(tmp_path: Path) -> None:
    claim = {
        "metadata": {"name": "models", "namespace": "ai", "uid": "u-1"},
        "spec": {
            "storageClassName": "nfs-rwx",
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "200Gi"}},
        },
    }
    volume = volume_for(claim, tmp_path)
    spec = volume["spec"]
    assert volume["metadata"]["name"] == "pvc-u-1"
    assert spec["storageClassName"] == "nfs-rwx" and spec["accessModes"] == ["ReadWriteMany"]
    assert spec["capacity"] == {"storage": "200Gi"}
    assert spec["claimRef"]["uid"] == "u-1" and spec["claimRef"]["namespace"] == "ai"
    assert spec["hostPath"]["path"] == str(tmp_path / "ai_models")


def test_the_service_table_lists_ready_pods_of_the_selector_only() -> None:
    def pod(name: str, ip: str, ready: bool) -> dict[str, object]:
        return {
            "metadata": {"name": name, "namespace": "ai", "labels": {"app": "gw"}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    service = {
        "metadata": {"name": "gw", "namespace": "ai"},
        "spec": {"selector": {"app": "gw"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    table = table_of([pod("a", "127.0.0.2", True), pod("b", "127.0.0.3", False)], [service])
    assert table == {"gw.ai": [{"ip": "127.0.0.2", "ports": {"80": 8080}}]}
