"""The local cluster: the real Kubernetes control plane built from its Go modules
(`controlplane*.py`) and run as processes, node agents that run its pods as local processes
(`node_agent.py`, `kubelet.py`), the PKI, the `kvfleet cluster` CLI and the glue between them
(`local.py`), for the operator's tests, the gateway's discovery and the demo."""
