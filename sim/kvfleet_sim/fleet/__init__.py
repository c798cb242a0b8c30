"""The fleet simulator: N engines in virtual time behind a router, with an optional scaler.

`workloads` makes request streams, `des` runs them (`model`: its config, replicas, what a
Scaler sees, the result), `collector` measures them. A Router picks a replica from snapshots
(what a gateway would see); a Scaler adds replicas (after a cold start) or drains them. Same
seed, same result.
"""
