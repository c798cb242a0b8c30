"""The local cluster: kmock's Kubernetes emulator extended with real API-server semantics
(`apiserver`, over a pure `store`), for the operator, the gateway's discovery and the demo."""
